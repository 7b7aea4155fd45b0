"""`llama3_json`: bare JSON objects `{"name": ..., "parameters"|"arguments": {...}}` (Llama 3.x/4).

As `vllm/tool_parsers/llama_tool_parser.py`: every `{` not inside an object already read starts a
call (an optional `<|python_tag|>` before it, `;` or anything between calls); one that isn't a
readable call leaves the whole text as content; with calls the content is None (surrounding text
is dropped).
"""

from __future__ import annotations

import json
from typing import ClassVar

from harnessrl.gateway.tool_parse.base import Call, Parsed, ToolCallParser, tool_call

PYTHON_TAG = "<|python_tag|>"
_decoder = json.JSONDecoder()


class Llama3Json(ToolCallParser):
    """JSON objects anywhere in the text."""

    name = "llama3_json"
    call_starts: ClassVar[tuple[str, ...]] = (PYTHON_TAG, "{")

    def extract(self, text: str) -> Parsed:
        """Every object a call, or the whole text as content."""
        calls: list[Call] = []
        at = text.find("{")
        while at >= 0:
            try:
                value, end = _decoder.raw_decode(text, at)
                calls.append(_call(value))
            except ValueError:
                return text, []
            at = text.find("{", end + 1)  # vLLM skips a `{` right at an object's end too
        return (None, calls) if calls else (text, [])


def _call(value: dict[str, object]) -> Call:
    """A decoded object as a call; ValueError when it lacks a string name or its arguments."""
    name = value.get("name")
    if not isinstance(name, str) or not ("arguments" in value or "parameters" in value):
        raise ValueError("not a tool call")
    return tool_call(name, value["arguments"] if "arguments" in value else value["parameters"])

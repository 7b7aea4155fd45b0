"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/3, Hermes).

As `vllm/tool_parsers/hermes_tool_parser.py`: content is the text before the first call; an open
last call is read to the end of the text; one unreadable call leaves the whole text as content.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from harnessrl.gateway.tool_parse.base import Call, Parsed, ToolCallParser, tool_call

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class Hermes(ToolCallParser):
    """JSON calls inside `<tool_call>` tags."""

    name = "hermes"
    call_starts: ClassVar[tuple[str, ...]] = (START,)
    call_end = END

    def extract(self, text: str) -> Parsed:
        """Content before the first call, and every call; the whole text when one is unreadable."""
        if START not in text:
            return text, []
        try:
            calls = [_decode(closed or open_) for closed, open_ in _CALLS.findall(text)]
        except ValueError:
            return text, []
        return text[: text.find(START)] or None, calls


def _decode(raw: str) -> Call:
    """One call's JSON as a `tool_calls` entry; ValueError when it is not a call."""
    value = json.loads(raw)  # json.JSONDecodeError is a ValueError
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "arguments" not in value:
        raise ValueError("not a tool call")
    return tool_call(value["name"], value["arguments"])

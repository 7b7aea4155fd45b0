"""Tool calls out of sampled text, the way vLLM's `hermes` parser reads them (token-in mode).

In token-in mode the gateway samples through vLLM's completions route, which answers text, so the
chat answer's `tool_calls` are parsed here: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen2.5/3, Hermes), as `vllm.tool_parsers.hermes_tool_parser` does. Importing vLLM in the gateway
is too heavy; `test_token_in` checks this parser against vLLM's own answers. Unparseable JSON
leaves the whole text as content, as vLLM does.

`ToolCallStream` is the streamed form: content is released as it arrives, except a suffix that
could be the start of a `<tool_call>` tag; each call is released whole once its closing tag (or
the end of the text) arrives.
"""

from __future__ import annotations

import json
import re
from typing import Any

from harnessrl.shared.ids import new_id

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One chat `tool_calls` entry; arguments as a JSON string (`json.dumps`, as vLLM writes them)."""
    return {
        "id": new_id("call"),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """`(content, tool_calls)` of a whole answer; content None when only calls were sampled."""
    if START not in text:
        return text, []
    try:
        calls = [_decode(first or rest) for first, rest in _CALLS.findall(text)]
    except ValueError:
        return text, []
    content = text[: text.find(START)]
    return content or None, calls


def _decode(raw: str) -> dict[str, Any]:
    """One call's JSON as a `tool_calls` entry; ValueError when it is not a call."""
    value = json.loads(raw)  # json.JSONDecodeError is a ValueError
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "arguments" not in value:
        raise ValueError("not a tool call")
    return tool_call(value["name"], value["arguments"])


class ToolCallStream:
    """Streamed text in, content deltas and whole tool calls out."""

    __slots__ = ("_held", "_in_call", "calls", "text")

    def __init__(self) -> None:
        self.text = ""  # everything fed
        self._held = ""  # fed but not released: a possible tag start, or a call being sampled
        self._in_call = False
        self.calls: list[dict[str, Any]] = []

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """Content to release now and the calls completed by `delta`."""
        self.text += delta
        self._held += delta
        content, done = "", []
        while True:
            if self._in_call:
                end = self._held.find(END)
                if end < 0:
                    break
                raw, self._held = self._held[:end], self._held[end + len(END) :]
                self._in_call = False
                try:
                    done.append(self._call(raw))
                except ValueError:
                    # vLLM's parser would leave the whole answer as content; a stream can't take
                    # back what it released, so an unreadable call is released as content.
                    content += START + raw + END
                continue
            start = self._held.find(START)
            if start >= 0:
                content += self._held[:start]
                self._held = self._held[start + len(START) :]
                self._in_call = True
                continue
            keep = _partial_tag(self._held)
            content += self._held[: len(self._held) - keep]
            self._held = self._held[len(self._held) - keep :]
            break
        return content, done

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is still held at the end: an open call (parsed if it can be) or a partial tag."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        self._in_call = False
        try:
            return "", [self._call(held)]
        except ValueError:
            return START + held, []

    def _call(self, raw: str) -> dict[str, Any]:
        """The next call, numbered; ValueError when `raw` is not one."""
        call = _decode(raw)
        call["index"] = len(self.calls)
        self.calls.append(call)
        return call


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for size in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-size:]):
            return size
    return 0

"""What every tool-call format shares: the parser's contract, the chat `tool_calls` entry, the stream."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from harnessrl.shared.ids import new_id

Call = dict[str, Any]
Parsed = tuple[str | None, list[Call]]


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> Call:
    """One chat `tool_calls` entry; arguments as a JSON string (`json.dumps`, as vLLM writes them)."""
    return {
        "id": call_id or new_id("call"),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ToolCallParser(ABC):
    """One `--tool-call-parser` format: the calls and content of sampled text, as vLLM reads them.

    `call_starts` are the texts a call can begin with: a stream holds everything from the first one
    on (and a suffix that could be the start of one). `call_end`, when the format has one, closes a
    call, so a stream can release it before the answer ends.
    """

    name: ClassVar[str]
    call_starts: ClassVar[tuple[str, ...]]
    call_end: ClassVar[str | None] = None
    # vLLM's parser-engine formats: with no call, the chat route answers the parser's content
    # (markup dropped) rather than the text, when the reasoning parser is engine-based too.
    engine_based: ClassVar[bool] = False
    # With calls, the content is stripped: a stream holds trailing whitespace until text follows.
    strips_content: ClassVar[bool] = False

    def __init__(self, tools: list[Any] | None = None) -> None:
        self.tools = tools or []  # the request's `tools` (formats that type arguments by schema)

    def parse(self, text: str) -> Parsed:
        """`(content, tool_calls)` of a whole answer, as vLLM's chat route gives them.

        With calls, whitespace-only content is None (the chat route's own rule, any parser).
        """
        content, calls = self.extract(text)
        if calls and content is not None and not content.strip():
            content = None
        return content, calls

    @abstractmethod
    def extract(self, text: str) -> Parsed:
        """The format's own reading: vLLM's `extract_tool_calls(text).content` and `.tool_calls`."""

    def stream(self) -> ToolCallStream:
        """A streamed parse of one answer."""
        return ToolCallStream(self)


class ToolCallStream:
    """Streamed text in; content deltas and whole tool calls (with `index`) out.

    Content is released as it arrives up to the first call start (less a suffix that could begin
    one, and while it is only whitespace); from there on text is held. Each call is released once
    `call_end` closes it, the rest at `finish`, from the whole-text parse, so a stream ends with
    the calls `parse` gives. Content
    already released can't be taken back: where `parse` drops text before a call (llama3_json) or
    leaves a malformed call as content after earlier calls were released, the stream differs.
    """

    __slots__ = ("_closed_at", "_open", "_released", "calls", "parser", "text")

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""  # everything fed
        self._released = 0  # text[:_released] went out as content
        self._open = False  # a call start was seen: everything after it is held
        self._closed_at = -1  # where the last `call_end` parsed starts
        self.calls: list[Call] = []

    def feed(self, delta: str) -> tuple[str, list[Call]]:
        """Content to release now and the calls completed by `delta`."""
        self.text += delta
        content = "" if self._open else self._content()
        return content, self._closed() if self._open else []

    def finish(self) -> tuple[str, list[Call]]:
        """Content still held and the calls not yet released, from the whole answer's parse."""
        content, calls = self.parser.parse(self.text)
        released = self.text[: self._released]
        rest = content or ""
        if rest.startswith(released):
            rest = rest[len(released) :]
        return rest, self._new(calls)

    def _content(self) -> str:
        starts = self.parser.call_starts
        found = [at for at in (self.text.find(s, self._released) for s in starts) if at >= 0]
        if found:
            end, self._open = min(found), True
        else:
            end = len(self.text) - partial_tag(self.text, starts)
        out = self.text[self._released : end]
        if self.parser.strips_content:
            out = out.rstrip()
        if self._released == 0 and not out.strip():  # whitespace only so far: None if calls follow
            return ""
        self._released += len(out)
        return out

    def _closed(self) -> list[Call]:
        end = self.parser.call_end
        if end is None:
            return []
        last = self.text.rfind(end, self._closed_at + 1)
        if last < 0:  # no call closed since the last parse
            return []
        self._closed_at = last
        return self._new(self.parser.parse(self.text[: last + len(end)])[1])

    def _new(self, calls: list[Call]) -> list[Call]:
        new = [{**call, "index": at} for at, call in enumerate(calls) if at >= len(self.calls)]
        self.calls.extend(new)
        return new


def partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    longest = max((len(tag) for tag in tags), default=1)
    for size in range(min(len(text), longest - 1), 0, -1):
        if any(tag.startswith(text[-size:]) and len(tag) > size for tag in tags):
            return size
    return 0

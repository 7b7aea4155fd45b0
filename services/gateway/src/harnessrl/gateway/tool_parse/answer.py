"""A completions text as the chat route's answer: reasoning split off first, then tool calls.

As vLLM's `DelegatingParser.parse`: the reasoning parser (if one is set) splits the text; the tool
call parser (if the request parses tools: `tools` given, `tool_choice` not `none`) reads the
content (with no call found, vLLM keeps the text unless both parsers are engine-based);
`include_reasoning: false` drops the reasoning.
"""

from __future__ import annotations

from typing import Any

import msgspec

from harnessrl.gateway.reasoning_parse import ReasoningParser, ReasoningStream, reasoning_parser
from harnessrl.gateway.tool_parse import Call, ToolCallParser, ToolCallStream, tool_parser


class Answer(msgspec.Struct, frozen=True):
    """One choice's parsed answer (the chat message's `reasoning`, `content`, `tool_calls`)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[Call]


class AnswerParser:
    """The chat route's parse for one request (tool and reasoning parsers, either may be off)."""

    __slots__ = ("include_reasoning", "reasoning", "tools")

    def __init__(
        self,
        tools: ToolCallParser | None,
        reasoning: ReasoningParser | None,
        *,
        include_reasoning: bool = True,
    ) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning

    @classmethod
    def for_request(
        cls, body: dict[str, Any], tool_parser_name: str, reasoning_parser_name: str
    ) -> AnswerParser:
        """The parse the chat route would make of `body`'s answer, with the gateway's parser names."""
        parses_tools = bool(body.get("tools")) and body.get("tool_choice", "auto") != "none"
        return cls(
            tool_parser(tool_parser_name, body["tools"]) if parses_tools else None,
            reasoning_parser(reasoning_parser_name, body) if reasoning_parser_name else None,
            include_reasoning=body.get("include_reasoning", True) is not False,
        )

    def parse(self, text: str) -> Answer:
        """The whole answer."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        calls: list[Call] = []
        if self.tools is not None and content is not None:
            parsed, calls = self.tools.parse(content)
            if calls or self._engine_based():
                content = parsed
        return Answer(reasoning if self.include_reasoning else None, content, calls)

    def _engine_based(self) -> bool:
        """Whether vLLM would answer the tool parser's content when it found no call."""
        tools_engine = self.tools is not None and self.tools.engine_based
        return tools_engine and (self.reasoning is None or self.reasoning.engine_based)

    def stream(self) -> AnswerStream:
        """A streamed parse of one choice."""
        return AnswerStream(self)


class AnswerStream:
    """Streamed text in; reasoning deltas, content deltas and whole tool calls (`index`) out."""

    __slots__ = ("calls", "content", "include_reasoning", "reasoning", "splitter", "tools")

    def __init__(self, parser: AnswerParser) -> None:
        self.splitter: ReasoningStream | None = parser.reasoning.stream() if parser.reasoning else None
        self.tools: ToolCallStream | None = parser.tools.stream() if parser.tools else None
        self.include_reasoning = parser.include_reasoning
        self.reasoning: list[str] = []  # released so far
        self.content: list[str] = []
        self.calls: list[Call] = []

    def feed(self, text: str, *, done: bool) -> tuple[str, str, list[Call]]:
        """`(reasoning, content, calls)` released by `text` (`done`: it is the last)."""
        reasoning, content = self.splitter.feed(text) if self.splitter else ("", text)
        if done and self.splitter:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[Call] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if done:
                rest, more = self.tools.finish()
                content, calls = content + rest, calls + more
        reasoning = reasoning if self.include_reasoning else ""
        self.reasoning.append(reasoning)
        self.content.append(content)
        self.calls.extend(calls)
        return reasoning, content, calls

    def answer(self) -> Answer:
        """What was released, as the whole answer (what the client will send back)."""
        calls = [{k: v for k, v in call.items() if k != "index"} for call in self.calls]
        return Answer("".join(self.reasoning) or None, "".join(self.content) or None, calls)

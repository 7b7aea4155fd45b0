"""Reasoning out of sampled text, the way vLLM's `--reasoning-parser` splits it (token-in mode).

vLLM's chat route splits `<think>...</think>` off into the message's `reasoning` before it parses
tool calls; token-in mode samples through the completions route, so the split is made here
(`vllm/reasoning/basic_parsers.py`, `deepseek_r1_reasoning_parser.py`, `vllm/parser/qwen3.py`).
Importing vLLM in the gateway is too heavy; `test_tool_parse` checks these against vLLM's own.

- `deepseek_r1`: the text after the first `<think>` (the whole text without one) is reasoning up
  to the first `</think>`, content after it (None when empty); no `</think>`: all reasoning.
- `qwen3`: with thinking on (the request's `chat_template_kwargs.enable_thinking`, default on) the
  text is reasoning up to `</think>` or a `<tool_call>` (which starts the content); `<think>` is
  dropped from reasoning, every `</think>` from content; empty parts are None. Thinking off: all
  content (less `</think>`s).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from harnessrl.gateway.tool_parse.base import partial_tag

THINK, THINK_END, TOOL_CALL = "<think>", "</think>", "<tool_call>"
Split = tuple[str | None, str | None]


class ReasoningParser(ABC):
    """One `--reasoning-parser`: `(reasoning, content)` of an answer."""

    name: ClassVar[str]
    tags: ClassVar[tuple[str, ...]]  # a stream holds a suffix that could begin one of these
    engine_based: ClassVar[bool] = False  # vLLM's parser engine (see `ToolCallParser.engine_based`)

    def __init__(self, request: dict[str, Any] | None = None) -> None:
        kwargs = (request or {}).get("chat_template_kwargs")
        self.thinking = not isinstance(kwargs, dict) or bool(kwargs.get("enable_thinking", True))

    @abstractmethod
    def split(self, text: str) -> Split:
        """`(reasoning, content)` of the whole answer, as vLLM's `extract_reasoning`."""

    @abstractmethod
    def boundary(self, text: str) -> tuple[int, int] | None:
        """Where the reasoning ends and the content starts in `text`; None while it goes on."""

    def reasoning(self, text: str) -> str:
        """Text before the boundary as reasoning (a stream's; `split` is vLLM's whole reading)."""
        return text.replace(THINK, "")

    def content(self, text: str) -> str:
        """Text after the boundary as content."""
        return text

    def stream(self) -> ReasoningStream:
        """A streamed split of one answer."""
        return ReasoningStream(self)


class DeepSeekR1(ReasoningParser):
    """`<think>` optional (templates often put it in the prompt), `</think>` ends the reasoning."""

    name = "deepseek_r1"
    tags: ClassVar[tuple[str, ...]] = (THINK, THINK_END)

    def split(self, text: str) -> Split:
        """Reasoning (possibly empty) and content."""
        _, start, after = text.partition(THINK)
        reasoning, end, content = (after if start else text).partition(THINK_END)
        return (reasoning, content or None) if end else (reasoning, None)

    def boundary(self, text: str) -> tuple[int, int] | None:
        """At the first `</think>`."""
        at = text.find(THINK_END)
        return None if at < 0 else (at, at + len(THINK_END))


class Qwen3(ReasoningParser):
    """Thinking on unless the request turns it off; a tool call ends the reasoning too."""

    name = "qwen3"
    tags: ClassVar[tuple[str, ...]] = (THINK, THINK_END, TOOL_CALL)
    engine_based = True

    def split(self, text: str) -> Split:
        """Reasoning and content, empty ones None."""
        end, start = self.boundary(text) or (len(text), len(text))
        return self.reasoning(text[:end]) or None, self.content(text[start:]) or None

    def boundary(self, text: str) -> tuple[int, int] | None:
        """At the first `</think>` or `<tool_call>` (which is content); at once with thinking off."""
        if not self.thinking:
            return 0, 0
        ends = [(at, at + len(THINK_END)) for at in [text.find(THINK_END)] if at >= 0]
        ends += [(at, at) for at in [text.find(TOOL_CALL)] if at >= 0]
        return min(ends, default=None)

    def reasoning(self, text: str) -> str:
        """Without `<think>`s; none with thinking off."""
        return text.replace(THINK, "") if self.thinking else ""

    def content(self, text: str) -> str:
        """Without `</think>`s."""
        return text.replace(THINK_END, "")


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1, Qwen3)}


def reasoning_parser(name: str, request: dict[str, Any] | None = None) -> ReasoningParser:
    """The parser vLLM's `--reasoning-parser name` names; ValueError naming the known ones."""
    known = REASONING_PARSERS.get(name)
    if known is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return known(request)


class ReasoningStream:
    """Streamed text in, `(reasoning, content)` deltas out, ending as `split` of the whole text.

    Text is released as it arrives, less a suffix that could begin a tag: reasoning until the
    parser's boundary, content after it. Where the whole split reads differently (deepseek_r1
    drops text before a `<think>` that isn't first), the stream keeps what it released, as vLLM's
    own stream does.
    """

    __slots__ = ("_cut", "_ended", "parser", "text")

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._cut = 0  # text[:_cut] was released (a tag never straddles it)
        self._ended = False  # the boundary was passed: the rest is content

    def feed(self, delta: str) -> tuple[str, str]:
        """Reasoning and content to release now."""
        self.text += delta
        return self._release(len(self.text) - partial_tag(self.text, self.parser.tags))

    def finish(self) -> tuple[str, str]:
        """What is still held."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> tuple[str, str]:
        segment, self._cut = self.text[self._cut : upto], max(upto, self._cut)
        if self._ended:
            return "", self.parser.content(segment)
        found = self.parser.boundary(segment)
        if found is None:
            return self.parser.reasoning(segment), ""
        self._ended = True
        end, start = found
        return self.parser.reasoning(segment[:end]), self.parser.content(segment[start:])

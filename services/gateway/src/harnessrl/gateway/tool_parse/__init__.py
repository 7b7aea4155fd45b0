"""Tool calls out of sampled text, the way vLLM's `--tool-call-parser` reads them (token-in mode).

In token-in mode the gateway samples through vLLM's completions route, which answers text, so the
chat answer's `tool_calls` are parsed here, with the parser the gateway's `tool_parser` setting
names: the same name as vLLM's `--tool-call-parser` (`TOOL_PARSERS`). Importing vLLM in the gateway
is too heavy; `test_tool_parse` checks each format against vLLM's own parser classes.
`answer.AnswerParser` puts reasoning (`reasoning_parse`) and tool calls together as the chat route
does.
"""

from __future__ import annotations

from typing import Any

from harnessrl.gateway.tool_parse.base import Call, Parsed, ToolCallParser, ToolCallStream, tool_call
from harnessrl.gateway.tool_parse.hermes import Hermes
from harnessrl.gateway.tool_parse.llama3_json import Llama3Json
from harnessrl.gateway.tool_parse.mistral import Mistral
from harnessrl.gateway.tool_parse.qwen3_coder import Qwen3Coder

__all__ = [
    "TOOL_PARSERS",
    "Call",
    "Parsed",
    "ToolCallParser",
    "ToolCallStream",
    "tool_call",
    "tool_parser",
]

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (Hermes, Llama3Json, Mistral, Qwen3Coder)}


def tool_parser(name: str, tools: list[Any] | None = None) -> ToolCallParser:
    """The parser vLLM's `--tool-call-parser name` names, for a request's `tools`.

    ValueError naming the known ones for any other name.
    """
    known = TOOL_PARSERS.get(name)
    if known is None:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return known(tools)

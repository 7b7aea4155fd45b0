"""Anthropic tool use and thinking through the gateway, against scripted upstreams.

The tiny model can't call tools or think by itself, so these upstreams script vLLM's answers; the
real program against the real vLLM is `tests/test_claude_code.py`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from anthropic import AsyncAnthropic

from harnessrl.shared.bus.base import Bus
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for
from harnessrl.testkit.local_app import LocalApp

TOOLS: list[Any] = [{"name": "bash", "description": "Run a command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]  # fmt: skip


def _script(path: str, body: dict[str, Any]) -> dict[str, Any]:
    if body["messages"][-1]["role"] == "tool":
        return {"content": "Done.", "finish_reason": "stop"}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls"}'}}  # fmt: skip
    return {"content": "Let me look.", "tool_calls": [call], "finish_reason": "tool_calls"}


async def test_tool_use_round_trip_streamed_and_not(bus: Bus, episode: KeyedEpisode) -> None:
    upstream = CannedUpstream(script=_script)
    await upstream.start()
    try:
        async with serve_gateway(settings_for([upstream.url]), bus) as gateway:
            client = AsyncAnthropic(base_url=gateway.url, api_key=episode.key)
            ask: list[Any] = [{"role": "user", "content": "List files."}]
            reply = await client.messages.create(
                model="x", max_tokens=64, tools=TOOLS, messages=ask,
                tool_choice={"type": "auto"},
            )  # fmt: skip
            async with client.messages.stream(
                model="x",
                max_tokens=64,
                tools=TOOLS,
                messages=ask,
            ) as stream:
                streamed = await stream.get_final_message()
            for message in (reply, streamed):
                assert message.stop_reason == "tool_use"
                kinds = [block.type for block in message.content]
                assert kinds == ["text", "tool_use"]
                tool = message.content[1]
                assert (tool.name, tool.input, tool.id) == ("bash", {"command": "ls"}, "call_1")  # type: ignore[union-attr]
            follow_up = [
                *ask,
                {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "a.txt"}]},
            ]  # fmt: skip
            final = await client.messages.create(
                model="x",
                max_tokens=64,
                tools=TOOLS,
                messages=follow_up,
            )
            assert final.stop_reason == "end_turn"
            assert final.content[0].text == "Done."  # type: ignore[union-attr]
    finally:
        await upstream.stop()
    sent = upstream.bodies[-1]
    assert sent["tools"][0]["function"]["name"] == "bash"
    assert upstream.bodies[0]["tool_choice"] == "auto"
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool"]
    assert sent["messages"][1]["tool_calls"][0]["function"]["name"] == "bash"
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}
    spans = await episode.spans(bus)
    assert [s.api for s in spans] == ["messages"] * 3
    assert spans[2].parent_span == spans[1].span_id
    assert spans[0].completions[0].token_ids  # synthetic ids of the scripted reply were captured


# vLLM's chat wire format with a reasoning parser and the hermes tool parser, as the Messages route
# sees it: reasoning deltas, a chunk whose tokens the tool parser held back (ids and logprobs, no
# delta), the call's name, its arguments in two pieces, the usage chunk. Token ids are made up.
REASONING, ARGUMENTS = ("I will ", "list."), ('{"command": ', '"ls"}')
IDS = [11, 12, 13, 21, 22, 23]
LOGPROBS = [-0.5, -0.25, -0.125, -1.0, -0.75, -0.0625]
PROMPT = [1, 2, 3]


def _chunk(delta: dict[str, Any], position: int, finish: str | None = None) -> dict[str, Any]:
    logprobs = {"content": [{"token": "t", "logprob": LOGPROBS[position], "bytes": [], "top_logprobs": []}]}
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": [IDS[position]],
              "logprobs": logprobs}  # fmt: skip
    return {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "model": "tiny", "choices": [choice]}


def _reasoning_stream() -> list[dict[str, Any]]:
    call = {
        "index": 0,
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "bash", "arguments": ""},
    }
    chunks = [
        {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "model": "tiny", "prompt_token_ids": PROMPT,
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        _chunk({"reasoning": REASONING[0]}, 0),
        _chunk({"reasoning": REASONING[1]}, 1),
        _chunk({}, 2),
        _chunk({"tool_calls": [call]}, 3),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ARGUMENTS[0]}}]}, 4),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ARGUMENTS[1]}}]}, 5, "tool_calls"),
    ]  # fmt: skip
    usage = {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(IDS),
        "total_tokens": len(PROMPT) + len(IDS),
    }
    return [*chunks, {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "choices": [], "usage": usage}]


def _reasoning_completion() -> dict[str, Any]:
    call = {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "bash", "arguments": "".join(ARGUMENTS)},
    }
    message = {"role": "assistant", "content": None, "reasoning": "".join(REASONING), "tool_calls": [call]}
    logprobs = {"content": [{"token": "t", "logprob": v, "bytes": [], "top_logprobs": []} for v in LOGPROBS]}
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls",
        "token_ids": IDS,
        "logprobs": logprobs,
    }
    usage = {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(IDS),
        "total_tokens": len(PROMPT) + len(IDS),
    }
    return {"id": "chatcmpl-r1", "object": "chat.completion", "model": "tiny", "choices": [choice],
            "usage": usage, "prompt_token_ids": PROMPT}  # fmt: skip


class ReasoningUpstream:
    """vLLM's chat route as a reasoning model with tools answers it (streamed or not); records bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_get("/health", self._health)
        self._server = LocalApp(app)
        self.url = ""

    async def start(self) -> None:
        self.url = await self._server.start()

    async def stop(self) -> None:
        await self._server.stop()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["max_tokens"] > 1000:  # vLLM refuses a completion longer than the context
            error = {"message": "max_tokens is too large", "type": "BadRequestError", "code": 400}
            return web.json_response({"error": error}, status=400)
        if not body.get("stream"):
            return web.json_response(_reasoning_completion())
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for chunk in _reasoning_stream():
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def reasoning_gateway(bus: Bus) -> AsyncIterator[tuple[RunningGateway, ReasoningUpstream]]:
    upstream = ReasoningUpstream()
    await upstream.start()
    try:
        async with serve_gateway(settings_for([upstream.url]), bus) as gateway:
            yield gateway, upstream
    finally:
        await upstream.stop()


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


async def _stream_raw(url: str, key: str, body: dict[str, Any]) -> bytes:
    headers = {
        "x-api-key": key,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "interleaved-thinking-2025-05-14",
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/messages?beta=true", json=body, headers=headers) as response,
    ):
        assert response.status == 200, await response.text()
        return await response.read()


async def test_thinking_and_tool_use_relayed_and_every_token_captured(
    reasoning_gateway: tuple[RunningGateway, ReasoningUpstream], bus: Bus, episode: KeyedEpisode
) -> None:
    gateway, upstream = reasoning_gateway
    thinking = {"type": "enabled", "budget_tokens": 32}
    ask = {"model": "x", "max_tokens": 64, "tools": TOOLS, "thinking": thinking,
           "messages": [{"role": "user", "content": "List files."}]}  # fmt: skip
    reply = await AsyncAnthropic(base_url=gateway.url, api_key=episode.key).messages.create(**ask)  # type: ignore[call-overload]
    assert [b.type for b in reply.content] == ["thinking", "tool_use"]
    assert reply.content[0].thinking == "".join(REASONING) and reply.content[0].signature  # type: ignore[union-attr]
    assert (reply.content[1].name, reply.content[1].input) == ("bash", {"command": "ls"})  # type: ignore[union-attr]
    assert reply.stop_reason == "tool_use"

    events = _events(await _stream_raw(gateway.url, episode.key, {**ask, "stream": True}))
    kinds = [
        (name, (data.get("content_block") or data.get("delta") or {}).get("type")) for name, data in events
    ]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", "thinking"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", "tool_use"),
        ("content_block_delta", "input_json_delta"), ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None),
        ("message_delta", None),
        ("message_stop", None),
    ]  # fmt: skip
    assert [
        d["delta"]["thinking"] for n, d in events if d.get("delta", {}).get("type") == "thinking_delta"
    ] == list(REASONING)
    assert [
        d["delta"]["partial_json"] for n, d in events if d.get("delta", {}).get("type") == "input_json_delta"
    ] == list(ARGUMENTS)
    start = events[6][1]["content_block"]
    assert (start["id"], start["name"], start["input"]) == ("chatcmpl-tool-1", "bash", {})
    assert events[0][1]["message"]["usage"]["input_tokens"] == len(PROMPT)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert events[-2][1]["usage"]["output_tokens"] == len(IDS)

    # Every sampled token was captured, reasoning and the held-back chunk included, streamed or not.
    spans = await episode.spans(bus)
    assert [s.stream for s in spans] == [False, True]
    for span in spans:
        assert span.completions[0].token_ids == IDS
        assert span.completions[0].logprobs == LOGPROBS
        assert span.completions[0].finish_reason == "tool_calls"
    assert upstream.bodies[0]["thinking_token_budget"] == 32
    assert "thinking" not in upstream.bodies[0]


async def test_claude_code_history_reaches_the_template(
    reasoning_gateway: tuple[RunningGateway, ReasoningUpstream], episode: KeyedEpisode
) -> None:
    """Claude Code's request shape: billing header, inline system turn, thinking and tool blocks."""
    gateway, upstream = reasoning_gateway
    cached = {"type": "ephemeral"}
    body = {
        "model": "x", "max_tokens": 64, "stream": True, "tools": TOOLS,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332;"},
                   {"type": "text", "text": "You are an agent.", "cache_control": cached}],
        "metadata": {"user_id": "u"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}, "thinking": {"type": "adaptive", "display": "omitted"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "List files.", "cache_control": cached}]},
            {"role": "system", "content": "Reminder."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I will list.", "signature": "sig_r1"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False, "cache_control": cached,
                 "content": [{"type": "text", "text": "a.txt"}, {"type": "text", "text": "b.txt"}]}]},
        ],
    }  # fmt: skip
    await _stream_raw(gateway.url, episode.key, body)
    sent = upstream.bodies[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "List files."},
        {"role": "system", "content": "Reminder."},
        {"role": "assistant", "content": "", "reasoning": "I will list.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt\nb.txt"},
    ]  # fmt: skip
    assert sent["reasoning_effort"] == "high"
    assert not {"metadata", "context_management", "output_config", "thinking", "system"} & set(sent)
    assert sent["tools"][0]["function"] == {"name": "bash", "description": "Run a command.",
                                            "parameters": TOOLS[0]["input_schema"]}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_refusals_in_anthropic_envelope(
    reasoning_gateway: tuple[RunningGateway, ReasoningUpstream], bus: Bus, episode: KeyedEpisode, stream: bool
) -> None:
    """Images and unknown blocks are refused by the gateway, upstream errors re-wrapped; no span."""
    gateway, upstream = reasoning_gateway
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    document = {"type": "document", "source": {}}
    cases = [
        ([image], 8, "image blocks are not supported"),
        ([result], 8, "image blocks are not supported"),
        ([document], 8, "'document' is not supported"),
        ("hi", 5000, "max_tokens is too large"),
    ]
    headers = {"x-api-key": episode.key, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as session:
        for content, max_tokens, message in cases:
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
            async with session.post(
                gateway.url + "/v1/messages", json={**body, "stream": stream}, headers=headers
            ) as response:
                payload = await response.json(content_type=None)
            assert response.status == 400, payload
            assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error", payload
            assert message in payload["error"]["message"], payload
    assert len(upstream.bodies) == 1  # only the call vLLM itself refused got that far
    assert await episode.spans(bus) == []

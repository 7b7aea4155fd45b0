"""Responses (openai SDK) and Messages (anthropic SDK) through the gateway to the real vLLM server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from harnessrl.shared.bus.base import Bus
from harnessrl.shared.tokens import reconstruct_prompts
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for


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


async def test_count_tokens_and_models_pass_through(
    gateway: RunningGateway, vllm_server: VllmServer, bus: Bus, episode: KeyedEpisode
) -> None:
    client = AsyncAnthropic(base_url=gateway.url, api_key=episode.key)
    counted = await client.messages.count_tokens(
        model=vllm_server.model, messages=[{"role": "user", "content": "Hello"}]
    )
    assert counted.input_tokens > 0
    models = await AsyncOpenAI(base_url=gateway.url + "/v1", api_key=episode.key).models.list()
    assert [m.id for m in models.data] == [vllm_server.model]
    assert await episode.spans(bus) == []

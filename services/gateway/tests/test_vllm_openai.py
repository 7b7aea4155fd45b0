"""Chat and completions through the gateway to the real vLLM CPU server, driven by the openai SDK."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from harnessrl.shared.bus.base import Bus
from harnessrl.shared.tokens import reconstruct_prompts
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.gateway import KeyedEpisode, serve_gateway, settings_for

MESSAGES = [{"role": "user", "content": "What is 12*34?"}]


async def _direct(vllm: VllmServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Ask vLLM itself, with token ids, for the reference capture."""
    payload = {**body, "model": vllm.model, "return_token_ids": True, "logprobs": True}
    if path == "/v1/completions":
        payload["logprobs"] = 0
    async with aiohttp.ClientSession() as session, session.post(vllm.url + path, json=payload) as r:
        assert r.status == 200, await r.text()
        data: dict[str, Any] = await r.json()
        return data


@pytest.fixture
async def gateway(vllm_server: VllmServer, bus: Bus) -> Any:
    async with serve_gateway(settings_for([vllm_server.url], served_model=vllm_server.model), bus) as gw:
        yield gw


async def test_chat_non_streamed_and_streamed_capture_vllms_tokens(
    gateway: Any, vllm_server: VllmServer, bus: Bus, episode: KeyedEpisode
) -> None:
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key=episode.key)
    params: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0.0}
    reply = await client.chat.completions.create(model="anything", **params)
    reference = await _direct(vllm_server, "/v1/chat/completions", params)
    # The client sees a plain response: no injected fields.
    assert reply.choices[0].logprobs is None
    dumped = reply.model_dump()
    assert dumped.get("prompt_token_ids") is None
    assert dumped["choices"][0].get("token_ids") is None
    assert reply.choices[0].message.content == reference["choices"][0]["message"]["content"]

    chunks = [c async for c in await client.chat.completions.create(model="x", stream=True, **params)]
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed_text == reply.choices[0].message.content
    assert all(c.usage is None for c in chunks)  # the injected usage chunk is hidden

    spans = await episode.spans(bus)
    assert [s.seq for s in spans] == [0, 1]
    assert [s.stream for s in spans] == [False, True]
    prompts = reconstruct_prompts(spans)
    expected_ids = reference["choices"][0]["token_ids"]
    expected_logprobs = [c["logprob"] for c in reference["choices"][0]["logprobs"]["content"]]
    for span in spans:
        assert prompts[span.span_id] == reference["prompt_token_ids"]
        assert span.completions[0].token_ids == expected_ids
        assert span.completions[0].logprobs == pytest.approx(expected_logprobs, abs=1e-3)
        assert span.status == "ok"
        assert span.model == vllm_server.model
        assert span.usage.completion_tokens == len(expected_ids)
        assert span.upstream == vllm_server.url
    # The second call repeats the prompt: it is stored as a delta against the first span.
    assert spans[1].parent_span == spans[0].span_id
    assert spans[1].prefix_len == len(reference["prompt_token_ids"])


async def test_client_that_asks_for_token_ids_gets_them(gateway: Any, episode: KeyedEpisode) -> None:
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key=episode.key)
    reply = await client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=4, logprobs=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    dumped = reply.model_dump()
    assert dumped["prompt_token_ids"]
    assert len(dumped["choices"][0]["token_ids"]) == len(reply.choices[0].logprobs.content)  # type: ignore[union-attr]


async def test_episode_spans_reconstruct_a_growing_conversation(
    gateway: Any, vllm_server: VllmServer, bus: Bus, episode: KeyedEpisode
) -> None:
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key=episode.key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
    references = []
    for turn in range(3):
        params = {"messages": list(messages), "max_tokens": 6, "temperature": 0.0}
        reply = await client.chat.completions.create(model="x", **params)  # type: ignore[call-overload]
        references.append(await _direct(vllm_server, "/v1/chat/completions", params))
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"Turn {turn}: continue."},
        ]
    spans = await episode.spans(bus)
    prompts = reconstruct_prompts(spans)
    assert [prompts[s.span_id] for s in spans] == [r["prompt_token_ids"] for r in references]
    assert spans[2].parent_span == spans[1].span_id
    stored = sum(len(s.prompt_suffix_ids) for s in spans)
    assert stored < sum(len(r["prompt_token_ids"]) for r in references)


async def test_completions_non_streamed_and_streamed(
    gateway: Any, vllm_server: VllmServer, bus: Bus, episode: KeyedEpisode
) -> None:
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key=episode.key)
    params: dict[str, Any] = {"prompt": "12*34=", "max_tokens": 8, "temperature": 0.0}
    reply = await client.completions.create(model="x", **params)
    assert reply.choices[0].logprobs is None
    stream = await client.completions.create(model="x", stream=True, **params)
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == reply.choices[0].text
    reference = await _direct(vllm_server, "/v1/completions", params)
    spans = await episode.spans(bus)
    assert [s.api for s in spans] == ["completions", "completions"]
    prompts = reconstruct_prompts(spans)
    for span in spans:
        assert prompts[span.span_id] == reference["choices"][0]["prompt_token_ids"]
        assert span.completions[0].token_ids == reference["choices"][0]["token_ids"]
        assert span.completions[0].logprobs == pytest.approx(
            reference["choices"][0]["logprobs"]["token_logprobs"], abs=1e-3
        )

"""Token-in mode against a real vLLM CPU server whose chat template rewrites history.

The model (`rewriting_model`) drops `<think>...</think>` from earlier assistant turns and renders
tool-call arguments again with `tojson`, as real templates do. Structured outputs (a regex) make the
random model answer with reasoning, then with a hermes tool call, so each conversation has both.
In plain mode the next prompt does not extend the previous prompt + completion; in token-in mode
it does, on one gateway or two serving alternate calls; each captured completion equals what
vLLM samples for the same token prompt and seed (ids and logprobs), and the chat answer equals
the one vLLM's own chat route and `hermes` parser give for the same tokens.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from harnessrl.gateway.conversation import prefix_digests
from harnessrl.gateway.token_in import completions_body, splice
from harnessrl.gateway.tool_parse import tool_parser
from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import EpisodeScheduled, Span
from harnessrl.shared.ids import new_id
from harnessrl.shared.tokens import common_prefix_len, reconstruct_prompts, span_context
from harnessrl.stack.natsserver import NatsServer
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for
from harnessrl.testkit.model_fixtures import rewriting_model
from harnessrl.testkit.plugin import open_bus

__all__ = ["rewriting_model"]  # the fixture, used by `rewriting_vllm`

THINK = {"regex": r"<think>[a-z]{2,6}</think>\n[a-z]{2,6}"}
CALL = {"regex": r'<tool_call>\n\{"name":"get","arguments":\{"city":"[a-z]{2,5}"\}\}\n</tool_call>'}
CALL_TIMEOUT = aiohttp.ClientTimeout(total=90)  # a hung call fails in 90 s, not aiohttp's 300
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get",
            "description": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def rewriting_vllm(rewriting_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM on the rewriting model, for this module (its template differs from the session's)."""
    server = VllmServer(rewriting_model, log_file=tmp_path_factory.mktemp("vllm-tokin") / "vllm.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def module_bus(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[NatsBus]:
    """This module's own nats-server: replicas registered by earlier tests are not in the ring.

    (A stopped test replica's port can be taken by a listener that never answers HTTP, and every
    call an episode's hash sends there would hang.)
    """
    server = NatsServer(tmp_path_factory.mktemp("nats-tokin"))
    server.start()
    try:
        async with open_bus(server.url) as client:
            yield client
    finally:
        server.stop()


@pytest.fixture(scope="module")
async def gateways(
    rewriting_vllm: VllmServer, module_bus: NatsBus
) -> AsyncIterator[dict[str, RunningGateway]]:
    """Two token-in gateway replicas and a plain one, on one bus, in front of the same vLLM."""
    token_in = settings_for([rewriting_vllm.url], served_model=rewriting_vllm.model)
    assert token_in.token_in, "token-in is the gateway's default"
    plain_settings = msgspec.structs.replace(token_in, token_in=False)
    async with (
        serve_gateway(token_in, module_bus) as first,
        serve_gateway(token_in, module_bus) as second,
        serve_gateway(plain_settings, module_bus) as plain,
    ):
        yield {"first": first, "second": second, "plain": plain}


async def _post(url: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession(timeout=CALL_TIMEOUT) as session,
        session.post(url, json=body, headers=headers) as response,
    ):
        data = await response.json()
        assert response.status == 200, data
        return dict(data)


async def _chat(
    gateway: RunningGateway, episode: KeyedEpisode, messages: list[Any], **extra: Any
) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 80, **extra}
    return await _post(gateway.url + "/v1/chat/completions", episode.key, body)


async def _stream_chat(
    gateway: RunningGateway, episode: KeyedEpisode, messages: list[Any], **extra: Any
) -> list[dict[str, Any]]:
    """The chunks of a streamed call (SSE `data:` lines)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 80, "stream": True, **extra}
    chunks = []
    async with (
        aiohttp.ClientSession(timeout=CALL_TIMEOUT) as session,
        session.post(
            gateway.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {episode.key}"},
        ) as response,
    ):
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _streamed_message(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client assembles from chat chunks: content and tool calls."""
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                calls[call["index"]] = call
    tool_calls = [{k: v for k, v in calls[i].items() if k != "index"} for i in sorted(calls)]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}


async def _conversation(
    call: Any, gateway_for: Any, episode: KeyedEpisode, *, seed: int
) -> list[dict[str, Any]]:
    """Three calls: reasoning + text, then a tool call, then an answer after the tool result."""
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    answers = []
    for turn, forced in enumerate((THINK, CALL, None)):
        extra: dict[str, Any] = {"tools": TOOLS, "seed": seed + turn}
        if forced is not None:
            extra["structured_outputs"] = forced
        answer = await call(gateway_for(turn), episode, messages, **extra)
        answer["sent"] = list(messages)  # what the call sent, for `_assert_new_turns_rendered`
        answers.append(answer)
        message = answer["choices"][0]["message"]
        messages.append(
            {k: message[k] for k in ("role", "content", "tool_calls") if message.get(k) is not None}
        )
        if message.get("tool_calls"):
            call_id = message["tool_calls"][0]["id"]
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "sunny"})
        else:
            messages.append({"role": "user", "content": "weather in paris?"})
    return answers


def _extends(spans: list[Span]) -> list[bool]:
    """For each call after the first: does its prompt start with the previous prompt + completion?"""
    prompts = reconstruct_prompts(spans)
    return [
        prompts[later.span_id][: len(span_context(prompts[earlier.span_id], earlier))]
        == span_context(prompts[earlier.span_id], earlier)
        for earlier, later in itertools.pairwise(spans)
    ]


async def _assert_new_turns_rendered(
    vllm: VllmServer, spans: list[Span], answers: list[dict[str, Any]]
) -> None:
    """After the parent's context, each prompt is the template's render of the new turns only:
    the tail of vLLM's own render of the request, starting just after a turn's end token."""
    prompts = reconstruct_prompts(spans)
    probe = {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False}
    end_of_turn = (await _post(vllm.url + "/tokenize", "unused", probe))["tokens"][-2]
    for earlier, later, answer in zip(spans, spans[1:], answers[1:], strict=False):
        request = {"messages": answer["sent"], "tools": TOOLS, "add_generation_prompt": True}
        full = (await _post(vllm.url + "/tokenize", "unused", request))["tokens"]
        context = span_context(prompts[earlier.span_id], earlier)
        tail = prompts[later.span_id][len(context) :]
        if context[-1] != end_of_turn:  # it stopped on another token: the turn's end is bridged
            assert tail[0] == end_of_turn
            tail = tail[1:]
        assert tail == full[len(full) - len(tail) :]
        assert full[len(full) - len(tail) - 1] == end_of_turn


async def test_plain_mode_rerenders_so_calls_do_not_extend(
    gateways: dict[str, RunningGateway], module_bus: NatsBus, say: Callable[[str], None]
) -> None:
    plain, tokin = KeyedEpisode(), KeyedEpisode()
    answers = await _conversation(_chat, lambda _: gateways["plain"], plain, seed=11)
    await _conversation(_chat, lambda _: gateways["first"], tokin, seed=11)
    assert answers[1]["choices"][0]["message"]["tool_calls"], "the forced tool call was not parsed"
    spans = await plain.spans(module_bus)
    assert [span.token_in for span in spans] == [None, None, None]
    assert _extends(spans) == [False, False]
    for name, episode in (("plain", plain), ("token-in", tokin)):
        kept, sampled = _sampled_tokens_kept(await episode.spans(module_bus))
        latency = [round(span.latency_s * 1000) for span in await episode.spans(module_bus)]
        say(f"{name}: {kept}/{sampled} sampled tokens of calls 1-2 reused as sampled; latency ms {latency}")


def _sampled_tokens_kept(spans: list[Span]) -> tuple[int, int]:
    """Of the completions before the last call: how many tokens the next prompt repeats exactly."""
    prompts = reconstruct_prompts(spans)
    kept = sampled = 0
    for earlier, later in itertools.pairwise(spans):
        prompt, completion = prompts[earlier.span_id], earlier.completions[0].token_ids
        shared = common_prefix_len(span_context(prompt, earlier), prompts[later.span_id])
        kept += max(0, min(shared - len(prompt), len(completion)))
        sampled += len(completion)
    return kept, sampled


async def test_token_in_calls_extend_the_sampled_history(
    gateways: dict[str, RunningGateway], module_bus: NatsBus, rewriting_vllm: VllmServer
) -> None:
    episode = KeyedEpisode()
    answers = await _conversation(_chat, lambda _: gateways["first"], episode, seed=11)
    spans = await episode.spans(module_bus)
    assert [span.token_in for span in spans] == ["fresh", "extended", "extended"]
    assert _extends(spans) == [True, True]
    await _assert_new_turns_rendered(rewriting_vllm, spans, answers)
    assert [span.parent_span for span in spans[1:]] == [spans[0].span_id, spans[1].span_id]
    message = answers[1]["choices"][0]["message"]
    assert answers[1]["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"][0]["function"]["name"] == "get"
    assert "<think>" in answers[0]["choices"][0]["message"]["content"]


async def test_replicas_serving_alternate_calls_still_splice(
    gateways: dict[str, RunningGateway], module_bus: NatsBus, rewriting_vllm: VllmServer
) -> None:
    episode = KeyedEpisode()
    replicas = [gateways["first"], gateways["second"]]
    answers = await _conversation(_chat, lambda turn: replicas[turn % 2], episode, seed=23)
    spans = await episode.spans(module_bus)
    assert [span.seq for span in spans] == [0, 1, 2]
    assert [span.token_in for span in spans] == ["fresh", "extended", "extended"]
    assert _extends(spans) == [True, True]
    await _assert_new_turns_rendered(rewriting_vllm, spans, answers)


async def test_streamed_token_in_calls_extend_and_match_non_streamed(
    gateways: dict[str, RunningGateway], module_bus: NatsBus
) -> None:
    async def streamed(
        gateway: RunningGateway, episode: KeyedEpisode, messages: list[Any], **extra: Any
    ) -> dict[str, Any]:
        chunks = await _stream_chat(gateway, episode, messages, **extra)
        finish = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")]
        return {"choices": [{"message": _streamed_message(chunks), "finish_reason": finish[-1]}]}

    streamed_episode, whole_episode = KeyedEpisode(), KeyedEpisode()
    streamed_answers = await _conversation(streamed, lambda _: gateways["first"], streamed_episode, seed=31)
    whole_answers = await _conversation(_chat, lambda _: gateways["second"], whole_episode, seed=31)
    spans = await streamed_episode.spans(module_bus)
    assert [span.token_in for span in spans] == ["fresh", "extended", "extended"]
    assert all(span.stream for span in spans)
    assert _extends(spans) == [True, True]
    whole = await whole_episode.spans(module_bus)
    assert [s.completions[0].token_ids for s in spans] == [s.completions[0].token_ids for s in whole]
    for got, want in zip(streamed_answers, whole_answers, strict=True):
        got_message, want_message = got["choices"][0]["message"], want["choices"][0]["message"]
        assert got_message["content"] == want_message["content"]
        assert _calls(got_message) == _calls(want_message)
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]


async def test_captured_completions_are_what_vllm_samples_for_the_token_prompt(
    gateways: dict[str, RunningGateway], module_bus: NatsBus, rewriting_vllm: VllmServer
) -> None:
    episode = KeyedEpisode()
    await _conversation(_chat, lambda _: gateways["first"], episode, seed=41)
    spans = await episode.spans(module_bus)
    prompts = reconstruct_prompts(spans)
    for turn, span in enumerate(spans):
        forced = (THINK, CALL, None)[turn]
        body: dict[str, Any] = {
            "model": rewriting_vllm.model, "prompt": prompts[span.span_id], "max_tokens": 80,
            "seed": 41 + turn, "logprobs": 0, "return_token_ids": True,
        }  # fmt: skip
        if forced is not None:
            body["structured_outputs"] = forced
        direct = (await _post(rewriting_vllm.url + "/v1/completions", "unused", body))["choices"][0]
        completion = span.completions[0]
        assert completion.token_ids == direct["token_ids"]
        assert completion.logprobs == pytest.approx(direct["logprobs"]["token_logprobs"], abs=1e-4)
        assert span.prompt_len == len(prompts[span.span_id])


async def test_answers_equal_vllm_chat_route_for_the_same_tokens(
    gateways: dict[str, RunningGateway], module_bus: NatsBus, rewriting_vllm: VllmServer
) -> None:
    """A fresh call's prompt is the plain render, so both routes sample the same tokens: the
    gateway's own parse must give vLLM's answer (content, hermes tool calls, finish reason)."""
    messages = [{"role": "user", "content": "weather?"}]
    for forced in (THINK, CALL):
        extra = {"tools": TOOLS, "seed": 5, "structured_outputs": forced}
        tokin, plain = KeyedEpisode(), KeyedEpisode()
        got = (await _chat(gateways["first"], tokin, messages, **extra))["choices"][0]
        want = (await _chat(gateways["plain"], plain, messages, **extra))["choices"][0]
        tokin_span, plain_span = (await tokin.spans(module_bus))[0], (await plain.spans(module_bus))[0]
        assert tokin_span.token_in == "fresh"
        assert tokin_span.prompt_suffix_ids == plain_span.prompt_suffix_ids  # same render
        assert tokin_span.completions[0].token_ids == plain_span.completions[0].token_ids
        assert got["message"]["content"] == want["message"]["content"]
        assert _calls(got["message"]) == _calls(want["message"])
        assert got["finish_reason"] == want["finish_reason"]


async def test_rewritten_history_branches(gateways: dict[str, RunningGateway], module_bus: NatsBus) -> None:
    episode = KeyedEpisode()
    first = await _chat(gateways["first"], episode, [{"role": "user", "content": "hi"}], seed=3)
    edited = {"role": "assistant", "content": first["choices"][0]["message"]["content"] + " (edited)"}
    await _chat(
        gateways["first"],
        episode,
        [{"role": "user", "content": "hi"}, edited, {"role": "user", "content": "go"}],
    )
    spans = await episode.spans(module_bus)
    assert [span.token_in for span in spans] == ["fresh", "branched"]
    assert _extends(spans) == [False]
    metrics = gateways["first"].gateway.metrics.render().decode()
    assert 'harnessrl_gateway_token_in_calls_total{case="branched",reason=""}' in metrics


async def test_a_first_call_with_few_shot_turns_is_fresh(
    gateways: dict[str, RunningGateway], module_bus: NatsBus
) -> None:
    episode = KeyedEpisode()
    shots = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    await _chat(gateways["first"], episode, [*shots, {"role": "user", "content": "2+2"}])
    assert [span.token_in for span in await episode.spans(module_bus)] == ["fresh"]


async def test_the_run_decides_over_the_gateway_default(
    gateways: dict[str, RunningGateway], module_bus: NatsBus
) -> None:
    episode = KeyedEpisode(run=new_id("plainrun"))
    scheduled = EpisodeScheduled(
        run=episode.run, episode=episode.episode, task="t", group="g", token_in=False
    )
    subject = subjects.episode_event(episode.run, episode.episode, "scheduled")
    await module_bus.publish(subject, scheduled, msg_id=f"{episode.run}:{episode.episode}:scheduled")
    await _chat(gateways["first"], episode, [{"role": "user", "content": "hi"}])
    assert [span.token_in for span in await episode.spans(module_bus)] == [None]


ANTHROPIC_TOOLS = [
    {"name": "get", "description": "weather", "input_schema": TOOLS[0]["function"]["parameters"]}
]
RESPONSES_TOOLS = [{"type": "function", "name": "get", "parameters": TOOLS[0]["function"]["parameters"]}]


async def test_a_replica_without_tokenize_gets_plain_calls_counted(module_bus: NatsBus) -> None:
    """An OpenAI-compatible server that isn't vLLM: token-in falls back to plain, asked once."""
    upstream = CannedUpstream()
    await upstream.start()
    episode = KeyedEpisode()
    try:
        async with serve_gateway(settings_for([upstream.url]), module_bus) as gateway:
            for _ in range(3):
                await _chat(gateway, episode, [{"role": "user", "content": "hi"}])
            metrics = gateway.gateway.metrics.render().decode()
    finally:
        await upstream.stop()
    assert [span.token_in for span in await episode.spans(module_bus)] == [None] * 3
    assert [body.get("messages") is not None for body in upstream.bodies] == [True] * 3
    assert upstream.renders_asked == 1
    assert 'harnessrl_gateway_token_in_calls_total{case="plain",reason="no_render"} 3.0' in metrics


async def test_messages_calls_extend_through_thinking_and_tool_use(
    gateways: dict[str, RunningGateway], module_bus: NatsBus
) -> None:
    episode, url = KeyedEpisode(), gateways["first"].url + "/v1/messages"
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    body = {"model": "tiny", "max_tokens": 80, "tools": ANTHROPIC_TOOLS}
    first = await _post(
        url, episode.key, {**body, "messages": messages, "structured_outputs": THINK, "seed": 1}
    )
    messages += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "weather?"}]
    second = await _post(
        url, episode.key, {**body, "messages": messages, "structured_outputs": CALL, "seed": 2}
    )
    assert second["stop_reason"] == "tool_use"
    use = next(block for block in second["content"] if block["type"] == "tool_use")
    result = {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}
    messages += [{"role": "assistant", "content": second["content"]}, {"role": "user", "content": [result]}]
    await _post(url, episode.key, {**body, "messages": messages, "seed": 3})
    spans = await episode.spans(module_bus)
    assert [span.token_in for span in spans] == ["fresh", "extended", "extended"]
    assert _extends(spans) == [True, True]


async def test_responses_calls_extend_through_function_calls(
    gateways: dict[str, RunningGateway], module_bus: NatsBus
) -> None:
    episode, url = KeyedEpisode(), gateways["second"].url + "/v1/responses"
    items: list[Any] = [{"role": "user", "content": "hello"}]
    body = {"model": "tiny", "max_output_tokens": 80, "tools": RESPONSES_TOOLS}
    first = await _post(url, episode.key, {**body, "input": items, "structured_outputs": THINK, "seed": 1})
    items += [*first["output"], {"role": "user", "content": "weather?"}]
    second = await _post(url, episode.key, {**body, "input": items, "structured_outputs": CALL, "seed": 2})
    call = next(item for item in second["output"] if item["type"] == "function_call")
    items += [
        *second["output"],
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
    ]
    await _post(url, episode.key, {**body, "input": items, "seed": 3})
    spans = await episode.spans(module_bus)
    assert [span.token_in for span in spans] == ["fresh", "extended", "extended"]
    assert _extends(spans) == [True, True]


async def _events(url: str, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON payloads of a streamed call's events."""
    headers = {"authorization": f"Bearer {key}"}
    events = []
    async with (
        aiohttp.ClientSession(timeout=CALL_TIMEOUT) as session,
        session.post(url, json=body, headers=headers) as response,
    ):
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/messages",
            {"max_tokens": 80, "tools": ANTHROPIC_TOOLS, "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("/v1/responses", {"max_output_tokens": 80, "tools": RESPONSES_TOOLS, "input": "hi"}),
    ],
)
async def test_streamed_messages_and_responses_carry_the_parsed_tool_call(
    gateways: dict[str, RunningGateway], module_bus: NatsBus, path: str, body: dict[str, Any]
) -> None:
    streamed, whole = KeyedEpisode(), KeyedEpisode()
    request = {"model": "tiny", **body, "structured_outputs": CALL, "seed": 9}
    events = await _events(gateways["first"].url + path, streamed.key, {**request, "stream": True})
    answer = await _post(gateways["first"].url + path, whole.key, request)
    (span,), (whole_span,) = await streamed.spans(module_bus), await whole.spans(module_bus)
    assert (span.token_in, span.status, span.stream) == ("fresh", "ok", True)
    assert span.completions[0].token_ids == whole_span.completions[0].token_ids
    if path == "/v1/messages":
        started = [e["content_block"] for e in events if e.get("type") == "content_block_start"]
        assert [b["name"] for b in started if b["type"] == "tool_use"] == ["get"]
        assert [b["name"] for b in answer["content"] if b["type"] == "tool_use"] == ["get"]
    else:
        done = [e["item"] for e in events if e.get("type") == "response.output_item.done"]
        calls = [item for item in done if item["type"] == "function_call"]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (item["name"], json.loads(item["arguments"]))
            for item in answer["output"]
            if item["type"] == "function_call"
        ]
        assert len(calls) == 1


# --- pure parts ---------------------------------------------------------------------------------


def test_an_answer_without_a_client_limit_may_fill_the_window_as_on_the_chat_route() -> None:
    """vLLM's completions stop at 16 tokens by default; its chat route fills the context window."""
    chat = {"messages": [], "temperature": 0.5, "logprobs": True, "top_logprobs": 2, "stream": True}
    sent = completions_body(chat, [1, 2, 3], 100)
    assert (sent["max_tokens"], sent["prompt"], sent["temperature"], sent["logprobs"]) == (
        97,
        [1, 2, 3],
        0.5,
        2,
    )
    assert "messages" not in sent and sent["stream_options"] == {"include_usage": True}
    assert completions_body({**chat, "max_tokens": 8}, [1, 2, 3], 100)["max_tokens"] == 8
    assert completions_body({**chat, "max_completion_tokens": 9}, [1], 100)["max_tokens"] == 9
    assert completions_body(chat, [1] * 100, 100)["max_tokens"] == 1  # vLLM then refuses the prompt
    assert completions_body(chat, [1], None)["max_tokens"] is None


def test_any_json_messages_have_digests() -> None:
    """Whatever a client sends as messages is digested (the gateway fuzz test found a 500 here)."""
    odd = [{"tool_calls": 5}, {"tool_calls": True}, {"tool_calls": "x"}, {"content": [{"text": 1}]}, 3, None]
    deep = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}]}
    digests = prefix_digests([*odd, deep])
    assert len(digests) == len(set(digests)) == 7
    assert prefix_digests([{"role": "user", "tool_calls": 5}]) == prefix_digests([{"role": "user"}])


def test_splice_bridges_a_completion_that_did_not_end_its_turn() -> None:
    end, newline, start = 2, 10, 1
    terminator = [end, newline]
    history = [start, 5, end, newline, start, 6, 7, end, newline]  # user turn, re-rendered answer
    full = [start, 5, end, newline, start, 6, end, newline, start, 8, end, newline, start, 9]
    parent = [start, 5, end, newline, start, 6, 7, 7]  # the sampled answer, cut before its end
    assert splice([*parent, end], history, full, terminator) == [
        *parent,
        end,
        newline,
        start,
        8,
        end,
        newline,
        start,
        9,
    ]
    assert splice(parent, history, full, terminator) == [
        *parent,
        end,
        newline,
        start,
        8,
        end,
        newline,
        start,
        9,
    ]
    assert splice(parent, history[:-1], full, terminator) is None  # history must end a turn


def test_tool_call_stream_releases_content_and_whole_calls() -> None:
    text = 'ok <tool_call>\n{"name": "get", "arguments": {"city": "x"}}\n</tool_call>'
    hermes = tool_parser("hermes")
    stream = hermes.stream()
    released, calls = "", []
    for piece in [text[i : i + 3] for i in range(0, len(text), 3)]:
        content, done = stream.feed(piece)
        assert "<" not in content
        released += content
        calls += done
    rest, more = stream.finish()
    assert (released + rest, len(calls + more)) == ("ok ", 1)
    assert hermes.parse(text)[0] == "ok "
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "x"}
    assert hermes.parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])

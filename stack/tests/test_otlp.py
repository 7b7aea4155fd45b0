"""`harnessrl otlp`: LLM-call spans to a real OTLP/HTTP receiver, each once, through outages and restarts.

Against the session's real nats-server and the test kit's OTLP/HTTP receiver (opentelemetry-proto
on aiohttp). Spans come from a real gateway in front of the canned upstream (GenAI attributes,
timing, content) or, where only their number matters, are published as the gateway publishes them.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import Span
from harnessrl.shared.net import free_port
from harnessrl.stack.natsserver import NatsServer
from harnessrl.stack.otlp import (
    OtlpError,
    OtlpMetrics,
    OtlpOptions,
    PromptText,
    counts,
    export_spans,
    load_tokenizer,
    span_id,
    trace_id,
)
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import KeyedEpisode, serve_gateway, settings_for
from harnessrl.testkit.otlp_receiver import OtlpReceiver, ReceivedSpan, export_once
from harnessrl.testkit.prometheus import scrape
from harnessrl.testkit.span_sequences import EpisodeRecorder

CLIENT = 3  # SPAN_KIND_CLIENT
STATUS_ERROR = 2
CONTENT_KEYS = ("gen_ai.output.messages", "gen_ai.input.messages", "harnessrl.prompt.suffix_token_ids")


def new_run() -> str:
    return f"otlp{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    server = OtlpReceiver()
    await server.start()
    yield server
    await server.stop()


def options(nats_server: NatsServer, receiver: OtlpReceiver, run: str, **given: object) -> OtlpOptions:
    values: dict[str, object] = {"first_backoff_s": 0.05, "max_backoff_s": 0.5, "until_idle_s": 1.0}
    return OtlpOptions(endpoint=receiver.url, nats_url=nats_server.url, run=run, **{**values, **given})  # type: ignore[arg-type]


async def publish_spans(bus: NatsBus, run: str, episodes: int, turns: int, *, first: int = 0) -> list[Span]:
    """Multi-turn episodes' spans, published as the gateway publishes them."""
    rng = random.Random(f"{run}-{first}")
    spans = []
    for number in range(first, first + episodes):
        recorder = EpisodeRecorder(run, f"{run}-e{number}")
        context = [rng.randrange(10, 500) for _ in range(8)]
        for turn in range(turns):
            completion = [rng.randrange(10, 500) for _ in range(4)]
            status = "error" if turn == turns - 1 and number % 2 else "ok"
            recorder.call(context, completion, version=number, status=status)
            context = [*context, *completion, 7]
        for span in recorder.spans:
            await bus.publish(subjects.span(run, span.episode), span, msg_id=span.span_id)
        spans.extend(recorder.spans)
    return spans


def by_gateway_id(receiver: OtlpReceiver) -> dict[str, ReceivedSpan]:
    return {span.attributes["harnessrl.span_id"]: span for span in receiver.unique().values()}


async def gateway_calls(bus: NatsBus, run: str) -> tuple[list[KeyedEpisode], list[Span]]:
    """Two episodes of real calls through the gateway: chat (two turns, sampling set) and completions."""
    episodes = [KeyedEpisode(run=run), KeyedEpisode(run=run)]
    canned = CannedUpstream()
    await canned.start()
    try:
        async with serve_gateway(settings_for([canned.url]), bus) as gateway, aiohttp.ClientSession() as http:
            for turn in range(2):
                body = {
                    "model": "policy", "temperature": 0.7, "top_p": 0.9, "max_tokens": 32,
                    "messages": [{"role": "user", "content": f"question {turn}"}],
                }  # fmt: skip
                headers = {"authorization": f"Bearer {episodes[0].key}"}
                async with http.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
            headers = {"authorization": f"Bearer {episodes[1].key}"}
            body = {"model": "policy", "prompt": "once upon", "max_tokens": 8, "stream": True}
            async with http.post(f"{gateway.url}/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                await r.read()
    finally:
        await canned.stop()
    spans = [span for episode in episodes for span in await episode.spans(bus)]
    return episodes, spans


async def test_gateway_spans_arrive_once_as_genai_client_spans_without_content(
    nats_server: NatsServer, bus: NatsBus, receiver: OtlpReceiver
) -> None:
    run = new_run()
    episodes, spans = await gateway_calls(bus, run)
    assert len(spans) == 3
    metrics = OtlpMetrics()
    done = await export_spans(options(nats_server, receiver, run), metrics=metrics)

    assert (done.exported, done.failures, done.refused) == (3, 0, 0)
    assert len(receiver.received) == 3 and receiver.duplicates() == 0
    got = by_gateway_id(receiver)
    for span in spans:
        otlp = got[span.span_id]
        attrs = otlp.attributes
        assert otlp.kind == CLIENT
        assert otlp.trace_id == trace_id(run, span.episode).hex()
        assert otlp.span_id == span_id(run, span.episode, span.span_id).hex()
        assert otlp.start_ns == round(span.started_at * 1e9) and otlp.start_ns > 1.7e18
        assert otlp.end_ns - otlp.start_ns == round(span.latency_s * 1e9) > 0
        assert otlp.status_code == 0
        assert otlp.resource["service.name"] == "harnessrl"
        assert attrs["gen_ai.request.model"] == "policy"
        assert attrs["gen_ai.response.model"] == span.model
        assert attrs["gen_ai.provider.name"] == attrs["gen_ai.system"] == "openai"
        assert attrs["gen_ai.usage.input_tokens"] == span.usage.prompt_tokens > 0
        assert attrs["gen_ai.usage.output_tokens"] == span.usage.completion_tokens > 0
        assert attrs["gen_ai.response.finish_reasons"] == [span.completions[0].finish_reason]
        assert (attrs["harnessrl.run_id"], attrs["harnessrl.episode_id"]) == (run, span.episode)
        assert (attrs["harnessrl.span_seq"], attrs["harnessrl.policy_version"]) == (span.seq, 0)
        assert attrs["server.address"] == "127.0.0.1"
        assert attrs["user_agent.original"] == span.client and "aiohttp/" in span.client
        assert not [key for key in CONTENT_KEYS if key in attrs]
    chat = [got[s.span_id] for s in spans if s.episode == episodes[0].episode]
    assert {s.attributes["gen_ai.operation.name"] for s in chat} == {"chat"}
    assert chat[0].name == "chat policy"
    assert (chat[0].attributes["gen_ai.request.temperature"], chat[0].attributes["gen_ai.request.top_p"]) == (
        0.7,
        0.9,
    )
    assert chat[0].attributes["gen_ai.request.max_tokens"] == 32
    assert chat[1].links == [(chat[1].trace_id, chat[0].span_id)]  # the delta parent
    (text,) = [got[s.span_id] for s in spans if s.episode == episodes[1].episode]
    assert text.attributes["gen_ai.operation.name"] == "text_completion"
    assert text.attributes["gen_ai.request.stream"] is True
    assert text.attributes["gen_ai.response.time_to_first_chunk"] > 0
    assert chat[0].trace_id != text.trace_id


async def test_include_content_sends_completion_text_and_tokens(
    nats_server: NatsServer, bus: NatsBus, receiver: OtlpReceiver
) -> None:
    run = new_run()
    _, spans = await gateway_calls(bus, run)
    await export_spans(options(nats_server, receiver, run, include_content=True))

    got = by_gateway_id(receiver)
    assert len(got) == len(spans) == 3
    for span in spans:
        attrs = got[span.span_id].attributes
        (message,) = json.loads(attrs["gen_ai.output.messages"])
        assert (
            message["role"] == "assistant" and message["finish_reason"] == span.completions[0].finish_reason
        )
        assert message["parts"] == [{"type": "text", "content": span.completions[0].text}]
        assert span.completions[0].text or span.api == "completions"  # the canned upstream speaks chat
        assert attrs["harnessrl.completion.0.token_ids"] == span.completions[0].token_ids
        assert attrs["harnessrl.prompt.suffix_token_ids"] == span.prompt_suffix_ids
        assert "gen_ai.input.messages" not in attrs  # no prompt text without a tokenizer


async def test_with_a_tokenizer_each_prompt_goes_as_text(
    nats_server: NatsServer, bus: NatsBus, receiver: OtlpReceiver, tiny_model: Path
) -> None:
    tokenizer = load_tokenizer(tiny_model)
    run = new_run()
    recorder = EpisodeRecorder(run, f"{run}-e0")
    turns = ["What is two plus two?", "And three plus three?", "Thanks."]
    context: list[int] = []
    for number, question in enumerate(turns):
        prompt = [*context, *tokenizer.encode(f"<|im_start|>user\n{question}<|im_end|>\n").ids]
        recorder.call(prompt, tokenizer.encode(f"answer {number}").ids)
        context = [*prompt, *recorder.spans[-1].completions[0].token_ids]
    for span in recorder.spans:
        await bus.publish(subjects.span(run, span.episode), span, msg_id=span.span_id)
    await export_spans(options(nats_server, receiver, run, include_content=True, tokenizer=tiny_model))

    got = by_gateway_id(receiver)
    texts = []
    for span in recorder.spans:
        (message,) = json.loads(got[span.span_id].attributes["gen_ai.input.messages"])
        assert message["role"] == "user"
        texts.append(message["parts"][0]["content"])
    assert texts[0] == "<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
    assert texts[2].startswith(texts[1]) and texts[1].startswith(texts[0])
    assert "answer 0" in texts[1] and texts[2].endswith("Thanks.<|im_end|>\n")
    # A fresh decoder (a restarted exporter) rebuilds a later prompt from the episode's stored spans.
    assert await PromptText(bus, tiny_model).text(recorder.spans[2]) == texts[2]
    with pytest.raises(OtlpError, match="--tokenizer only serves"):
        OtlpOptions(endpoint=receiver.url, tokenizer=tiny_model)


async def test_failed_calls_are_error_spans_and_only_the_run_asked_for_goes(
    nats_server: NatsServer, bus: NatsBus, receiver: OtlpReceiver
) -> None:
    run, other = new_run(), new_run()
    spans = await publish_spans(bus, run, episodes=2, turns=2)
    await publish_spans(bus, other, episodes=1, turns=3)
    await export_spans(options(nats_server, receiver, run))

    got = by_gateway_id(receiver)
    assert set(got) == {span.span_id for span in spans}
    failed = [span for span in spans if span.status == "error"]
    assert len(failed) == 1
    for span in spans:
        otlp = got[span.span_id]
        assert otlp.status_code == (STATUS_ERROR if span.status == "error" else 0)
        assert ("error.type" in otlp.attributes) == (span.status == "error")
        assert otlp.attributes["harnessrl.policy_version"] == span.weight_version_start


async def test_a_receiver_outage_is_survived_with_no_loss(
    nats_server: NatsServer, bus: NatsBus, receiver: OtlpReceiver
) -> None:
    run = new_run()
    spans = await publish_spans(bus, run, episodes=3, turns=4)
    receiver.unavailable_for(5)  # 503 first
    receiver.delay_s = 0.02
    stop = asyncio.Event()
    metrics = OtlpMetrics()
    export = asyncio.ensure_future(
        export_spans(options(nats_server, receiver, run, until_idle_s=None), stop, metrics)
    )
    await receiver.wait_for(3)
    await receiver.stop()  # then nobody listens at all
    await asyncio.sleep(1.5)
    during = counts(metrics)
    assert during.exported < len(spans)
    await receiver.start()
    await receiver.wait_for(len(spans))
    stop.set()
    done = await export

    assert receiver.unavailable_answers == 5
    assert len(receiver.received) == len(spans) and receiver.duplicates() == 0
    assert set(by_gateway_id(receiver)) == {span.span_id for span in spans}
    assert done.exported == len(spans) and done.refused == 0
    failures = {
        s.labels["reason"]: s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "harnessrl_otlp_export_failures_total"
    }
    assert failures["http_503"] == 5 and failures["unreachable"] >= 2
    assert failures["unreachable"] <= 8  # backoff: a few attempts in 1.5 s, not one per span


async def test_a_restarted_exporter_continues_where_it_stopped(
    nats_server: NatsServer, bus: NatsBus, receiver: OtlpReceiver
) -> None:
    run = new_run()
    first = await publish_spans(bus, run, episodes=4, turns=3)
    receiver.delay_s = 0.05  # slow enough that the stop comes mid-run
    stop = asyncio.Event()
    export = asyncio.ensure_future(export_spans(options(nats_server, receiver, run, until_idle_s=None), stop))
    await receiver.wait_for(5)
    stop.set()
    stopped = await export
    assert 5 <= stopped.exported < len(first)
    more = await publish_spans(bus, run, episodes=2, turns=3, first=4)

    resumed = await export_spans(options(nats_server, receiver, run))

    assert stopped.exported + resumed.exported == len(first) + len(more)
    assert len(receiver.received) == len(first) + len(more) and receiver.duplicates() == 0
    assert set(by_gateway_id(receiver)) == {span.span_id for span in first + more}


async def test_a_killed_exporter_resumes_with_no_span_lost(nats_server: NatsServer, bus: NatsBus) -> None:
    run = new_run()
    spans = await publish_spans(bus, run, episodes=8, turns=5)
    receiver = OtlpReceiver(delay_s=0.05)
    await receiver.start()
    flags = ["--run", run, "--nats-url", nats_server.url, "--endpoint", receiver.url, "--timeout-s", "1"]
    try:
        first = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harnessrl.stack.cli", "otlp", *flags, "--max-backoff-s", "2",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await receiver.wait_for(10)
        first.kill()
        await first.wait()
        sent_before = len(receiver.unique())
        assert sent_before < len(spans)
        # A new ack wait (6.5 s instead of 8 s) is applied to the existing consumer.
        second = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harnessrl.stack.cli", "otlp", *flags, "--max-backoff-s", "0.5",
            "--until-idle", "1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(second.communicate(), 90)
    finally:
        await receiver.stop()
    assert second.returncode == 0, err.decode()
    assert set(by_gateway_id(receiver)) == {span.span_id for span in spans}
    # At most the span in flight at the kill is sent again, as the same span (same ids).
    assert receiver.duplicates() <= 1
    resumed = json.loads(out.decode().splitlines()[-1])["exported"]
    assert resumed + sent_before >= len(spans)
    info = await bus.js.consumer_info(subjects.SPANS.name, f"otlp-{run}")
    assert info.config.ack_wait == 6.5 and info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_refused_span_is_counted_dead_lettered_and_the_rest_go_on(
    nats_server: NatsServer, bus: NatsBus, receiver: OtlpReceiver
) -> None:
    run = new_run()
    spans = await publish_spans(bus, run, episodes=2, turns=2)
    refused = spans[1]
    receiver.refuse_when(lambda span: span.attributes["harnessrl.span_id"] == refused.span_id)
    done = await export_spans(options(nats_server, receiver, run))

    assert (done.exported, done.refused) == (len(spans) - 1, 1)
    assert set(by_gateway_id(receiver)) == {span.span_id for span in spans} - {refused.span_id}
    letters = await bus.replay(subjects.DLQ.name, subjects.dead_letter(subjects.span(run, refused.episode)))
    assert [letter.decode(Span).span_id for letter in letters] == [refused.span_id]


async def test_metrics_endpoint_and_export_once_and_bad_options(
    nats_server: NatsServer, bus: NatsBus, receiver: OtlpReceiver
) -> None:
    run = new_run()
    spans = await publish_spans(bus, run, episodes=2, turns=2)
    assert await export_once(nats_server.url, run, idle_s=0.5) == len(spans)
    assert await export_once(nats_server.url, run, idle_s=0.5) == len(spans)  # its own consumer each time

    port = free_port()
    stop = asyncio.Event()
    export = asyncio.ensure_future(
        export_spans(options(nats_server, receiver, run, until_idle_s=None, metrics_port=port), stop)
    )
    await receiver.wait_for(len(spans))
    samples = await scrape(f"http://127.0.0.1:{port}/metrics")
    stop.set()
    await export
    assert samples[("harnessrl_otlp_spans_exported_total", ())] == len(spans)

    with pytest.raises(OtlpError, match="--endpoint"):
        OtlpOptions(endpoint="localhost:4318")
    with pytest.raises(OtlpError, match="consumer otlp-"):
        await export_spans(options(nats_server, receiver, new_run(), consumer=f"otlp-{run}"))


async def test_the_command_exports_and_prints_its_counts(
    nats_server: NatsServer, bus: NatsBus, receiver: OtlpReceiver
) -> None:
    run = new_run()
    published = len(await publish_spans(bus, run, episodes=1, turns=3))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harnessrl.stack.cli", "otlp", "--endpoint", receiver.url, "--run", run,
        "--nats-url", nats_server.url, "--until-idle", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    assert json.loads(out.decode().splitlines()[-1])["exported"] == published
    assert len(receiver.unique()) == published

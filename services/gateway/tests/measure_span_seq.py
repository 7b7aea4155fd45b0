"""What numbering spans on the bus costs per call: `python services/gateway/tests/measure_span_seq.py`.

Not a test (pytest does not collect it): a measurement to run by hand. A real nats-server, the
canned upstream and three gateways, each with its own bus connection, in one event loop. Three
scenarios of `--calls` sequential chat calls (default 500), each call's conversation growing by the
previous answer and a user turn as an agent's does:

- `one_gateway`: one episode, every call to the same gateway (its cache always current);
- `round_robin`: one episode, calls cycling over the three gateways (each call finds the episode
  moved on by the other two);
- `new_episodes`: every call the first of a new episode (first-sight cost).

Prints one JSON object: per scenario the mean, p50 and p99 of a call's latency in ms, calls per
second, whether the stored seqs are exactly 0..n-1, the mean time to store a span and how many
appends lost a race. Then, under `bus`, the span append alone (no HTTP, no upstream), p50 in ms:
`plain` as before (one publish), `conditional` (one publish with the expected last sequence) and
`lost_race` (the publish that finds two spans stored first, reads them and publishes again: what a
call meets when every call of its episode goes to another of three replicas).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.bus.base import LastOnSubject, LastSequenceMismatchError
from harnessrl.shared.contracts import Completion, Span
from harnessrl.shared.ids import new_id
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for
from harnessrl.testkit.plugin import open_bus

REPLY = "Hello from the canned upstream."
SPANS = subjects.SPANS.name


@asynccontextmanager
async def _gateways(nats_url: str, upstream: str, count: int) -> AsyncIterator[list[RunningGateway]]:
    async with AsyncExitStack() as stack:
        running = []
        for _ in range(count):
            bus = await stack.enter_async_context(open_bus(nats_url))
            running.append(await stack.enter_async_context(serve_gateway(settings_for([upstream]), bus)))
        yield running


async def _episode(
    session: aiohttp.ClientSession, urls: list[str], episode: KeyedEpisode, calls: int
) -> list[float]:
    """`calls` sequential calls of one episode, the i-th to `urls[i % len(urls)]`; seconds each."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    latencies = []
    for turn in range(calls):
        started = time.perf_counter()
        url = urls[turn % len(urls)] + "/v1/chat/completions"
        headers = {"authorization": f"Bearer {episode.key}"}
        async with session.post(url, json={"messages": history}, headers=headers) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"call {turn} answered {response.status}")
        latencies.append(time.perf_counter() - started)
        history = [*history, {"role": "assistant", "content": REPLY}, {"role": "user", "content": f"t{turn}"}]
    return latencies


def _publish_totals(gateways: list[RunningGateway]) -> tuple[float, float, float]:
    """(seconds publishing, spans published, seq conflicts) summed over the gateways so far."""
    totals = [0.0, 0.0, 0.0]
    names = (
        "harnessrl_gateway_span_publish_duration_seconds_sum",
        "harnessrl_gateway_span_publish_duration_seconds_count",
        "harnessrl_gateway_span_seq_conflicts_total",  # absent before conditional appends
    )
    for running in gateways:
        for index, name in enumerate(names):
            totals[index] += running.gateway.metrics.registry.get_sample_value(name) or 0.0
    return totals[0], totals[1], totals[2]


async def _scenario(
    gateways: list[RunningGateway],
    run: Callable[[], Awaitable[list[float]]],
    seqs_ok: Callable[[], Awaitable[bool]],
) -> dict[str, Any]:
    """Run `run()` (latencies), then summarise it with the span publishing it caused."""
    before = _publish_totals(gateways)
    latencies = await run()
    after = _publish_totals(gateways)
    seconds, count, conflicts = (a - b for a, b in zip(after, before, strict=True))
    return {
        **_summary(latencies, await seqs_ok()),
        "publish_mean_ms": round(seconds / max(count, 1) * 1000, 3),
        "seq_conflicts": int(conflicts),
    }


def _summary(latencies: list[float], seqs_ok: bool) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "calls": len(latencies),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 3),
        "p50_ms": round(ordered[len(ordered) // 2] * 1000, 3),
        "p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1000, 3),
        "calls_per_s": round(len(latencies) / sum(latencies), 1),
        "seqs_gap_free": seqs_ok,
    }


async def _seqs_ok(bus: NatsBus, episodes: list[KeyedEpisode], expected: int) -> bool:
    for episode in episodes:
        if [span.seq for span in await episode.spans(bus)] != list(range(expected)):
            return False
    return True


def _span(episode: str, seq: int) -> Span:
    """A span of a typical size: a 200-token prompt suffix and a 30-token completion."""
    completion = Completion(token_ids=list(range(30)), logprobs=[-0.5] * 30, text="x" * 30)
    return Span(
        span_id=f"span-{episode}-{seq}", run="bus", episode=episode, seq=seq, api="chat",
        prompt_suffix_ids=list(range(200)), prompt_len=200, completions=[completion],
    )  # fmt: skip


async def _timed_appends(bus: NatsBus, count: int, mode: str) -> list[float]:
    """`count` appends to one episode's subject in `mode`; seconds each (our append only)."""
    episode = new_id(mode)
    subject = subjects.span("bus", episode)
    last, took = 0, []
    for seq in range(count):
        expected = last
        if mode == "lost_race":  # two other replicas append first
            for other in ("a", "b"):
                span = msgspec.structs.replace(_span(episode, seq), span_id=f"{other}-{episode}-{seq}")
                expect = LastOnSubject(stream=SPANS, seq=last)
                last = (await bus.publish(subject, span, msg_id=span.span_id, expect=expect)).seq
        started = time.perf_counter()
        span = _span(episode, seq)
        if mode == "plain":
            last = (await bus.publish(subject, span, msg_id=span.span_id)).seq
        else:
            try:
                expect = LastOnSubject(stream=SPANS, seq=expected)
                last = (await bus.publish(subject, span, msg_id=span.span_id, expect=expect)).seq
            except LastSequenceMismatchError as lost:
                assert lost.complete and len(lost.newer) == 2
                expect = LastOnSubject(stream=SPANS, seq=lost.newer[-1].stream_seq)
                last = (await bus.publish(subject, span, msg_id=span.span_id, expect=expect)).seq
        took.append(time.perf_counter() - started)
    return took


def _p50_ms(took: list[float]) -> float:
    return round(statistics.median(took) * 1000, 3)


async def measure(calls: int) -> dict[str, Any]:
    """Run the three scenarios against a fresh nats-server; the report as a dict."""
    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(Path(store))
        server.start()
        upstream = CannedUpstream()
        await upstream.start()
        try:
            async with (
                _gateways(server.url, upstream.url, 3) as gateways,
                aiohttp.ClientSession() as session,
            ):
                bus = gateways[0].gateway.bus
                assert isinstance(bus, NatsBus)
                urls = [g.url for g in gateways]
                await _episode(session, urls, KeyedEpisode(run="warmup"), 30)
                one, spread = KeyedEpisode(run="one"), KeyedEpisode(run="spread")
                fresh = [KeyedEpisode(run="fresh") for _ in range(calls)]

                async def firsts() -> list[float]:
                    return [(await _episode(session, urls[:1], e, 1))[0] for e in fresh]

                return {
                    "one_gateway": await _scenario(
                        gateways,
                        lambda: _episode(session, urls[:1], one, calls),
                        lambda: _seqs_ok(bus, [one], calls),
                    ),
                    "round_robin": await _scenario(
                        gateways,
                        lambda: _episode(session, urls, spread, calls),
                        lambda: _seqs_ok(bus, [spread], calls),
                    ),
                    "new_episodes": await _scenario(gateways, firsts, lambda: _seqs_ok(bus, fresh[:20], 1)),
                    "bus": {
                        mode: _p50_ms(await _timed_appends(bus, calls, mode))
                        for mode in ("plain", "conditional", "lost_race")
                    },
                }
        finally:
            await upstream.stop()
            server.stop()


def main() -> None:
    """Parse `--calls` and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.calls))))  # noqa: T201 - the script's output


if __name__ == "__main__":
    main()

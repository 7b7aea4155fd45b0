"""Never a response without its span: nats-server killed mid-traffic, clients that disconnect."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import aiohttp

from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus
from harnessrl.shared.contracts import Span
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import KeyedEpisode, serve_gateway, settings_for

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


async def _call(
    session: aiohttp.ClientSession, url: str, key: str, stream: bool
) -> tuple[int, str | None, bool]:
    """(status, span id header, completed): completed = the full answer arrived ([DONE])."""
    headers = {"authorization": f"Bearer {key}"}
    try:
        async with session.post(url, json={**CHAT, "stream": stream}, headers=headers) as response:
            body = await response.read()
            done = response.status == 200 and (not stream or body.rstrip().endswith(b"[DONE]"))
            return response.status, response.headers.get("x-harnessrl-span"), done
    except aiohttp.ClientError:
        return 0, None, False


async def test_nats_killed_during_traffic_loses_no_span_and_duplicates_none(
    nats_server: NatsServer, bus: Bus, canned: CannedUpstream
) -> None:
    episodes = [KeyedEpisode(run="killrun") for _ in range(4)]
    results: list[tuple[int, str | None, bool]] = []
    settings = settings_for([canned.url], span_publish_timeout_s=8.0)
    async with serve_gateway(settings, bus) as gateway:
        url = gateway.url + "/v1/chat/completions"
        stop_at = time.monotonic() + 4.0

        async def worker(index: int) -> None:
            async with aiohttp.ClientSession() as session:
                while time.monotonic() < stop_at:
                    key = episodes[index % len(episodes)].key
                    results.append(await _call(session, url, key, stream=index % 2 == 1))

        workers = [asyncio.ensure_future(worker(i)) for i in range(8)]
        await asyncio.sleep(1.0)
        await asyncio.to_thread(nats_server.kill)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(nats_server.start)
        await asyncio.gather(*workers)
        await asyncio.sleep(0.5)

    stored = collections.Counter[str]()
    for episode in episodes:
        deliveries = await bus.replay(subjects.SPANS.name, subjects.span(episode.run, episode.episode))
        stored.update(d.decode(Span).span_id for d in deliveries)
    completed = [span for status, span, done in results if done]
    assert len(completed) > 50
    assert all(span is not None and stored[span] == 1 for span in completed), "a call lost its span"
    assert max(stored.values()) == 1, "a span was stored twice"
    # Every stored span belongs to a call that was at least accepted (no phantom spans).
    accepted = {span for _, span, _ in results if span}
    assert set(stored) <= accepted


async def test_client_disconnect_aborts_upstream_and_records_an_aborted_span(
    bus: Bus, episode: KeyedEpisode
) -> None:
    upstream = CannedUpstream(event_delay_s=0.05)
    await upstream.start()
    try:
        async with serve_gateway(settings_for([upstream.url]), bus) as gateway:
            headers = {"authorization": f"Bearer {episode.key}"}
            async with aiohttp.ClientSession() as session:
                response = await session.post(
                    gateway.url + "/v1/chat/completions",
                    json={**CHAT, "stream": True}, headers=headers,
                )  # fmt: skip
                events = 0
                while events < 4:  # the role chunk and three tokens
                    events += (await response.content.readline()).startswith(b"data:")
                response.close()
            spans = await _wait_for_spans(bus, episode, 1)
            for _ in range(100):
                if upstream.aborted:
                    break
                await asyncio.sleep(0.02)
            assert upstream.aborted == 1, spans
    finally:
        await upstream.stop()
    assert (spans[0].status, spans[0].error) == ("aborted", "client disconnected"), spans[0]
    assert spans[0].stream
    assert 0 < len(spans[0].completions[0].token_ids) < len("Hello from the canned upstream.")


async def _wait_for_spans(bus: Bus, episode: KeyedEpisode, count: int) -> list[Any]:
    for _ in range(100):
        spans = await episode.spans(bus)
        if len(spans) >= count:
            return spans
        await asyncio.sleep(0.05)
    raise AssertionError(f"expected {count} spans")


async def test_span_store_down_longer_than_the_budget_is_503_never_an_unrecorded_answer(
    nats_server: NatsServer, bus: Bus, canned: CannedUpstream, episode: KeyedEpisode
) -> None:
    settings = settings_for([canned.url], span_publish_timeout_s=1.0)
    async with serve_gateway(settings, bus) as gateway, aiohttp.ClientSession() as session:
        url = gateway.url + "/v1/chat/completions"
        assert (await _call(session, url, episode.key, stream=False))[0] == 200
        await asyncio.to_thread(nats_server.kill)
        try:
            plain = await _call(session, url, episode.key, stream=False)
            streamed = await _call(session, url, episode.key, stream=True)
        finally:
            await asyncio.to_thread(nats_server.start)
        assert plain[0] == 503
        # A stream already answered 200 can't change its status: it ends with an error event
        # instead of its final event, so the client never sees a complete answer.
        assert streamed[0] == 200 and not streamed[2]
        registry = gateway.gateway.metrics.registry
        assert registry.get_sample_value("harnessrl_gateway_span_publish_failures_total") == 2
        for _ in range(20):  # until the bus is back
            if (await _call(session, url, episode.key, stream=False))[0] == 200:
                break
    # Still numbered without gaps or repeats. Publishes the client buffered during the outage are
    # sent on reconnect: each lands only if its episode did not move on meanwhile.
    spans = await episode.spans(bus)
    assert len(spans) >= 2
    assert [s.seq for s in spans] == list(range(len(spans)))


async def test_a_call_whose_span_cannot_be_stored_takes_no_seq(
    canned: CannedUpstream, bus: Bus, episode: KeyedEpisode
) -> None:
    """A seq is taken by the stored span itself, so a span refused for good leaves no gap."""
    oversized = {**CHAT, "metadata": "x" * 1_200_000}  # kept in the span's request: over max_payload
    async with serve_gateway(settings_for([canned.url]), bus) as gateway, aiohttp.ClientSession() as session:
        url = gateway.url + "/v1/chat/completions"
        headers = {"authorization": f"Bearer {episode.key}"}
        statuses = []
        for body in (CHAT, oversized, CHAT):
            async with session.post(url, json=body, headers=headers) as response:
                statuses.append(response.status)
    assert statuses == [200, 503, 200]
    assert [s.seq for s in await episode.spans(bus)] == [0, 1]

"""Gateway replicas share nothing correctness depends on: one episode's calls on any of them, in any order.

Three gateways, each with its own bus connection and its own episode cache, in front of two canned
upstreams: however one episode's calls are spread over them (round-robin, 8 in parallel, with a
restart in between), its spans are numbered 0..n-1 without gaps or repeats, every prompt
reconstructs to what was sent, the rollout the controller would publish is complete for the
trainer, and every call of the episode reaches the same upstream. Closed episodes stay closed after
a restart, in bounded memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest

from harnessrl.controller.artifacts import summarize_spans
from harnessrl.gateway.upstreams import UpstreamPool
from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus
from harnessrl.shared.contracts import (
    AgentExited,
    EpisodeCompleted,
    EpisodeFailed,
    RolloutComplete,
    Span,
)
from harnessrl.shared.ids import new_id
from harnessrl.shared.tokens import reconstruct_prompts
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.canned_upstream import CannedUpstream, Reply, render_prompt
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for
from harnessrl.testkit.plugin import open_bus

REPLY = "Hello from the canned upstream."
FAIL = "fail-this-call"  # a user turn the upstream answers with 500


def _script(path: str, body: dict[str, Any]) -> Reply:
    if any(m.get("content") == FAIL for m in body.get("messages", []) if isinstance(m, dict)):
        return {"status": 500, "content": "upstream failed"}
    return {"content": REPLY, "finish_reason": "stop"}


@pytest.fixture
async def upstreams() -> AsyncIterator[list[CannedUpstream]]:
    """Two upstreams that take 30 ms per call, so parallel calls really overlap."""
    started = [CannedUpstream(delay_s=0.03, script=_script) for _ in range(2)]
    for upstream in started:
        await upstream.start()
    yield started
    for upstream in started:
        await upstream.stop()


@asynccontextmanager
async def _replicas(
    nats_server: NatsServer, upstreams: list[CannedUpstream], count: int = 3, **overrides: Any
) -> AsyncIterator[list[RunningGateway]]:
    """`count` gateways, each with its own bus connection (as separate processes would have)."""
    async with AsyncExitStack() as stack:
        running = []
        for _ in range(count):
            running.append(await stack.enter_async_context(_replica(nats_server, upstreams, **overrides)))
        yield running


@asynccontextmanager
async def _replica(
    nats_server: NatsServer, upstreams: list[CannedUpstream], **overrides: Any
) -> AsyncIterator[RunningGateway]:
    settings = settings_for([u.url for u in upstreams], **overrides)
    async with open_bus(nats_server.url) as bus, serve_gateway(settings, bus) as running:
        yield running


class Conversation:
    """One episode's calls as a harness makes them; remembers what each span's prompt must be."""

    def __init__(self, session: aiohttp.ClientSession, episode: KeyedEpisode) -> None:
        self.session = session
        self.episode = episode
        self.history: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        self.prompts: dict[str, list[int]] = {}  # span id -> the prompt ids the upstream saw
        self.statuses: list[int] = []

    async def call(self, gateway: RunningGateway, turn: str, *, stream: bool = False) -> str | None:
        """Send the history plus `turn`; returns the span id (None when the call failed)."""
        messages = [*self.history, {"role": "user", "content": turn}]
        headers = {"authorization": f"Bearer {self.episode.key}"}
        url = gateway.url + "/v1/chat/completions"
        async with self.session.post(
            url, json={"messages": messages, "stream": stream}, headers=headers
        ) as r:
            body = await r.read()
            self.statuses.append(r.status)
            if r.status != 200:
                return None
            assert not stream or body.rstrip().endswith(b"[DONE]"), body[-200:]
            span_id = r.headers["x-harnessrl-span"]
        self.prompts[span_id] = list(render_prompt({"messages": messages}).encode())
        return span_id

    async def turn(self, gateway: RunningGateway, turn: str, *, stream: bool = False) -> str | None:
        """A sequential call: on success the history grows by the turn and the answer."""
        span_id = await self.call(gateway, turn, stream=stream)
        if span_id is not None:
            self.history += [{"role": "user", "content": turn}, {"role": "assistant", "content": REPLY}]
        return span_id


async def _stored(bus: Bus, episode: KeyedEpisode) -> list[Span]:
    """The episode's spans in stream order (so a duplicate seq would show)."""
    deliveries = await bus.replay(subjects.SPANS.name, subjects.span(episode.run, episode.episode))
    return [d.decode(Span) for d in deliveries]


async def _assert_trainable(bus: Bus, conversation: Conversation) -> list[Span]:
    """Seqs 0..n-1, one span per answered call, prompts as sent, complete for the trainer."""
    from harnessrl.trainer.assembly import spans_complete  # imports torch: only where needed

    spans = await _stored(bus, conversation.episode)
    assert sorted(s.seq for s in spans) == list(range(len(spans)))
    assert {s.span_id for s in spans} == set(conversation.prompts)
    prompts = reconstruct_prompts(spans)
    assert all(prompts[span_id] == sent for span_id, sent in conversation.prompts.items())
    summary = await summarize_spans(bus, conversation.episode.run, conversation.episode.episode)
    rollout = RolloutComplete(
        run=conversation.episode.run, episode=conversation.episode.episode, task="t", group="g",
        span_count=summary.count, last_seq=summary.last_seq,
    )  # fmt: skip
    assert spans_complete(rollout, spans)
    assert len({s.upstream for s in spans}) == 1, "an episode's calls must stay on one upstream"
    return sorted(spans, key=lambda s: s.seq)


async def test_round_robin_over_three_gateways_numbers_spans_0_to_n_with_deltas_on_the_predecessor(
    nats_server: NatsServer, bus: Bus, upstreams: list[CannedUpstream]
) -> None:
    episode = KeyedEpisode(run=new_id("rr"))
    async with _replicas(nats_server, upstreams) as gateways, aiohttp.ClientSession() as session:
        talk = Conversation(session, episode)
        for index in range(15):
            gateway = gateways[index % 3]
            turn = FAIL if index == 7 else f"turn {index}"
            await talk.turn(gateway, turn, stream=index % 2 == 1)
        conflicts = sum(
            g.gateway.metrics.registry.get_sample_value("harnessrl_gateway_span_seq_conflicts_total") or 0
            for g in gateways
        )
    assert talk.statuses.count(500) == 1 and talk.statuses.count(200) == 14
    spans = await _assert_trainable(bus, talk)
    assert len(spans) == 14, "the failed call left no span and no gap"
    # Each call extends its predecessor's prompt + completion, whichever gateway stored that.
    assert [s.parent_span for s in spans] == [None, *(s.span_id for s in spans[:-1])]
    assert sum(len(s.prompt_suffix_ids) for s in spans) < sum(s.prompt_len for s in spans) / 3
    assert conflicts >= 12  # every call found the episode moved on by the other gateways


async def test_parallel_calls_of_one_episode_across_gateways_get_unique_gap_free_seqs(
    nats_server: NatsServer, bus: Bus, upstreams: list[CannedUpstream]
) -> None:
    """A harness that fans out (parallel tool calls, sub-agents) between sequential turns."""
    episode = KeyedEpisode(run=new_id("fan"))
    async with _replicas(nats_server, upstreams) as gateways, aiohttp.ClientSession() as session:
        talk = Conversation(session, episode)
        for round_ in range(3):
            await talk.turn(gateways[round_ % 3], f"plan {round_}")
            fan_out = [talk.call(gateways[i % 3], f"tool {round_}.{i}", stream=i % 2 == 0) for i in range(8)]
            assert None not in await asyncio.gather(*fan_out)
        await talk.turn(gateways[1], "wrap up", stream=True)
    spans = await _assert_trainable(bus, talk)
    assert len(spans) == 3 * 9 + 1
    assert all(s.parent_span is not None for s in spans[1:]), "every later prompt extends a stored span"


async def test_a_gateway_restarted_mid_episode_continues_its_seq(
    nats_server: NatsServer, bus: Bus, upstreams: list[CannedUpstream]
) -> None:
    episode = KeyedEpisode(run=new_id("restart"))
    async with aiohttp.ClientSession() as session, _replica(nats_server, upstreams) as steady:
        talk = Conversation(session, episode)
        async with _replica(nats_server, upstreams) as first:
            await talk.turn(first, "one")
            await talk.turn(steady, "two", stream=True)
            await talk.turn(first, "three")
        # A new process in its place: nothing cached, and the other replica moved the episode on.
        await talk.turn(steady, "four")
        async with _replica(nats_server, upstreams) as second:
            await talk.turn(second, "five", stream=True)
            await talk.turn(second, "six")
    spans = await _assert_trainable(bus, talk)
    assert [s.seq for s in spans] == [0, 1, 2, 3, 4, 5]
    assert [s.parent_span for s in spans] == [None, *(s.span_id for s in spans[:-1])]


async def _close(bus: Bus, episode: KeyedEpisode, index: int) -> None:
    common = {"run": episode.run, "episode": episode.episode, "task": "t", "group": "g"}
    event: AgentExited | EpisodeCompleted | EpisodeFailed
    if index % 3 == 0:
        event, kind = AgentExited(**common), "agent_exited"
    elif index % 3 == 1:
        event, kind = EpisodeCompleted(**common, reward=1.0), "completed"
    else:
        event, kind = EpisodeFailed(**common, cause="agent"), "failed"
    subject = subjects.episode_event(episode.run, episode.episode, kind)
    await bus.publish(subject, event, msg_id=f"{episode.episode}:{kind}")


async def _status(session: aiohttp.ClientSession, gateway: RunningGateway, episode: KeyedEpisode) -> int:
    headers = {"authorization": f"Bearer {episode.key}"}
    body = {"messages": [{"role": "user", "content": "hi"}]}
    async with session.post(gateway.url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status


async def test_closed_episodes_stay_closed_after_a_restart_in_bounded_memory(
    nats_server: NatsServer, bus: Bus, upstreams: list[CannedUpstream]
) -> None:
    bound = 4
    episodes = [KeyedEpisode(run=new_id("closed")) for _ in range(3 * bound)]
    async with aiohttp.ClientSession() as session:
        async with _replica(nats_server, upstreams, episode_cache_size=bound) as gateway:
            assert [await _status(session, gateway, e) for e in episodes] == [200] * len(episodes)
            for index, episode in enumerate(episodes):
                await _close(bus, episode, index)
            held = episodes[-bound:]  # the others were evicted: only these are followed
            for _ in range(250):
                if all(gateway.gateway.episodes.is_closed(e.run, e.episode) for e in held):
                    break
                await asyncio.sleep(0.02)
            assert [await _status(session, gateway, e) for e in episodes] == [403] * len(episodes)
            assert len(gateway.gateway.episodes) == bound
        async with _replica(nats_server, upstreams, episode_cache_size=bound) as restarted:
            cache = restarted.gateway.episodes
            assert len(cache) == 0, "nothing is read from the EPISODES stream's history at start"
            assert [await _status(session, restarted, e) for e in episodes] == [403] * len(episodes)
            assert await _status(session, restarted, KeyedEpisode(run=new_id("open"))) == 200
            assert len(cache) == bound and cache.closed_count() == bound - 1
    for episode in episodes:
        assert len(await _stored(bus, episode)) == 1  # refused calls record nothing


_RING_PROBE = """
import json, sys
from harnessrl.gateway.upstreams import UpstreamPool
pool = UpstreamPool(
    max_in_flight=1, connect_timeout_s=1, unhealthy_after=1, health_interval_s=1, keepalive_s=1
)
for url in json.loads(sys.argv[1]):
    pool.register(url)
print(json.dumps([[u.url for u in pool.candidates(e)] for e in json.loads(sys.argv[2])]))
"""


def test_the_upstream_ring_routes_an_episode_alike_in_every_gateway_process() -> None:
    """Stickiness across replicas: the ring is a pure function of the replica URLs and the episode."""
    urls = [f"http://vllm-{i}.svc:8000" for i in range(5)]
    episodes = [new_id("ep") for _ in range(300)]
    answers = []
    for seed, order in (("1", urls), ("2", urls[::-1]), ("random", urls[2:] + urls[:2])):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        probe = [sys.executable, "-c", _RING_PROBE, json.dumps(order), json.dumps(episodes)]
        out = subprocess.run(probe, env=env, capture_output=True, check=True, text=True).stdout
        answers.append(json.loads(out.splitlines()[-1]))  # after the pool's log lines
    pool = UpstreamPool(
        max_in_flight=1, connect_timeout_s=1, unhealthy_after=1, health_interval_s=1, keepalive_s=1
    )
    for url in urls:
        pool.register(url)
    here = [[u.url for u in pool.candidates(e)] for e in episodes]
    assert all(answer == here for answer in answers)
    assert len({order[0] for order in here}) == len(urls)  # and it does spread episodes

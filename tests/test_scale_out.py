"""Scaled-out gateways feed the trainer: episodes served round-robin by three replicas train as one.

Three gateways (each with its own bus connection, as separate processes would have) in front of the
session's real vLLM on the tiny model. Two groups of two attempts, four sequential calls each, run
in parallel; call `i` of episode `e` goes to gateway `(e + i) % 3`, so every episode is numbered by
all three replicas and its last call lands on a replica whose view of the episode is two spans old.
The controller's rollout is built the way the controller builds it (span count and last seq read
back from the bus), with rewards that differ inside each group; the real trainer service assembles
every rollout complete (nothing dropped as `spans_incomplete`) and trains a step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from harnessrl.controller.artifacts import summarize_spans
from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import RolloutComplete, WeightVersion
from harnessrl.shared.ids import new_id
from harnessrl.stack.natsserver import NatsServer
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for
from harnessrl.testkit.plugin import open_bus
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.service import TrainerService
from harnessrl.trainer.settings import EngineSettings, LossSettings, PoolSettings, TrainerSettings
from harnessrl.trainer.training import Trainer
from harnessrl.trainer.weight_sync import ReplicaSync

GROUPS, ATTEMPTS, CALLS, REPLICAS = 2, 2, 4, 3


@pytest.fixture(scope="module")
def policy_engine(tiny_model: Path) -> PolicyEngine:
    """verl's engine on the tiny model (the trainer tests' fixture lives in their own conftest)."""
    return PolicyEngine(tiny_model, EngineSettings(lr=3e-4), LossSettings())


@pytest.fixture(params=[False, True], ids=["plain", "token_in"])
async def gateways(
    nats_server: NatsServer, vllm_server: VllmServer, request: pytest.FixtureRequest
) -> AsyncIterator[list[RunningGateway]]:
    """Three gateway replicas in front of the session's vLLM, each on its own bus connection.

    Plain mode numbers a call from the replica's own view of the episode (two spans old on the
    last call: a seq conflict, renumbered); token-in reads the episode's spans from the bus when
    its parent isn't known, so its view is current.
    """
    settings = settings_for([vllm_server.url], served_model=vllm_server.model, token_in=request.param)
    async with AsyncExitStack() as stack:
        running = []
        for _ in range(REPLICAS):
            bus = await stack.enter_async_context(open_bus(nats_server.url))
            running.append(await stack.enter_async_context(serve_gateway(settings, bus)))
        yield running


async def converse(
    http: aiohttp.ClientSession, gateways: list[RunningGateway], episode: KeyedEpisode, index: int
) -> list[str]:
    """One harness: `CALLS` turns, each on the next gateway; returns the span ids it was answered with."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Episode {index}: what is 6*7?"}]
    headers = {"authorization": f"Bearer {episode.key}"}
    spans = []
    for turn in range(CALLS):
        gateway = gateways[(index + turn) % REPLICAS]
        body = {"messages": messages, "max_tokens": 8, "temperature": 1.0}
        async with http.post(gateway.url + "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            spans.append(response.headers["x-harnessrl-span"])
            reply = (await response.json())["choices"][0]["message"]["content"] or ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"go on {turn}"}]
    return spans


async def rollout_of(bus: NatsBus, episode: KeyedEpisode, group: str, attempt: int) -> RolloutComplete:
    """What the controller publishes when the episode completes (reward 1 for attempt 0 only)."""
    summary = await summarize_spans(bus, episode.run, episode.episode)
    return RolloutComplete(
        run=episode.run, episode=episode.episode, task=group, group=group, attempt=attempt,
        group_size=ATTEMPTS, reward=1.0 if attempt == 0 else 0.0, span_count=summary.count,
        last_seq=summary.last_seq, versions_seen=summary.versions,
    )  # fmt: skip


def trainer_service(
    bus: NatsBus, engine: PolicyEngine, tiny_model: Path, run: str, root: Path
) -> TrainerService:
    """The run's trainer: one step of both groups, no replica to reload (the session's vLLM stays)."""
    settings = TrainerSettings(
        run=run, model_dir=str(tiny_model), checkpoint_dir=str(root), batch_groups=GROUPS, max_steps=1,
        ack_recheck_s=0.2, pool=PoolSettings(span_wait_s=15.0, group_wait_s=60.0),
    )  # fmt: skip
    trainer = Trainer(settings, engine=engine)
    return TrainerService(bus, trainer, ReplicaSync([], settings.probe_token_ids))


async def test_episodes_served_round_robin_by_three_gateways_assemble_complete_and_train(
    bus: NatsBus,
    gateways: list[RunningGateway],
    policy_engine: PolicyEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    run = new_id("scale")
    episodes = [KeyedEpisode(run) for _ in range(GROUPS * ATTEMPTS)]
    async with aiohttp.ClientSession() as http:
        answered = await asyncio.gather(*(converse(http, gateways, e, i) for i, e in enumerate(episodes)))
    conflicts = sum(
        g.gateway.metrics.registry.get_sample_value("harnessrl_gateway_span_seq_conflicts_total") or 0
        for g in gateways
    )
    token_in = gateways[0].gateway.settings.token_in
    if not token_in:
        assert conflicts >= len(episodes), "each last call found its episode moved on by the other replicas"
    for episode, span_ids in zip(episodes, answered, strict=True):
        spans = await episode.spans(bus)
        if token_in:
            assert [s.token_in for s in spans] == ["fresh"] + ["extended"] * (CALLS - 1)
        assert [s.seq for s in spans] == list(range(CALLS))
        assert [s.span_id for s in spans] == span_ids, "every answered call has its span, in order"
        assert len({s.upstream for s in spans}) == 1
        assert all(s.completions and s.completions[0].token_ids for s in spans)

    service = trainer_service(bus, policy_engine, tiny_model, run, tmp_path)
    await service.start()
    try:
        for index, episode in enumerate(episodes):
            group, attempt = f"g{index // ATTEMPTS}", index % ATTEMPTS
            rollout = await rollout_of(bus, episode, group, attempt)
            await bus.publish(subjects.rollout(run), rollout, msg_id=f"{episode.episode}:complete")
        await asyncio.wait_for(service.wait(), 120)
    finally:
        await service.stop()

    stored = await bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
    assert [item.decode(WeightVersion).version for item in stored] == [1]
    assert service.pool.dropped.get("spans_incomplete", 0) == 0
    assert sorted(service.trainer.state.trained[0]) == sorted(e.episode for e in episodes)
    metrics = service.last_metrics
    assert metrics is not None and metrics.trained and not metrics.dropped
    assert metrics.values["rollouts/trained"] == GROUPS * ATTEMPTS

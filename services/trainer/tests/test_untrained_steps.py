"""A step that trains nothing makes no new weights, but is still announced as a step.

Over a real nats-server, the real engine on the tiny model and, for the sync, the session's real
vLLM replica: every group skipped (zero variance, or no trainable tokens: the issue's episodes that
never reached the model) announces the previous version with its own step and `carries_previous`,
reloads no replica and writes no weights; the next trained step is the previous version + 1; a
restart after such a step re-announces it correctly.
"""

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import StepMetrics, WeightVersion
from harnessrl.shared.ids import new_id
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.span_sequences import EpisodeRecorder, RecordedEpisode, record_group
from harnessrl.testkit.span_sequences import publish_episodes as publish_group
from harnessrl.trainer.advantages import AssembledRollout
from harnessrl.trainer.checkpoint import STATE_FILE, CheckpointStore, TrainerState
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.replica import VllmReplica
from harnessrl.trainer.samples import build_rows
from harnessrl.trainer.service import TrainerService
from harnessrl.trainer.settings import TrainerSettings
from harnessrl.trainer.training import Trainer
from harnessrl.trainer.weight_sync import ReplicaSync

# A label no sync would set: a replica still showing it after a step was not reloaded by it.
UNTOUCHED = "untouched"


@pytest.fixture
async def observer(vllm_server: VllmServer, tiny_model: Path) -> AsyncIterator[VllmReplica]:
    """A client watching the session's vLLM server; its original weights are back after the test."""
    async with VllmReplica(vllm_server.url, vllm_server.model) as client:
        yield client
        await client.reload_from(tiny_model)


def settings_for(run: str, tiny_model: Path, root: Path) -> TrainerSettings:
    return TrainerSettings(
        run=run, model_dir=str(tiny_model), checkpoint_dir=str(root), mode="async", staleness=2,
        batch_groups=1, ack_recheck_s=0.2,
    )  # fmt: skip


def service_for(bus: Bus, trainer: Trainer, vllm_server: VllmServer | None = None) -> TrainerService:
    """A trainer service syncing to the session's vLLM replica, or to none."""
    replicas = [VllmReplica(vllm_server.url, vllm_server.model)] if vllm_server is not None else []
    return TrainerService(bus, trainer, ReplicaSync(replicas, trainer.settings.probe_token_ids))


def all_rewards(group: list[RecordedEpisode], reward: float) -> list[RecordedEpisode]:
    """The group with every attempt rewarded `reward`: zero variance, nothing to learn."""
    return [(recorder, msgspec.structs.replace(rollout, reward=reward)) for recorder, rollout in group]


def never_called_the_model(run: str, group: str, size: int = 4) -> list[RecordedEpisode]:
    """Episodes whose harness never started: no spans, no trainable token (reward 0)."""
    episodes = []
    for attempt in range(size):
        recorder = EpisodeRecorder(run, f"{run}-{group}-a{attempt}")
        episodes.append((recorder, recorder.rollout(task=group, group=group, reward=0.0, group_size=size)))
    return episodes


def assembled(group: list[RecordedEpisode], version: int) -> list[AssembledRollout]:
    """What the pool would hand `Trainer.step` for `group`."""
    return [
        AssembledRollout(
            rollout=rollout, rows=build_rows(rollout.episode, recorder.spans)[0], min_version=version
        )
        for recorder, rollout in group
    ]


async def announcements(bus: Bus, run: str) -> list[WeightVersion]:
    stored = await bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
    return [item.decode(WeightVersion) for item in stored]


async def step_metrics(bus: Bus, run: str) -> list[StepMetrics]:
    stored = await bus.replay(subjects.METRICS.name, subjects.metrics(run, "trainer"))
    return [item.decode(StepMetrics) for item in stored]


async def wait_announced(bus: Bus, run: str, count: int, timeout: float = 120.0) -> list[WeightVersion]:
    deadline = asyncio.get_running_loop().time() + timeout
    while len(found := await announcements(bus, run)) < count:
        assert asyncio.get_running_loop().time() < deadline, f"{len(found)} of {count} announcements"
        await asyncio.sleep(0.2)
    return found


async def test_untrained_steps_carry_the_previous_version_and_reload_nothing(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path,
    vllm_server: VllmServer, observer: VllmReplica,
):  # fmt: skip
    rng = random.Random(20)
    run = new_id("run")
    # The shared engine holds whatever earlier tests trained: that is this run's starting model.
    start = policy_engine.export_hf(tmp_path / "start")
    service = service_for(bus, Trainer(settings_for(run, start, tmp_path), engine=policy_engine), vllm_server)
    await service.start()
    try:
        await publish_group(bus, record_group(run, "g1", rng))
        await wait_announced(bus, run, 1)
        assert await observer.weight_info() == "1"
        await observer.set_weight_version(UNTOUCHED)
        await publish_group(bus, all_rewards(record_group(run, "g2", rng), 0.0))
        await wait_announced(bus, run, 2)
        await publish_group(bus, never_called_the_model(run, "g3"))
        await wait_announced(bus, run, 3)
        assert await observer.weight_info() == UNTOUCHED  # neither skipped step reloaded the replica
        await publish_group(bus, record_group(run, "g4", rng))
        found = await wait_announced(bus, run, 4)
    finally:
        await service.stop()

    assert [(v.version, v.step, v.carries_previous) for v in found] == [
        (1, 1, False), (1, 2, True), (1, 3, True), (2, 4, False),
    ]  # fmt: skip
    assert {(v.checkpoint_uri, v.digest) for v in found[:3]} == {(found[0].checkpoint_uri, found[0].digest)}
    assert found[3].digest != found[0].digest
    assert await observer.weight_info() == "2"  # the next trained step reloads as before
    metrics = await step_metrics(bus, run)
    assert [(m.step, m.version, m.trained) for m in metrics] == [
        (1, 1, True), (2, 1, False), (3, 1, False), (4, 2, True),
    ]  # fmt: skip
    assert metrics[1].dropped == {"zero_variance": 4} and metrics[1].values["step/skipped"] == 1.0
    assert metrics[2].dropped == {"no_trainable_tokens": 4} and metrics[2].values["step/skipped"] == 1.0
    assert "sync/probe_gap" not in metrics[1].values and "sync/probe_gap" in metrics[3].values
    # The skipped steps wrote their state and no weights; their rollouts are settled.
    assert [p.name for p in (tmp_path / run / "step-000002").iterdir()] == ["trainer_state.json"]
    assert (tmp_path / run / "step-000004" / "hf" / "model.safetensors").exists()
    assert service.trainer.settled >= {r.episode for _, r in never_called_the_model(run, "g3")}


async def test_a_restart_after_an_untrained_step_announces_it_and_resumes(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
):
    rng = random.Random(21)
    run = new_id("run")
    settings = settings_for(run, tiny_model, tmp_path)
    first = service_for(bus, Trainer(settings, engine=policy_engine))
    await first.start()
    try:
        await publish_group(bus, record_group(run, "g1", rng))
        await publish_group(bus, all_rewards(record_group(run, "g2", rng), 1.0))
        await publish_group(bus, all_rewards(record_group(run, "g3", rng), 0.0))
        await wait_announced(bus, run, 3)
    finally:
        await first.stop()
    # One more skipped step checkpointed, and the process dies before announcing it.
    trainer = first.trainer
    result = trainer.step(assembled(all_rewards(record_group(run, "g4", rng), 1.0), version=1))
    assert result.checkpoint is not None and not result.trained
    assert (trainer.state.step, trainer.state.version, trainer.state.published) == (4, 1, False)
    # Pruning kept the directory whose weights the skipped steps still serve.
    assert trainer.hf_dir() == tmp_path / run / "step-000001" / "hf"
    assert (trainer.hf_dir() / "model.safetensors").exists()

    second = service_for(bus, Trainer(settings, engine=policy_engine))
    await second.start()
    try:
        await wait_announced(bus, run, 4)
        assert second.trainer.state.published
        await publish_group(bus, record_group(run, "g5", rng))
        found = await wait_announced(bus, run, 5)
    finally:
        await second.stop()
    # Step 4 is announced although version 1 already went out (at steps 1 to 3).
    assert [(v.version, v.step, v.carries_previous) for v in found] == [
        (1, 1, False), (1, 2, True), (1, 3, True), (1, 4, True), (2, 5, False),
    ]  # fmt: skip
    assert {(v.checkpoint_uri, v.digest) for v in found[:4]} == {(found[0].checkpoint_uri, found[0].digest)}
    metrics = await step_metrics(bus, run)
    assert [(m.step, m.version, m.trained) for m in metrics] == [
        (1, 1, True), (2, 1, False), (3, 1, False), (4, 1, False), (5, 2, True),
    ]  # fmt: skip
    assert metrics[3].values == {"step/recovered": 1.0}

    # Restarting once more with everything announced announces nothing again.
    third = service_for(bus, Trainer(settings, engine=policy_engine))
    await third.start()
    await third.stop()
    assert len(await announcements(bus, run)) == 5


def test_a_checkpoint_from_before_carried_steps_serves_its_own_weights(tmp_path: Path):
    # Written before `weights_step` existed: every step directory held its own weights.
    store = CheckpointStore(tmp_path)
    old = {"run": "old", "step": 7, "version": 7, "trained": {}, "published": True}
    final = store.commit(store.staging(7), msgspec.json.decode(msgspec.json.encode(old), type=TrainerState))
    (final / STATE_FILE).write_bytes(msgspec.json.encode(old))  # the old file, without the field
    state = store.load_state("old")
    assert store.weights_dir(state) == tmp_path / "step-000007" and not state.carries_previous

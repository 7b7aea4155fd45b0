"""The trainer service over a real nats-server: assembly, settlement, versions, metrics."""

import asyncio
import random
from pathlib import Path

import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import StepMetrics, WeightVersion
from harnessrl.shared.ids import new_id
from harnessrl.shared.process import run_until_signalled
from harnessrl.testkit.span_sequences import publish_episodes as publish_group
from harnessrl.testkit.span_sequences import record_group
from harnessrl.trainer.app import finished
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.metrics import MetricsSink
from harnessrl.trainer.service import TrainerService
from harnessrl.trainer.settings import PoolSettings, TrainerSettings
from harnessrl.trainer.training import Trainer
from harnessrl.trainer.weight_sync import ReplicaSync


async def versions_of(bus: Bus, run: str) -> list[int]:
    stored = await bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
    return [item.decode(WeightVersion).version for item in stored]


async def wait_for(predicate, timeout=60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.2)


def trainer_service(
    bus: Bus, engine: PolicyEngine, tiny_model: Path, tmp_path: Path, *, tensorboard: bool = False, **settings
) -> TrainerService:
    """An async-mode trainer service for a fresh run, checkpointing under `tmp_path`."""
    run = new_id("run")
    trainer = Trainer(
        TrainerSettings(
            run=run, model_dir=str(tiny_model), checkpoint_dir=str(tmp_path), mode="async",
            ack_recheck_s=0.2, **settings,
        ),
        engine=engine,
    )  # fmt: skip
    sink = MetricsSink(run, str(tmp_path / "tb") if tensorboard else "")
    return TrainerService(bus, trainer, ReplicaSync([], trainer.settings.probe_token_ids), sink)


async def test_service_trains_whole_groups_settles_and_publishes(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
):
    rng = random.Random(1)
    service = trainer_service(
        bus, policy_engine, tiny_model, tmp_path, tensorboard=True, batch_groups=2, staleness=1,
        pool=PoolSettings(span_wait_s=1.0, group_wait_s=600.0),
    )  # fmt: skip
    trainer, run = service.trainer, service.settings.run
    await service.start()
    try:
        first, second = record_group(run, "g1", rng), record_group(run, "g2", rng)
        await publish_group(bus, first)
        # A rollout whose spans never arrive is dropped after span_wait_s, never trained half.
        lost = record_group(run, "g3", rng, size=1)
        await publish_group(bus, lost, publish_spans=False)
        await publish_group(bus, second)
        await wait_for(lambda: _has_versions(bus, run, 1))
        # The same rollouts redelivered (a controller retrying its publish) are not trained again.
        await publish_group(bus, first)
        await asyncio.sleep(1.5)
    finally:
        await service.stop()

    assert await versions_of(bus, run) == [1]
    stored = await bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
    assert stored[0].decode(WeightVersion).digest.startswith("sha256:")
    assert trainer.state.step == 1 and trainer.state.published
    assert sorted(trainer.state.trained[0]) == sorted(r.episode for _, r in first + second)
    assert trainer.settled >= {r.episode for _, r in lost}
    assert service.pool.dropped["spans_incomplete"] == 1
    metrics = service.last_metrics
    assert metrics is not None and metrics.version == 1
    assert metrics.values["rollouts/trained"] == 8
    assert metrics.values["rollouts/rows_per_rollout"] == 1.0
    assert metrics.values["reward/mean"] == 0.5
    assert metrics.staleness == {"0": 8}  # trained at version 0 on version-0 rollouts
    published = await bus.replay(subjects.METRICS.name, subjects.metrics(run, "trainer"))
    assert [m.decode(StepMetrics).step for m in published] == [1]
    state = msgspec.json.decode((tmp_path / run / "step-000001" / "trainer_state.json").read_bytes())
    assert state["version"] == 1
    assert (tmp_path / run / "step-000001" / "hf" / "model.safetensors").exists()
    assert (tmp_path / run / "latest").read_text() == "step-000001"
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


async def _has_versions(bus, run, count):
    return len(await versions_of(bus, run)) >= count


async def test_async_mode_drops_rollouts_beyond_the_staleness_bound(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
):
    rng = random.Random(2)
    service = trainer_service(bus, policy_engine, tiny_model, tmp_path, batch_groups=1, staleness=1)
    trainer, run = service.trainer, service.settings.run
    await service.start()
    try:
        await publish_group(bus, record_group(run, "g1", rng))
        await wait_for(lambda: _has_versions(bus, run, 1))
        await publish_group(bus, record_group(run, "g2", rng))
        await wait_for(lambda: _has_versions(bus, run, 2))
        # Version 0 rollouts at current version 2: lag 2 > 1, dropped and counted.
        stale = record_group(run, "g3", rng)
        await publish_group(bus, stale)
        await wait_for(lambda: _settled(trainer, stale))
    finally:
        await service.stop()
    assert await versions_of(bus, run) == [1, 2]
    assert service.last_metrics is not None
    assert service.last_metrics.dropped == {"stale": 4}


async def _settled(trainer, episodes):
    return all(r.episode in trainer.settled for _, r in episodes)


async def test_the_last_step_says_it_is_the_last(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
):
    rng = random.Random(2)
    service = trainer_service(
        bus, policy_engine, tiny_model, tmp_path, batch_groups=1, staleness=2, max_steps=2
    )
    run = service.settings.run
    await service.start()
    try:
        for name in ("g1", "g2", "g3"):
            await publish_group(bus, record_group(run, name, rng))
        await asyncio.wait_for(service.wait(), 120)  # the loop ends at max_steps
    finally:
        await service.stop()
    published = await bus.replay(subjects.METRICS.name, subjects.metrics(run, "trainer"))
    steps = [(m.step, m.final) for m in (item.decode(StepMetrics) for item in published)]
    assert steps == [(1, False), (2, True)]  # followers stop at the trainer's last step


async def test_the_process_loop_ends_at_max_steps(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
):
    # What app.serve runs: `finished` is awaited from before `start()` and still ends only at max_steps.
    rng = random.Random(4)
    service = trainer_service(bus, policy_engine, tiny_model, tmp_path, batch_groups=1, max_steps=1)
    running = asyncio.create_task(run_until_signalled(service, finished=finished(service, service.settings)))
    await asyncio.sleep(1.0)
    assert not running.done()  # started and waiting for rollouts, not finished
    await publish_group(bus, record_group(service.settings.run, "g1", rng))
    await asyncio.wait_for(running, 120)
    assert service.trainer.state.step == 1
    assert await versions_of(bus, service.settings.run) == [1]


async def test_a_trainer_told_to_stay_up_serves_on_after_max_steps_until_signalled(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
):
    # A Deployment restarts a process that exits, so there the trainer stays up once it is done.
    rng = random.Random(5)
    service = trainer_service(
        bus, policy_engine, tiny_model, tmp_path, batch_groups=1, max_steps=1, exit_at_max_steps=False
    )
    stop = asyncio.Event()
    done = finished(service, service.settings)
    running = asyncio.create_task(run_until_signalled(service, finished=done, stop=stop))
    await publish_group(bus, record_group(service.settings.run, "g1", rng))
    async with asyncio.timeout(120):
        while service.trainer.state.step < 1:
            await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    assert not running.done()  # trained its last step and stays up
    stop.set()
    await asyncio.wait_for(running, 30)
    assert await versions_of(bus, service.settings.run) == [1]


async def test_a_rollout_that_cant_be_decoded_is_dead_lettered_and_its_group_trains(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
):
    service = trainer_service(
        bus, policy_engine, tiny_model, tmp_path, batch_groups=1, decode_attempts=3,
        pool=PoolSettings(span_wait_s=30.0, group_wait_s=600.0),
    )  # fmt: skip
    run = service.settings.run
    group = record_group(run, "g1", random.Random(4), size=4)
    broken_recorder, broken = group[1]
    last = broken_recorder.spans[-1]
    broken_recorder.spans[-1] = msgspec.structs.replace(last, prompt_len=last.prompt_len + 3)
    await service.start()
    try:
        await publish_group(bus, group)
        await wait_for(lambda: _has_versions(bus, run, 1))
    finally:
        await service.stop()
    metrics = service.last_metrics
    assert metrics is not None and metrics.dropped == {"undecodable": 1}
    assert metrics.values["rollouts/trained"] == 3
    assert broken.episode in service.trainer.settled
    dead = await bus.js.get_last_msg(subjects.DLQ.name, subjects.dead_letter(subjects.rollout(run)))
    reason = dead.headers["Hrl-Dlq-Reason"]
    assert broken.episode in reason and "TokenDeltaError" in reason and "after 3 tries" in reason

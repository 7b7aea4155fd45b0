"""`Trainer.step` without a bus: settled rollouts stay bounded, and a restart still never retrains."""

import math
import random
from pathlib import Path

import msgspec
import pytest
import torch

from harnessrl.benchmarks.trainer import demo_batch
from harnessrl.trainer.checkpoint import STATE_FILE
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.errors import TrainerError
from harnessrl.trainer.settings import EngineSettings, TrainerSettings
from harnessrl.trainer.training import Trainer


def test_settled_ids_stay_bounded_and_old_redeliveries_are_dropped_as_stale(
    policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
) -> None:
    settings = TrainerSettings(
        run="bounded", model_dir=str(tiny_model), checkpoint_dir=str(tmp_path), mode="async", staleness=1
    )
    trainer = Trainer(settings, engine=policy_engine)
    rng = random.Random(3)
    batches = []
    sizes = []
    for _ in range(5):
        batch = demo_batch("bounded", rng, groups=2, size=4, version=trainer.version)
        batches.append(batch)
        assert trainer.step(batch).trained
        sizes.append((trainer.store.latest() / STATE_FILE).stat().st_size)  # type: ignore[operator]
    assert trainer.version == 5
    # Staleness 1: ids settled at versions 3 and 4 are kept (a version-3 rollout could still train).
    assert sorted(trainer.state.trained) == [3, 4]
    assert trainer.settled == {item.rollout_id for batch in batches[3:] for item in batch}
    assert sizes[4] == sizes[3]  # the state no longer grows with the run

    # A rollout from version 0 redelivered at version 5: not remembered, but stale, so not trained.
    result = trainer.step(batches[0])
    assert not result.trained and result.metrics.dropped == {"stale": 8}
    assert trainer.version == 5

    # After a restart the recent ids are still settled: the last batch redelivered is not retrained.
    restarted = Trainer(settings, engine=policy_engine)
    assert restarted.settled >= {item.rollout_id for item in batches[4]}
    assert not restarted.step(batches[4]).trained
    assert restarted.version == 5


def _weights(engine: PolicyEngine) -> list[torch.Tensor]:
    return [param.detach().clone() for param in engine.worker.engine.module.parameters()]


def test_a_non_finite_gradient_is_counted_and_is_not_a_new_version(
    policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
) -> None:
    settings = TrainerSettings(run="nan", model_dir=str(tiny_model), checkpoint_dir=str(tmp_path))
    trainer = Trainer(settings, engine=policy_engine)
    batch = demo_batch("nan", random.Random(5), groups=1, size=4, version=0)
    batch[0].rows[0].logprobs[0] = float("nan")  # a NaN behaviour logprob reaches the engine
    before = _weights(policy_engine)
    result = trainer.step(batch)
    assert not result.trained and result.checkpoint is not None  # a step, carrying version 0
    assert trainer.version == 0 and trainer.state.carries_previous
    assert result.metrics.dropped == {"nonfinite_gradient": 4}
    assert result.metrics.values["step/nonfinite_gradient"] == 1.0
    assert all(math.isfinite(value) for value in result.metrics.values.values())
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(policy_engine), strict=True))
    assert trainer.settled >= {item.rollout_id for item in batch}  # not retried forever
    # The next ordinary batch trains as usual.
    assert trainer.step(demo_batch("nan", random.Random(6), groups=1, size=4, version=0)).trained


def test_a_group_with_one_stale_member_is_dropped_whole(
    policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
) -> None:
    settings = TrainerSettings(
        run="stale", model_dir=str(tiny_model), checkpoint_dir=str(tmp_path), mode="async", staleness=1
    )
    trainer = Trainer(settings, engine=policy_engine)
    rng = random.Random(7)
    for _ in range(2):
        assert trainer.step(demo_batch("stale", rng, groups=1, size=4, version=trainer.version)).trained
    mixed = demo_batch("stale", rng, groups=2, size=4, version=trainer.version)
    mixed[0].min_version = 0  # one slow member of the first group, 2 versions behind
    result = trainer.step(mixed)
    assert result.trained
    assert result.metrics.dropped == {"stale": 4}
    assert result.metrics.values["groups/stale"] == 1.0
    assert result.metrics.values["rollouts/trained"] == 4.0  # the other group only


def test_a_run_resumes_only_on_the_rank_count_it_was_checkpointed_with(
    policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
) -> None:
    settings = TrainerSettings(run="ranks", model_dir=str(tiny_model), checkpoint_dir=str(tmp_path))
    trainer = Trainer(settings, engine=policy_engine)
    assert trainer.step(demo_batch("ranks", random.Random(8), groups=1, size=4, version=0)).trained
    state_file = trainer.store.latest() / STATE_FILE  # type: ignore[operator]
    state = msgspec.json.decode(state_file.read_bytes())
    assert state["ranks"] == 1
    state_file.write_bytes(msgspec.json.encode({**state, "ranks": 2}))  # as if written by 2 ranks
    with pytest.raises(TrainerError, match="checkpointed on 2 rank"):
        Trainer(settings, engine=policy_engine)


def test_the_step_trains_at_the_temperature_its_rows_were_sampled_at(
    policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
) -> None:
    batch = demo_batch("temp", random.Random(9), groups=1, size=4, version=0)
    for item in batch:
        for row in item.rows:
            row.temperature = 0.7
    seen: list[float] = []
    trainer = Trainer(
        TrainerSettings(run="temp", model_dir=str(tiny_model), checkpoint_dir=str(tmp_path / "a")),
        engine=policy_engine,
    )
    original = policy_engine.train

    def spy(rows_batch, *, step):  # the engine's own train, recording the temperature it got
        seen.append(rows_batch.temperature)
        return original(rows_batch, step=step)

    policy_engine.train = spy  # type: ignore[method-assign]
    try:
        assert trainer.step(batch).trained
        fixed = TrainerSettings(
            run="temp", model_dir=str(tiny_model), checkpoint_dir=str(tmp_path / "b"),
            engine=EngineSettings(temperature=1.0),
        )  # fmt: skip
        again = demo_batch("temp", random.Random(10), groups=1, size=4, version=0)
        for item in again:
            for row in item.rows:
                row.temperature = 0.7  # configured wins (build_rows would have masked such calls)
        assert Trainer(fixed, engine=policy_engine).step(again).trained
    finally:
        del policy_engine.train
    assert seen == [0.7, 1.0]

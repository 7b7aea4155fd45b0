"""`Trainer.step` without a bus: settled rollouts stay bounded, and a restart still never retrains."""

import random
from pathlib import Path

from harnessrl.benchmarks.trainer import demo_batch
from harnessrl.trainer.checkpoint import STATE_FILE
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.settings import TrainerSettings
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

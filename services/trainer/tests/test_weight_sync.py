"""Weight sync to a real vLLM CPU replica, verified by the trainer's probe."""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harnessrl.shared.contracts import RolloutComplete
from harnessrl.trainer.advantages import AssembledRollout, score_groups, token_weights
from harnessrl.trainer.batch import RowBatch
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.errors import WeightSyncError
from harnessrl.trainer.replica import VllmReplica
from harnessrl.trainer.samples import TrainingRow
from harnessrl.trainer.settings import AdvantageSettings
from harnessrl.trainer.weight_sync import ReplicaSync

PROBE = list(range(10, 42))


@pytest.fixture
async def replica(vllm_server, tiny_model: Path) -> AsyncIterator[VllmReplica]:
    """A client for the session's vLLM server; its original weights are back after the test."""
    async with VllmReplica(vllm_server.url, vllm_server.model) as client:
        yield client
        await client.reload_from(tiny_model)


def trainer_probe(engine: PolicyEngine):
    async def probe(ids):
        row = TrainingRow(
            rollout_id="probe", input_ids=list(ids), prompt_len=1,
            loss_mask=[1] * (len(ids) - 1), logprobs=[0.0] * (len(ids) - 1),
            versions=[0] * (len(ids) - 1),
        )  # fmt: skip
        return engine.row_logprobs([row])[0]

    return probe


def one_step(engine: PolicyEngine) -> None:
    """Three updates on one batch so the probe's logprobs visibly move."""
    rollouts = [
        AssembledRollout(
            rollout=RolloutComplete(run="r", episode=f"e{i}", task="t", group="g", reward=float(i % 2)),
            rows=[
                TrainingRow(
                    rollout_id=f"e{i}", input_ids=[*PROBE[:8], *range(50 + i, 60 + i)], prompt_len=8,
                    loss_mask=[1] * 10, logprobs=[-6.0] * 10, versions=[0] * 10,
                )
            ],
        )
        for i in range(8)
    ]  # fmt: skip
    outcome = score_groups(rollouts, AdvantageSettings())
    weights = token_weights(outcome.scored)
    batch = RowBatch(
        rows=[s.assembled.rows[0] for s in outcome.scored],
        advantages=[s.advantage * 20 for s in outcome.scored],
        weights=[weights[s.assembled.rollout_id] for s in outcome.scored],
    )
    for step in range(3):
        engine.train(batch, step=100 + step)


async def test_after_an_update_vllm_matches_the_trainer_and_differs_from_before(
    policy_engine: PolicyEngine, replica: VllmReplica, tmp_path: Path
):
    sync = ReplicaSync([replica], PROBE, tolerance=5e-3)
    probe = trainer_probe(policy_engine)
    await sync.sync(policy_engine.export_hf(tmp_path / "v1"), 1, probe)
    before = (await replica.probe_logprobs(PROBE)).prompt

    one_step(policy_engine)
    gap = await sync.sync(policy_engine.export_hf(tmp_path / "v2"), 2, probe)

    after = (await replica.probe_logprobs(PROBE)).prompt
    assert gap <= 5e-3
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 0.02  # >> tolerance
    assert await replica.weight_info() == "2"


async def test_a_replica_serving_other_weights_fails_the_sync_loudly(
    policy_engine: PolicyEngine, replica: VllmReplica, tiny_model: Path, tmp_path: Path
):
    one_step(policy_engine)
    sync = ReplicaSync([replica], PROBE, tolerance=5e-3)
    # The "checkpoint" holds the original weights while the trainer moved on: the probe must see it.
    with pytest.raises(WeightSyncError, match="differ from the trainer's"):
        await sync.sync(tiny_model, 3, trainer_probe(policy_engine))


async def test_collocated_sync_pauses_and_resumes_the_replica(
    policy_engine: PolicyEngine, replica: VllmReplica, tmp_path: Path
):
    sync = ReplicaSync([replica], PROBE, tolerance=5e-3, collocated=True)
    gap = await sync.sync(policy_engine.export_hf(tmp_path / "v7"), 7, trainer_probe(policy_engine))
    assert gap <= 5e-3
    assert not await replica.is_paused()
    assert await replica.weight_info() == "7"

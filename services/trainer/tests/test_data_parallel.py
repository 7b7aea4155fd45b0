"""Data-parallel training: how rows split over ranks, and that the split changes nothing it shouldn't.

The engine runs are real: `harnessrl.benchmarks.trainer_invariance` starts each under torchrun (gloo
on the CPU) in its own process group and compares the weights, the summed loss metrics and the
gradient norm. The service test runs `python -m harnessrl.trainer` on two ranks against a real
nats-server, stops it with SIGTERM and resumes it from its per-rank checkpoint.
"""

import asyncio
import os
import random
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import msgspec
import pytest
import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.utils import tensordict_utils as tu

from harnessrl.benchmarks.trainer_invariance import (
    SUMMED_METRICS,
    RunOptions,
    RunResult,
    compare,
    fixed_batch,
    longest_row,
    train_fixed_batch,
)
from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import WeightVersion
from harnessrl.shared.ids import new_id
from harnessrl.stack.local import service_argv
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.span_sequences import publish_episodes, record_group
from harnessrl.trainer.batch import (
    FILLER,
    FILLER_POSITION,
    batch_at,
    in_callers_order,
    rank_positions,
    rows_at,
    to_tensordict,
)
from harnessrl.trainer.loss import actor_config, rollout_normalized_loss, truncated_is_weights
from harnessrl.trainer.settings import LossSettings

# ---- how rows are shared out -------------------------------------------------------------


def test_one_rank_takes_every_row_in_order():
    batch = fixed_batch(5)
    assert rank_positions(batch.rows, 1) == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize(("rows", "ranks"), [(7, 2), (8, 2), (5, 4), (1, 2), (3, 3), (2, 4)])
def test_every_rank_gets_as_many_rows_and_every_row_goes_to_exactly_one(rows, ranks):
    batch = fixed_batch(rows, seed=rows * ranks)
    positions = rank_positions(batch.rows, ranks)
    assert len(positions) == ranks
    assert len({len(part) for part in positions}) == 1 and len(positions[0]) >= 1
    real = sorted(index for part in positions for index in part if index != FILLER_POSITION)
    assert real == list(range(rows))
    per_rank = len(positions[0])
    assert per_rank == max(1, -(-rows // ranks))  # as few as fit: fillers only round up
    assert sum(part.count(FILLER_POSITION) for part in positions) == per_rank * ranks - rows


def test_token_counts_are_balanced_across_ranks():
    batch = fixed_batch(16, seed=3)
    lengths = [len(row.input_ids) for row in batch.rows]
    tokens = [sum(lengths[i] for i in part) for part in rank_positions(batch.rows, 2)]
    assert abs(tokens[0] - tokens[1]) <= max(lengths) // 2  # a greedy split in order is far worse here


def test_a_filler_trains_nothing_and_results_come_back_in_the_callers_order():
    batch = fixed_batch(3)
    positions = rank_positions(batch.rows, 2)
    shards = [rows_at(batch.rows, part) for part in positions]
    assert FILLER in shards[0] + shards[1] and FILLER.trained_tokens == 0
    parts = [[[float(row.prompt_len)] for row in shard] for shard in shards]
    assert in_callers_order(positions, parts, 3) == [[float(row.prompt_len)] for row in batch.rows]
    shard = batch_at(batch, [2, FILLER_POSITION, 0])
    assert shard.rows == [batch.rows[2], FILLER, batch.rows[0]]
    assert shard.advantages == [batch.advantages[2], 0.0, batch.advantages[0]]
    assert shard.weights == [batch.weights[2], 0.0, batch.weights[0]]


# ---- the loss under data parallelism -----------------------------------------------------


def loss_and_metrics(batch, *, dp_size, batch_num_tokens):
    """Our loss on `batch` as verl's engine calls it on one rank of `dp_size` (policy = rollout)."""
    settings = LossSettings()
    data = to_tensordict(batch, dp_size=dp_size)
    tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens)  # as verl's engine: the global count
    per_token = []
    for row in batch.rows:
        values = torch.zeros(len(row.input_ids))
        values[row.prompt_len - 1 : len(row.input_ids) - 1] = torch.tensor(row.logprobs)
        per_token.append(values)
    model_output = {"log_probs": torch.nested.as_nested_tensor(per_token, layout=torch.jagged)}
    loss_fn = partial(rollout_normalized_loss, settings, actor_config(settings))
    return loss_fn(model_output=model_output, data=data)


def test_a_ranks_loss_is_dp_size_times_its_part_so_averaged_gradients_sum():
    batch = fixed_batch(4)
    tokens = float(sum(row.trained_tokens for row in batch.rows))
    alone, alone_metrics = loss_and_metrics(batch, dp_size=1, batch_num_tokens=tokens)
    ranked, ranked_metrics = loss_and_metrics(batch, dp_size=2, batch_num_tokens=2 * tokens)
    assert float(ranked) == pytest.approx(2 * float(alone), rel=1e-6)
    # Reported the way verl aggregates them (mean over ranks, sum over micro-batches): this rank's
    # part of the global loss and of the global token mean (half the tokens of two equal ranks).
    assert ranked_metrics["actor/pg_loss"].aggregate() == pytest.approx(2 * float(alone), rel=1e-6)
    alone_tis = alone_metrics["actor/tis_mean"].aggregate()
    assert ranked_metrics["actor/tis_mean"].aggregate() == pytest.approx(alone_tis, rel=1e-6)


def test_truncated_is_weights_clip_exactly_as_verls_rollout_correction():
    torch.manual_seed(0)
    old = torch.randn(6, 9) - 6.0
    rollout = old - torch.linspace(-3.0, 3.0, 54).reshape(6, 9)  # ratios e^-3 .. e^3 around 2
    rollout[0, 0] = old[0, 0] + 40.0  # beyond the +-20 safety clamp
    mask = (torch.rand(6, 9) > 0.2).float()
    ours = truncated_is_weights(old, rollout, mask, 2.0)
    verls, _ = compute_rollout_correction_weights(
        old - rollout, mask, rollout_is="token", rollout_is_threshold=2.0
    )
    assert torch.allclose(ours, verls, atol=1e-7, rtol=0)
    ratio = torch.exp(old - rollout)
    assert (ours[(ratio > 2.0) & (mask > 0)] == 2.0).all()
    assert (ours[(ratio < 2.0) & (mask > 0)] < 2.0).all()
    assert (ours[mask == 0] == 0).all()


# ---- real updates on one and two ranks ---------------------------------------------------


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    """The fixed batch (7 rows: one rank of two gets a filler), two updates each way."""
    root = tmp_path_factory.mktemp("dp")
    tiny = longest_row(fixed_batch())
    options = {
        "one": RunOptions(checkpoint=True),
        "two": RunOptions(ranks=2, checkpoint=True),
        "tiny": RunOptions(max_tokens_per_micro_batch=tiny),
    }
    return {name: train_fixed_batch(tiny_model, root / name, opts) for name, opts in options.items()}


def assert_summed_metrics_equal(a: RunResult, b: RunResult) -> None:
    for mine, theirs in zip(a.metrics, b.metrics, strict=True):
        for key in SUMMED_METRICS:
            assert theirs[key] == pytest.approx(mine[key], rel=1e-5, abs=1e-6), key


def test_one_update_on_two_ranks_equals_the_same_update_on_one(runs):
    one, two = runs["one"], runs["two"]
    gap = compare(one, two)
    assert gap.weights_max_abs <= 1e-5 and gap.last_weights_max_abs <= 1e-5
    assert gap.logprobs_max_abs <= 1e-5
    # Adam and clipping hide a gradient's scale from the weights: grad_norm and the loss show it.
    assert_summed_metrics_equal(one, two)
    assert two.metrics[1]["actor/kl_loss"] > 1e-4  # every loss term took part
    for key in ("actor/tis_mean", "actor/tis_clipped", "mismatch/kl_k1", "mismatch/max_abs"):
        assert two.metrics[0][key] == pytest.approx(one.metrics[0][key], rel=1e-5, abs=1e-6), key
    assert 0 < one.metrics[0]["actor/tis_clipped"] < 1  # some ratios clipped, some not


def test_micro_batches_of_one_row_change_neither_weights_nor_summed_losses(runs):
    gap = compare(runs["one"], runs["tiny"])
    assert gap.weights_max_abs <= 1e-5 and gap.logprobs_max_abs <= 1e-5
    assert_summed_metrics_equal(runs["one"], runs["tiny"])
    assert runs["tiny"].metrics[0]["actor/tis_mean"] == pytest.approx(
        runs["one"].metrics[0]["actor/tis_mean"], rel=1e-5
    )


def test_every_rank_writes_its_checkpoint_shard_and_loading_restores_the_weights(runs):
    assert {"model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"} <= set(
        runs["two"].checkpoint_files
    )
    assert {"optim_world_size_2_rank_0.pt", "optim_world_size_2_rank_1.pt"} <= set(
        runs["two"].checkpoint_files
    )
    assert runs["two"].reload_max_abs == 0.0 and runs["one"].reload_max_abs == 0.0


# ---- the service on two ranks ------------------------------------------------------------


def start_ranks(env: dict[str, str], log: Path, ranks: int = 2) -> subprocess.Popen[bytes]:
    """`harnessrl up --trainer-ranks 2`'s command, in its own process group (as the supervisor does)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            service_argv("trainer", ranks), env={**os.environ, **env},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


async def wait_versions(bus: Bus, run: str, count: int, proc, log: Path, timeout=240.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stored = await bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
        if len(stored) >= count:
            return [item.decode(WeightVersion).version for item in stored]
        assert proc.poll() is None, log.read_text()[-3000:]
        assert asyncio.get_running_loop().time() < deadline, log.read_text()[-3000:]
        await asyncio.sleep(0.2)


def stop_ranks(proc: subprocess.Popen[bytes], log: Path) -> str:
    """SIGTERM to every process (what stopping the local stack does); the log once all are gone."""
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=90)
    return log.read_text()


async def test_the_service_trains_on_two_ranks_stops_on_sigterm_and_resumes(
    bus: Bus, nats_server: NatsServer, tiny_model: Path, tmp_path: Path
):
    run = new_id("run")
    rng = random.Random(5)
    groups = [record_group(run, f"g{i}", rng, size=3) for i in range(3)]
    for group in groups[:2]:
        await publish_episodes(bus, group)
    env = {
        "HRL_TRAINER_RUN": run, "HRL_TRAINER_MODEL_DIR": str(tiny_model),
        "HRL_TRAINER_CHECKPOINT_DIR": str(tmp_path), "HRL_TRAINER_NATS_URL": nats_server.url,
        "HRL_TRAINER_MODE": "async", "HRL_TRAINER_STALENESS": "10", "HRL_TRAINER_BATCH_GROUPS": "1",
        "HRL_TRAINER_ACK_RECHECK_S": "0.2", "HRL_TRAINER_ENGINE": '{"torch_threads": 1}',
    }  # fmt: skip
    log = tmp_path / "ranks.log"
    first = start_ranks(env, log)
    try:
        assert await wait_versions(bus, run, 2, first, log) == [1, 2]
    finally:
        text = stop_ranks(first, log)
    assert text.count('"ranks.stopped"') == 1 and '"trainer.stopped"' in text, text[-3000:]
    latest = tmp_path / run / (tmp_path / run / "latest").read_text()
    assert {"model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"} <= {
        path.name for path in (latest / "engine").iterdir()
    }

    await publish_episodes(bus, groups[2])
    second = start_ranks(env, log)
    try:
        assert await wait_versions(bus, run, 3, second, log) == [1, 2, 3]
    finally:
        text = stop_ranks(second, log)
    assert text.count('"trainer.resumed"') == 1 and text.count('"ranks.stopped"') == 2, text[-3000:]
    state = msgspec.json.decode((tmp_path / run / "step-000003" / "trainer_state.json").read_bytes())
    assert state["version"] == 3 and state["published"]


FAILING_LEADER = """
import contextlib
import sys
import torch.distributed as dist
from harnessrl.trainer.ranks import RankChannel, RankError, ensure_process_group

ensure_process_group()
channel = RankChannel()
if not channel.leads:
    channel.follow({"boom": lambda _share: dist.barrier()})  # a collective rank 0 never joins
    sys.exit(0)
with contextlib.suppress(ValueError):
    with channel.command("boom", [None, None]):
        raise ValueError("rank 0 failed after sending")
try:
    with channel.command("next", [None, None]):
        print("next command sent", flush=True)  # must not happen: the group is broken
except RankError as exc:
    print("refused:", exc, flush=True)
channel.stop()  # sends nothing: the follower is not listening
print("leader exits", flush=True)
sys.exit(3)
"""


def test_a_leader_that_fails_mid_command_refuses_more_and_exits_without_hanging(tmp_path: Path):
    script = tmp_path / "leader.py"
    script.write_text(FAILING_LEADER)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "refused: next: 'boom' failed on rank 0 while the other ranks ran it" in done.stdout
    assert "next command sent" not in done.stdout
    assert "leader exits" in done.stdout

"""Is a trainer update the same however it is split? Data-parallel ranks and micro-batches.

- `dp_invariance(model_dir)`: the same updates of a fixed batch on 1 rank and on 2 ranks
  (torchrun, gloo on the CPU);
- `microbatch_invariance(model_dir)`: micro-batches of about one row vs one micro-batch for the
  whole batch, on 1 rank.

Both return the largest absolute difference over every parameter after one update; `compare` also
gives it after the last update, the differences of the summed loss metrics and the gradient norm
at every update, the logprobs after the last, and each run's step times.

Why the metrics matter as much as the weights: Adam's update `m / sqrt(v)` and gradient clipping
are blind to a gradient's scale, so a rank count that scales every gradient by 1/2 leaves the
weights alone and shows only in `grad_norm` and the loss. And why a small learning rate: Adam's
first update is `lr * g / (|g| + eps)`, so for a parameter whose gradient nearly cancels, to about
`eps` (1e-8), float32 noise from a different summation order (a different split) moves the update
by a fraction of `lr`: 1.15e-5 at lr 3e-4 for one-row micro-batches on the tiny model. The runs use
lr 1e-4, where a correct split stays below 4e-6 and a wrong one (rows lost, doubled or mis-weighted)
moves parameters by about `lr`.

Every run is its own process group: `python -m torch.distributed.run --standalone` runs this
module's `main` on each rank, every rank builds the engine, rank 0 trains the batch of
`fixed_batch` (the other ranks follow it, as in the service), reads the logprobs, exports the
weights and, with `checkpoint`, saves the engine checkpoint, trains once more and loads it back.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
from safetensors.torch import load_file

from harnessrl.trainer.batch import RowBatch
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.samples import TrainingRow
from harnessrl.trainer.settings import EngineSettings, LossSettings

# Metrics that are sums over the batch (or its gradient): they must not depend on the split.
SUMMED_METRICS = ("loss", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "grad_norm")
RESULT_FILE = "result.json"
# Every loss term is on: TIS (rollout logprobs far from the trainer's), entropy and a KL that is
# zero on the first step and not on the second.
LOSS = LossSettings(tis_clip=2.0, entropy_coef=0.01, kl_coef=0.05)
LARGE_MICRO_BATCH = 65536


class RunOptions(msgspec.Struct, frozen=True, kw_only=True):
    """One run: how many ranks, how large a micro-batch, how many updates of the fixed batch."""

    ranks: int = 1
    max_tokens_per_micro_batch: int = LARGE_MICRO_BATCH
    lr: float = 1e-4
    steps: int = 2
    rows: int = 7
    checkpoint: bool = False


class RunResult(msgspec.Struct, kw_only=True):
    """What a run measured; `weights` has the HF export after each update."""

    options: RunOptions
    metrics: list[dict[str, float]]
    step_s: list[float]
    logprobs: list[list[float]]
    weights: list[str]
    checkpoint_files: list[str] = msgspec.field(default_factory=list)
    # Weights after save, one more update and load, against the saved ones (0: restored exactly).
    reload_max_abs: float = 0.0


class Comparison(msgspec.Struct, kw_only=True):
    """Two runs of the same updates: the largest differences, and each run's step times."""

    # After the first update, and after the last.
    weights_max_abs: float
    last_weights_max_abs: float
    logprobs_max_abs: float
    metric_gaps: dict[str, float]
    step_s: tuple[float, float]


def fixed_batch(rows: int = 7, seed: int = 0) -> RowBatch:
    """Rows of different lengths, advantages and weights; tool output (mask 0) inside responses.

    The rollout logprobs are up to 1.5 nats away from the tiny model's, so truncated importance
    weights both clip (ratio above 2) and don't. An odd row count leaves one rank of two a filler.
    """
    rng = random.Random(seed)  # noqa: S311 - test data, not security
    out = RowBatch(rows=[], advantages=[], weights=[], temperature=0.9)
    for index in range(rows):
        prompt = [rng.randrange(10, 500) for _ in range(rng.randint(4, 20))]
        response = [rng.randrange(10, 500) for _ in range(rng.randint(3, 30))]
        mask = [0 if 2 <= position < 4 and index % 2 else 1 for position in range(len(response))]
        out.rows.append(
            TrainingRow(
                rollout_id=f"r{index}",
                input_ids=prompt + response,
                prompt_len=len(prompt),
                loss_mask=mask,
                logprobs=[-6.25 + rng.uniform(-1.5, 1.5) for _ in response],
                versions=[0] * len(response),
                temperature=0.9,
            )
        )
        out.advantages.append(rng.uniform(-1.5, 1.5))
        out.weights.append(1 / (rows * max(sum(mask), 1)))
    return out


def train_fixed_batch(
    model_dir: Path, out_dir: Path, options: RunOptions, *, timeout_s: float = 600.0
) -> RunResult:
    """Run `options` in a fresh process group of `options.ranks` processes; its result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={options.ranks}", "-m", __name__,
        "--model-dir", str(model_dir), "--out", str(out_dir),
        "--options", msgspec.json.encode(options).decode(),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{options} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return msgspec.json.decode((out_dir / RESULT_FILE).read_bytes(), type=RunResult)


def weights_max_abs(a: Path | str, b: Path | str) -> float:
    """The largest absolute difference over every parameter of two HF safetensors exports."""
    left = load_file(str(Path(a) / "model.safetensors"))
    right = load_file(str(Path(b) / "model.safetensors"))
    if left.keys() != right.keys():
        raise ValueError(f"different parameters: {sorted(left.keys() ^ right.keys())}")
    return max(float((left[name] - right[name]).abs().max()) for name in left)


def compare(a: RunResult, b: RunResult) -> Comparison:
    """How far run `b` is from run `a` (same batch, same number of updates)."""
    gaps = {
        f"{key}@{step}": abs(mine[key] - theirs[key])
        for step, (mine, theirs) in enumerate(zip(a.metrics, b.metrics, strict=True), start=1)
        for key in SUMMED_METRICS
        if key in mine and key in theirs
    }
    logprobs = max(
        abs(x - y)
        for left, right in zip(a.logprobs, b.logprobs, strict=True)
        for x, y in zip(left, right, strict=True)
    )
    return Comparison(
        weights_max_abs=weights_max_abs(a.weights[0], b.weights[0]),
        last_weights_max_abs=weights_max_abs(a.weights[-1], b.weights[-1]),
        logprobs_max_abs=logprobs,
        metric_gaps=gaps,
        step_s=(_steady_step_s(a), _steady_step_s(b)),
    )


def dp_invariance(model_dir: Path, work_dir: Path, *, ranks: int = 2, steps: int = 2) -> float:
    """Largest parameter difference between the same updates on 1 rank and on `ranks` ranks."""
    one = train_fixed_batch(model_dir, work_dir / "ranks-1", RunOptions(steps=steps))
    many = train_fixed_batch(model_dir, work_dir / f"ranks-{ranks}", RunOptions(ranks=ranks, steps=steps))
    return compare(one, many).weights_max_abs


def microbatch_invariance(model_dir: Path, work_dir: Path, *, steps: int = 2) -> float:
    """Largest parameter difference between micro-batches of about one row and one micro-batch."""
    large = train_fixed_batch(model_dir, work_dir / "micro-large", RunOptions(steps=steps))
    small = RunOptions(steps=steps, max_tokens_per_micro_batch=longest_row(fixed_batch()))
    tiny = train_fixed_batch(model_dir, work_dir / "micro-tiny", small)
    return compare(large, tiny).weights_max_abs


def longest_row(batch: RowBatch) -> int:
    """The smallest micro-batch budget the batch fits in (one row must fit in a micro-batch)."""
    return max(len(row.input_ids) for row in batch.rows)


def _steady_step_s(run: RunResult) -> float:
    """Mean step time after the first (which includes warm-up), or the only one."""
    times = run.step_s[1:] or run.step_s
    return statistics.fmean(times)


def _lead(engine: PolicyEngine, options: RunOptions, out_dir: Path) -> RunResult:
    """Rank 0: the updates, the logprobs after them, the export and the checkpoint round trip."""
    batch = fixed_batch(options.rows)
    result = RunResult(options=options, metrics=[], step_s=[], logprobs=[], weights=[])
    for step in range(1, options.steps + 1):
        started = time.perf_counter()
        result.metrics.append(engine.train(batch, step=step))
        result.step_s.append(time.perf_counter() - started)
        result.weights.append(str(engine.export_hf(out_dir / f"hf-{step}")))
    result.logprobs = engine.row_logprobs(batch.rows, temperature=batch.temperature)
    if options.checkpoint:
        _checkpoint_round_trip(engine, batch, out_dir, result)
    return result


def _checkpoint_round_trip(engine: PolicyEngine, batch: RowBatch, out_dir: Path, result: RunResult) -> None:
    """Save, train once more, load: the weights must be the saved ones again."""
    engine.save(out_dir / "engine", step=result.options.steps)
    result.checkpoint_files = sorted(path.name for path in (out_dir / "engine").iterdir())
    engine.train(batch, step=result.options.steps + 1)
    engine.load(out_dir / "engine")
    result.reload_max_abs = weights_max_abs(result.weights[-1], engine.export_hf(out_dir / "reloaded"))


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of a run (started by `train_fixed_batch` under torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--options", required=True, help="RunOptions as JSON")
    args = parser.parse_args(argv)
    options = msgspec.json.decode(args.options, type=RunOptions)
    settings = EngineSettings(
        lr=options.lr, torch_threads=1, max_tokens_per_micro_batch=options.max_tokens_per_micro_batch
    )
    engine = PolicyEngine(Path(args.model_dir), settings, LOSS)
    if not engine.ranks.leads:
        engine.follow()
        return 0
    try:
        result = _lead(engine, options, Path(args.out))
    finally:
        engine.stop_followers()
    (Path(args.out) / RESULT_FILE).write_bytes(msgspec.json.encode(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

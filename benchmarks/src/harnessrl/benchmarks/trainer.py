"""`make bench-trainer`: sample building, step rate and the asynchronous mode's speed-up.

- `rows_per_s`: sample building over a recorded-style corpus of multi-turn agent episodes.
- `steps_per_min`: real verl steps (plus checkpoint) on the tiny model with the demo's batch shape
  (8 tasks x group 8 = 64 rollouts of about 47 tokens).
- `async_speedup`: wall time to train the same number of rollouts in sync mode over async mode
  (staleness 2). Harness episodes are simulated with long-tailed durations (lognormal tool
  latency per turn, scaled so a mean episode lasts about one training step); training is the real
  engine. Sync waits for every episode of a batch (the tail) and then trains; async keeps episodes
  running while it trains, with admission control keeping in-flight work within the bound, and the
  trainer dropping anything staler. `max_staleness` is the largest lag actually trained.
- `dp_invariance_max_abs`: the same updates on 2 ranks (torchrun, gloo) and on 1 rank, largest
  parameter difference (target 1e-5); `microbatch_invariance_max_abs`: micro-batches of one row
  against one micro-batch (target 1e-5).
- `probe_catches_one_step_stale`: after one ordinary step, the weight-sync probe fails the
  previous version's logprobs (a replica that kept its old weights) and passes the new ones. The
  served logprobs are the trainer's own for each version (vLLM matches them within 1e-6, see
  `test_rollout_logprobs`; `test_weight_sync` runs the same check against a real replica).
- `long_rollout_tokens_trained`: tokens of the longest rollout trained in one step, a coding-agent
  episode whose last prompt is 32,768 tokens, in a group with a short attempt.

The last stdout line is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from harnessrl.benchmarks.trainer_invariance import dp_invariance, microbatch_invariance
from harnessrl.stack.demo.tiny_model import cached_tiny_model
from harnessrl.testkit.span_sequences import agent_episode, coding_episode, record_group
from harnessrl.trainer.advantages import AssembledRollout, split_stale
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.samples import build_rows
from harnessrl.trainer.settings import EngineSettings, LossSettings, TrainerSettings
from harnessrl.trainer.training import Trainer
from harnessrl.trainer.weight_sync import ProbeHistory, judge_probe, probe_row

STALENESS = 2


def bench_rows(episodes: int = 2000) -> dict[str, float]:
    """Rows (and spans) built per second from a corpus of 1-8 turn episodes."""
    rng = random.Random(0)  # noqa: S311 - a simulation, not security
    corpus = [agent_episode("bench", f"e{i}", rng, turns=rng.randint(1, 8)) for i in range(episodes)]
    started = time.perf_counter()
    rows = sum(len(build_rows(spans[0].episode, spans)[0]) for spans in corpus)
    elapsed = time.perf_counter() - started
    spans = sum(len(spans) for spans in corpus)
    return {"rows_per_s": rows / elapsed, "spans_per_s": spans / elapsed}


def demo_group(run: str, name: str, rng: random.Random, size: int, version: int) -> list[AssembledRollout]:
    """One group of `size` demo-shaped rollouts: 17 prompt tokens, 2 turns, about 47 tokens."""
    out = []
    episodes = record_group(
        run, name, rng, size=size, version=version, prompt_tokens=17, completion_tokens=14
    )
    for recorder, rollout in episodes:
        rows, _ = build_rows(rollout.episode, recorder.spans)
        out.append(AssembledRollout(rollout=rollout, rows=rows, min_version=version))
    return out


def demo_batch(run: str, rng: random.Random, groups: int, size: int, version: int) -> list[AssembledRollout]:
    """`groups` x `size` demo-shaped rollouts at `version`."""
    names = (f"v{version}-g{index}-{rng.randrange(10**9)}" for index in range(groups))
    return [item for name in names for item in demo_group(run, name, rng, size, version)]


def make_trainer(engine: PolicyEngine, root: Path, run: str, mode: str) -> Trainer:
    """A trainer for one measurement, sharing the engine, with its own checkpoints."""
    settings = TrainerSettings(
        run=run, model_dir=str(engine.model_dir), checkpoint_dir=str(root), mode=mode,  # type: ignore[arg-type]
        staleness=STALENESS,
    )  # fmt: skip
    return Trainer(settings, engine=engine)


def bench_steps(engine: PolicyEngine, root: Path, steps: int = 5) -> dict[str, float]:
    """Steps per minute at the demo's batch shape (one warm-up step not counted)."""
    trainer = make_trainer(engine, root, "steps", "async")
    rng = random.Random(1)  # noqa: S311 - a simulation, not security
    trainer.step(demo_batch("steps", rng, 8, 8, trainer.version))
    started = time.perf_counter()
    for _ in range(steps):
        trainer.step(demo_batch("steps", rng, 8, 8, trainer.version))
    step_s = (time.perf_counter() - started) / steps
    return {"steps_per_min": 60.0 / step_s, "step_s": step_s}


class EpisodeFarm:
    """Simulated harness episodes: 3 turns each, lognormal tool latency (long tail)."""

    def __init__(self, run: str, median_s: float, seed: int) -> None:
        self.run = run
        self.median_s = median_s
        self.rng = random.Random(seed)  # noqa: S311 - a simulation, not security
        self.counter = 0

    async def group(self, version: int, size: int) -> list[AssembledRollout]:
        """Run one group's episodes (sleeping their durations) and return its rollouts."""
        self.counter += 1
        name = f"g{self.counter}"
        delays = [sum(self.median_s * self.rng.lognormvariate(0, 1.0) for _ in range(3)) for _ in range(size)]
        await asyncio.gather(*(asyncio.sleep(delay) for delay in delays))
        return demo_group(self.run, name, self.rng, size, version)


async def run_sync(trainer: Trainer, farm: EpisodeFarm, steps: int, groups: int, size: int) -> list[int]:
    """On-policy: generate a whole batch at the current version, then train on it."""
    lags: list[int] = []
    for _ in range(steps):
        batches = await asyncio.gather(*(farm.group(trainer.version, size) for _ in range(groups)))
        batch = [item for group in batches for item in group]
        lags.extend(trainer.version - item.min_version for item in batch)
        await asyncio.to_thread(trainer.step, batch)
    return lags


async def run_async(
    trainer: Trainer, farm: EpisodeFarm, steps: int, groups: int, size: int
) -> tuple[list[int], int]:
    """Episodes keep running while the trainer trains; returns trained lags and stale drops."""
    done: asyncio.Queue[list[AssembledRollout]] = asyncio.Queue()
    launched = 0
    tasks: set[asyncio.Task[None]] = set()

    async def produce(version: int) -> None:
        await done.put(await farm.group(version, size))

    def admit() -> None:
        # Admission: never more groups started than versions up to current + k can consume.
        nonlocal launched
        while launched < (trainer.state.step + STALENESS + 1) * groups:
            launched += 1
            task = asyncio.create_task(produce(trainer.version))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    lags: list[int] = []
    dropped = 0
    while trainer.state.step < steps:
        admit()
        batch = [item for _ in range(groups) for item in await done.get()]
        fresh, stale = split_stale(batch, version=trainer.version, lag=STALENESS)
        dropped += len(stale)
        lags.extend(trainer.version - item.min_version for item in fresh)
        await asyncio.to_thread(trainer.step, batch)
    for task in tasks:
        task.cancel()
    return lags, dropped


def bench_async(engine: PolicyEngine, root: Path, step_s: float, steps: int = 8) -> dict[str, float]:
    """Same number of trained rollouts in sync and async mode; episodes about one step long."""
    groups, size = 4, 4
    median = step_s / (3 * 1.65)  # 3 turns, lognormal(0, 1) mean = e^0.5
    sync_trainer = make_trainer(engine, root, "sync", "sync")
    started = time.perf_counter()
    asyncio.run(run_sync(sync_trainer, EpisodeFarm("sync", median, 2), steps, groups, size))
    sync_s = time.perf_counter() - started
    async_trainer = make_trainer(engine, root, "async", "async")
    started = time.perf_counter()
    lags, dropped = asyncio.run(
        run_async(async_trainer, EpisodeFarm("async", median, 2), steps, groups, size)
    )
    async_s = time.perf_counter() - started
    return {
        "async_speedup": sync_s / async_s,
        "sync_wall_s": sync_s,
        "async_wall_s": async_s,
        "max_staleness": float(max(lags, default=0)),
        "staleness_bound": float(STALENESS),
        "dropped_stale": float(dropped),
    }


def bench_probe(engine: PolicyEngine, root: Path) -> dict[str, float]:
    """Whether the sync probe fails the previous version after one ordinary step (and passes the new)."""
    trainer = make_trainer(engine, root, "probe", "sync")
    settings = trainer.settings
    probe = probe_row(settings.probe_token_ids)
    history = ProbeHistory()
    before = engine.row_logprobs([probe])[0]
    history.reference(0, before)
    trainer.step(demo_batch("probe", random.Random(4), 8, 8, trainer.version))  # noqa: S311
    after = engine.row_logprobs([probe])[0]
    reference = history.reference(trainer.version, after)
    stale = judge_probe(before, reference, settings.probe_tolerance)
    fresh = judge_probe(after, reference, settings.probe_tolerance)
    return {
        "probe_catches_one_step_stale": float(not stale.passed and fresh.passed),
        "probe_one_step_gap": stale.gap,
    }


def bench_long_rollout(engine: PolicyEngine, root: Path) -> dict[str, float]:
    """One step on a group of two 32k-token coding episodes and a short attempt."""
    rng = random.Random(5)  # noqa: S311 - a simulation, not security
    trainer = make_trainer(engine, root, "long", "sync")
    recorders = [coding_episode("long", f"long-{i}", rng) for i in range(2)]
    recorders.append(coding_episode("long", "long-short", rng, turns=0))
    batch = []
    for recorder, reward in zip(recorders, (1.0, 0.0, 0.0), strict=True):
        rows, _ = build_rows(recorder.episode, recorder.spans)
        rollout = recorder.rollout(task="t", group="g", reward=reward, group_size=len(recorders))
        batch.append(AssembledRollout(rollout=rollout, rows=rows))
    started = time.perf_counter()
    result = trainer.step(batch)
    longest = max(sum(len(row.input_ids) for row in item.rows) for item in batch)
    return {
        "long_rollout_tokens_trained": float(longest if result.trained else 0),
        "long_rollout_step_s": time.perf_counter() - started,
    }


def main() -> None:
    """Run the three measurements; print one JSON object last."""
    result: dict[str, float] = {}
    result.update(bench_rows())
    sys.stderr.write(f"sample building: {result['rows_per_s']:.0f} rows/s\n")
    engine = PolicyEngine(cached_tiny_model(), EngineSettings(lr=3e-4), LossSettings())
    with tempfile.TemporaryDirectory(prefix="harnessrl-bench-trainer-") as tmp:
        root = Path(tmp)
        result.update(bench_steps(engine, root))
        sys.stderr.write(f"steps: {result['steps_per_min']:.1f}/min\n")
        result.update(bench_async(engine, root, result["step_s"]))
        result.update(bench_probe(engine, root))
        result.update(bench_long_rollout(engine, root))
        sys.stderr.write(f"long rollout: {result['long_rollout_tokens_trained']:.0f} tokens in one step\n")
        result["dp_invariance_max_abs"] = dp_invariance(engine.model_dir, root / "dp")
        result["microbatch_invariance_max_abs"] = microbatch_invariance(engine.model_dir, root / "micro")
    sys.stdout.write(json.dumps({key: _rounded(key, value) for key, value in result.items()}) + "\n")


def _rounded(key: str, value: float) -> float | bool:
    """Three decimals, except small differences (significant figures) and the yes/no figure."""
    if key == "probe_catches_one_step_stale":
        return bool(value)
    return float(f"{value:.3g}") if key.endswith("_max_abs") else round(value, 3)

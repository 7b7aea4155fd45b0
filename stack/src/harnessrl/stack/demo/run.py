"""`harnessrl demo`: the built-in run that shows learning on two CPU cores in about ten minutes.

Phases, each visible: generate the tiny model; warm start (supervised imitation of correct
episodes); start the local deployment; held-out evaluation; GRPO training of the unmodified
OpenAI-SDK harness through the whole system (gateway spans, lifecycle, reward service,
rollout-complete, verl trainer, weight versions, replica reload) with held-out evaluations every few
versions; final evaluation. The last stdout line is one JSON object with the before/after numbers.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import HELDOUT_GREEDY, HELDOUT_SAMPLED, LauncherSpec, RunSpec, StepMetrics
from harnessrl.stack.demo import harness as harness_module
from harnessrl.stack.demo.evaluate import accuracy
from harnessrl.stack.demo.tasks import demonstrations, task_spec, training_pairs, write_tasks
from harnessrl.stack.follow import HeldoutPoint, RunProgress
from harnessrl.stack.local import SERVED_MODEL
from harnessrl.stack.train import TrainSession, console


class DemoSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The calibrated recipe (see the module doc); tests shorten it."""

    run: str = "demo"
    steps: int = 15
    group_size: int = 8
    tasks_per_step: int = 8
    warm_steps: int = 800
    warm_examples: int = 20_000
    eval_every: int = 5
    lr: float = 3e-4
    improvement_floor: float = 0.6
    sampled_floor: float = 0.4


def build_model(home: Path) -> Path:
    """The generated tiny Qwen3 model (no downloads), cached per machine."""
    from harnessrl.stack.demo.tiny_model import cached_tiny_model

    return cached_tiny_model()


def warm_start(home: Path, base: Path, settings: DemoSettings) -> Path:
    """Imitate correct episodes (30% use the calculator) before RL; its own visible phase."""
    out = home / "demo" / "warm"
    demos = home / "demo" / "demonstrations.jsonl"
    demos.parent.mkdir(parents=True, exist_ok=True)
    demos.write_text("\n".join(json.dumps(d) for d in demonstrations(settings.warm_examples, seed=7)))
    argv = [sys.executable, "-m", "harnessrl.trainer.warmstart", "--model", str(base), "--demos", str(demos)]
    argv += ["--out", str(out), "--steps", str(settings.warm_steps)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return out


def run_spec(home: Path, settings: DemoSettings, model: Path) -> RunSpec:
    """The demo's run: the OpenAI-SDK harness as local episodes, GRPO groups of 8, sync mode."""
    count = settings.steps * settings.tasks_per_step * 2
    tasks = write_tasks(
        home / "demo" / "tasks.jsonl", (task_spec(a, b) for a, b in training_pairs(count, seed=11))
    )
    command = [sys.executable, str(Path(harness_module.__file__))]
    return RunSpec(
        run=settings.run,
        tasks=str(tasks),
        group_size=settings.group_size,
        batch_tasks=settings.tasks_per_step,
        max_concurrent=settings.group_size * settings.tasks_per_step,
        mode="sync",
        staleness=0,
        max_steps=settings.steps,
        episode_timeout_s=300,
        launcher=LauncherSpec(
            kind="local", command=command, env={"HARNESSRL_MODEL": SERVED_MODEL}, preload=["openai"]
        ),
        reward="numeric",
        model=str(model),
    )


def evaluate(session: TrainSession, step: int) -> HeldoutPoint:
    """Greedy and sampled held-out accuracy of the policy vLLM serves now."""
    stack = session.stack
    eval_run = f"{session.spec.run}-heldout"
    greedy = accuracy(stack.gateway_url, stack.key_secret, eval_run, SERVED_MODEL, 0.0)
    sampled = accuracy(stack.gateway_url, stack.key_secret, eval_run, SERVED_MODEL, 1.0)
    point = HeldoutPoint(step=step, greedy=greedy, sampled=sampled)
    session.progress.heldout.append(point)
    asyncio.run(publish_heldout(stack.nats_url, session.spec.run, point))
    console.print(f"held-out at step {step}: greedy {greedy:.1%}, sampled {sampled:.1%}")
    return point


async def publish_heldout(nats_url: str, run: str, point: HeldoutPoint) -> None:
    """The evaluation on METRICS (`hrl.metrics.<run>.heldout`), for dashboards and exports."""
    values = {HELDOUT_GREEDY: point.greedy, HELDOUT_SAMPLED: point.sampled}
    bus = NatsBus(nats_url, name="harnessrl-demo")
    await bus.connect()
    try:
        await bus.publish(
            subjects.metrics(run, subjects.HELDOUT_SOURCE),
            StepMetrics(run=run, step=point.step, version=point.step, values=values),
            msg_id=f"{run}:heldout:{point.step}",
        )
    finally:
        await bus.close()


async def _train(session: TrainSession, settings: DemoSettings) -> None:
    async def on_version(version: int, progress: RunProgress) -> None:
        if version % settings.eval_every == 0 and version < settings.steps:
            progress.phase = f"held-out evaluation (version {version})"
            await asyncio.to_thread(evaluate, session, version)
            progress.phase = "training"

    await session.follow(on_version)


def run_demo(home: Path, settings: DemoSettings) -> dict[str, float | int]:
    """All phases; returns the summary that becomes the last output line."""
    started = time.monotonic()
    console.rule("phase 1/5: generating the tiny model")
    base = build_model(home)
    console.rule(f"phase 2/5: warm start ({settings.warm_steps} supervised steps)")
    warm = warm_start(home, base, settings)
    # The demo's stack keeps its state (streams, KV, checkpoints) apart from the user's own runs and
    # starts it afresh: a second `make demo` runs the demo again instead of resuming a finished run.
    state = home / "demo" / "state"
    shutil.rmtree(state, ignore_errors=True)
    session = TrainSession(run_spec(home, settings, warm), state)
    try:
        console.rule("phase 3/5: starting nats-server, vLLM, gateway, reward, controller, trainer")
        session.start_stack()
        console.rule("phase 4/5: held-out evaluation before RL")
        before = evaluate(session, 0)
        console.rule(f"phase 5/5: GRPO through the whole system ({settings.steps} steps)")
        asyncio.run(_train(session, settings))
        after = evaluate(session, settings.steps)
        session.finish()
    finally:
        session.stop()
    return {
        "heldout_before": before.greedy,
        "heldout_after": after.greedy,
        "improvement": round(after.greedy - before.greedy, 4),
        "sampled_before": before.sampled,
        "sampled_after": after.sampled,
        "steps": session.progress.step,
        "episodes": session.progress.episodes["completed"],
        "wall_s": round(time.monotonic() - started, 1),
    }

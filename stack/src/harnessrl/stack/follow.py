"""Following a run from the event stream: a live terminal view, a summary and a plot.

Everything here is read from the bus (EPISODES, METRICS, WEIGHTS), so it works the same for a local
run and for one submitted to a cluster with `--nats-url`.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import msgspec
from rich.table import Table

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, ConsumerSpec, Delivery
from harnessrl.shared.contracts import StepMetrics, WeightVersion, decode_event, event_kind


class HeldoutPoint(msgspec.Struct, frozen=True, kw_only=True):
    """Held-out accuracy at one policy version."""

    step: int
    greedy: float
    sampled: float


class RunProgress(msgspec.Struct, kw_only=True):
    """What a person watching the run wants to know, kept up to date from the bus."""

    run: str
    max_steps: int = 0
    phase: str = "starting"
    version: int = 0
    episodes: Counter[str] = msgspec.field(default_factory=Counter)
    steps: list[StepMetrics] = msgspec.field(default_factory=list)
    heldout: list[HeldoutPoint] = msgspec.field(default_factory=list)
    # The step after which the run's trainer stops (its own `max_steps`), once it announced it.
    final_step: int | None = None
    started_at: float = msgspec.field(default_factory=time.monotonic)

    def trained(self) -> bool:
        """Whether training is over: `max_steps` reached, or the trainer's own last step."""
        last = min(self.max_steps, self.final_step) if self.final_step is not None else self.max_steps
        return self.step >= last and self.version >= last

    @property
    def step(self) -> int:
        """The last completed training step."""
        return self.steps[-1].step if self.steps else 0

    def value(self, name: str) -> float | None:
        """The latest value of a step metric."""
        return self.steps[-1].values.get(name) if self.steps else None

    def eta_s(self) -> float | None:
        """Seconds left, from the mean step time so far."""
        if not self.steps or not self.max_steps:
            return None
        per_step = (time.monotonic() - self.started_at) / max(len(self.steps), 1)
        return per_step * max(self.max_steps - self.step, 0)


class RunFollower:
    """Subscribes to a run's events and keeps a `RunProgress`."""

    def __init__(self, bus: Bus, run: str, max_steps: int = 0) -> None:
        self.bus = bus
        self.progress = RunProgress(run=run, max_steps=max_steps)

    async def start(self) -> None:
        """Subscribe (ephemeral consumers, from the start of each stream)."""
        run = self.progress.run
        feeds = (
            (subjects.EPISODES.name, subjects.episode_events_of_run(run), self._on_episode),
            (subjects.METRICS.name, subjects.metrics(run, "trainer"), self._on_metrics),
            (subjects.WEIGHTS.name, subjects.weights(run), self._on_weights),
        )
        for stream, subject, handler in feeds:
            await self.bus.subscribe(ConsumerSpec(stream=stream, filter_subject=subject), handler)

    async def _on_episode(self, delivery: Delivery) -> None:
        self.progress.episodes[event_kind(decode_event(delivery.data))] += 1

    async def _on_metrics(self, delivery: Delivery) -> None:
        metrics = delivery.decode(StepMetrics)
        if metrics.final:
            self.progress.final_step = metrics.step
        elif self.progress.final_step is not None and metrics.step > self.progress.final_step:
            # a trainer restarted with a higher max_steps trains on
            self.progress.final_step = None
        steps = [m for m in self.progress.steps if m.step != metrics.step] + [metrics]
        self.progress.steps = sorted(steps, key=lambda m: m.step)

    async def _on_weights(self, delivery: Delivery) -> None:
        self.progress.version = max(self.progress.version, delivery.decode(WeightVersion).version)


def _fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def render(progress: RunProgress) -> Table:
    """The live terminal view."""
    table = Table(title=f"harnessrl run {progress.run}", show_header=False, min_width=60)
    eps = progress.episodes
    running = eps["started"] - eps["agent_exited"]
    last = progress.heldout[-1] if progress.heldout else None
    eta = progress.eta_s()
    rows = [
        ("phase", progress.phase),
        ("step", f"{progress.step}/{progress.max_steps or '?'} (policy version {progress.version})"),
        ("reward mean", _fmt(progress.value("reward/mean"))),
        ("pass rate", _fmt(progress.value("reward/pass_rate"), "{:.1%}")),
        (
            "held-out greedy / sampled",
            f"{_fmt(last.greedy, '{:.1%}')} / {_fmt(last.sampled, '{:.1%}')}" if last else "-",
        ),
        ("episodes", f"running {max(running, 0)}, completed {eps['completed']}, failed {eps['failed']}"),
        (
            "staleness (max)",
            str(max((int(k) for k in progress.steps[-1].staleness), default=0)) if progress.steps else "-",
        ),
        ("tokens/s", _fmt(progress.value("perf/tokens_per_s"), "{:.0f}")),
        ("elapsed / ETA", f"{time.monotonic() - progress.started_at:.0f}s / {_fmt(eta, '{:.0f}s')}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def plot(progress: RunProgress, path: Path) -> Path:
    """Write a PNG of reward, pass rate and held-out accuracy per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [m.step for m in progress.steps]
    ax.plot(steps, [m.values.get("reward/mean", 0.0) for m in progress.steps], label="train reward (mean)")
    if progress.heldout:
        points = progress.heldout
        ax.plot([p.step for p in points], [p.greedy for p in points], "o-", label="held-out greedy")
        ax.plot([p.step for p in points], [p.sampled for p in points], "s--", label="held-out sampled")
    ax.set_xlabel("training step")
    ax.set_ylabel("accuracy / reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"harnessrl run {progress.run}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path

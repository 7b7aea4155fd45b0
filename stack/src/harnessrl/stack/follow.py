"""Following a run from the event stream: a live terminal view, a summary and a plot.

Everything here is read from the bus (EPISODES, RUNS, METRICS, WEIGHTS), so it works the same for a
local run and for one submitted to a cluster with `--nats-url`. Besides progress it keeps what says
a run is not working: failed episodes by cause and the last error, the controller's `RunStopped`,
warnings about steps that trained nothing, with their reasons, and how many sampled tokens the
last steps left untrained, by reason (the judging is in `health`).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
from rich.markup import escape
from rich.table import Table

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, ConsumerSpec, Delivery
from harnessrl.shared.contracts import (
    EpisodeEvent,
    EpisodeFailed,
    RunStopped,
    StepMetrics,
    WeightVersion,
    decode_event,
    event_kind,
)
from harnessrl.stack.health import (
    FailureNote,
    UntrainedWarning,
    counts_text,
    detail_lines,
    step_reasons,
    stop_text,
    untrained_tokens,
    untrained_warnings,
)

# Lifecycle kinds after which an episode's harness no longer runs.
HARNESS_DONE_KINDS = frozenset({"agent_exited", "completed", "failed"})


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
    # Episodes whose harness runs now (started, neither exited nor failed); left out of the summary.
    running: set[str] = msgspec.field(default_factory=set)
    # Failed episodes by cause (`agent`, `infra`, ...), and the last one.
    failures: Counter[str] = msgspec.field(default_factory=Counter)
    last_failure: FailureNote | None = None
    # The controller stopped the run (its first episodes all failed the same way).
    stopped: RunStopped | None = None
    steps: list[StepMetrics] = msgspec.field(default_factory=list)
    warnings: list[UntrainedWarning] = msgspec.field(default_factory=list)
    heldout: list[HeldoutPoint] = msgspec.field(default_factory=list)
    # The step after which the run's trainer stops (its own `max_steps`), once it announced it.
    final_step: int | None = None
    started_at: float = msgspec.field(default_factory=time.monotonic)

    def finished(self) -> bool:
        """Whether training is over: `max_steps` reached, or the trainer's own last step.

        The last step's weights must be known too, unless it trained nothing (no new version).
        """
        last = min(self.max_steps, self.final_step) if self.final_step is not None else self.max_steps
        return self.step >= last and (not self.steps or self.version >= self.steps[-1].version)

    def observe_episode(self, event: EpisodeEvent) -> None:
        """Count a lifecycle event; a failure is counted by cause and becomes the last error."""
        kind = event_kind(event)
        self.episodes[kind] += 1
        if kind == "started":
            self.running.add(event.episode)
        elif kind in HARNESS_DONE_KINDS:
            self.running.discard(event.episode)
        if isinstance(event, EpisodeFailed):
            self.failures[event.cause] += 1
            self.last_failure = FailureNote(
                episode=event.episode, cause=event.cause, reason=event.reason, detail=event.detail,
                logs=event.logs,
            )  # fmt: skip

    def observe_step(self, metrics: StepMetrics) -> None:
        """Record a step's metrics (a repeated step replaces the earlier one) and re-derive the warnings."""
        if metrics.final:
            self.final_step = metrics.step
        elif self.final_step is not None and metrics.step > self.final_step:
            # a trainer restarted with a higher max_steps trains on
            self.final_step = None
        steps = [m for m in self.steps if m.step != metrics.step] + [metrics]
        self.steps = sorted(steps, key=lambda m: m.step)
        self.warnings = untrained_warnings(self.steps)

    def observe_weights(self, weights: WeightVersion) -> None:
        """Track the newest weight version (one that carries the previous weights raises nothing)."""
        self.version = max(self.version, weights.version)

    def trained_steps(self) -> int:
        """How many steps updated the policy."""
        return sum(m.trained for m in self.steps)

    def untrained_reasons(self) -> Counter[str]:
        """Why the steps that trained nothing did (reason counts summed over them)."""
        return sum((step_reasons(m) for m in self.steps if not m.trained), Counter())

    def problems(self) -> list[str]:
        """Why the run did not do its job, for a person (empty when it did)."""
        found = []
        if self.stopped is not None:
            found.append(f"run {self.run} stopped: {stop_text(self.stopped)}")
        if self.steps and not self.trained_steps():
            found.append(
                f"nothing was trained: none of the {len(self.steps)} steps updated the policy "
                f"({counts_text(self.untrained_reasons())})"
            )
        if self.stopped is None and self.step < self.max_steps:
            found.append(
                f"the trainer of run {self.run} stopped at step {self.step} (its own max_steps), short "
                f"of this spec's {self.max_steps}: raise the deployment trainer's max_steps"
            )
        return found

    def summary(self) -> dict[str, Any]:
        """What `summary.json` holds: the progress, how many steps trained and why the run failed."""
        problems = self.problems()
        out: dict[str, Any] = msgspec.to_builtins(self)
        del out["running"]
        out["warnings"] = [{**msgspec.to_builtins(w), "message": w.message()} for w in self.warnings]
        out.update(trained_steps=self.trained_steps(), why="; ".join(problems) if problems else None)
        return out

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
            (subjects.RUNS.name, subjects.run_event(run, "stopped"), self._on_stopped),
            (subjects.METRICS.name, subjects.metrics(run, subjects.TRAINER_SOURCE), self._on_metrics),
            (subjects.WEIGHTS.name, subjects.weights(run), self._on_weights),
        )
        for stream, subject, handler in feeds:
            await self.bus.subscribe(ConsumerSpec(stream=stream, filter_subject=subject), handler)

    async def _on_episode(self, delivery: Delivery) -> None:
        self.progress.observe_episode(decode_event(delivery.data))

    async def _on_stopped(self, delivery: Delivery) -> None:
        self.progress.stopped = delivery.decode(RunStopped)

    async def _on_metrics(self, delivery: Delivery) -> None:
        self.progress.observe_step(delivery.decode(StepMetrics))

    async def _on_weights(self, delivery: Delivery) -> None:
        self.progress.observe_weights(delivery.decode(WeightVersion))


def _fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def view_rows(progress: RunProgress) -> list[tuple[str, str]]:
    """What the live view shows, as (name, value) rows."""
    eps = progress.episodes
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
        (
            "episodes",
            f"running {len(progress.running)}, completed {eps['completed']}, failed {eps['failed']}",
        ),
        (
            "staleness (max)",
            str(max((int(k) for k in progress.steps[-1].staleness), default=0)) if progress.steps else "-",
        ),
        ("tokens/s", _fmt(progress.value("perf/tokens_per_s"), "{:.0f}")),
        ("elapsed / ETA", f"{time.monotonic() - progress.started_at:.0f}s / {_fmt(eta, '{:.0f}s')}"),
    ]
    return rows + trouble_rows(progress)


def render(progress: RunProgress) -> Table:
    """The live terminal view."""
    table = Table(title=f"harnessrl run {progress.run}", show_header=False, min_width=60)
    for name, value in view_rows(progress):
        table.add_row(name, value)
    return table


def step_line(progress: RunProgress) -> str:
    """The view as one line, printed per step where output is no terminal (a log, CI)."""
    return " | ".join(f"{name} {value}" for name, value in view_rows(progress) if name != "phase")


def trouble_rows(progress: RunProgress) -> list[tuple[str, str]]:
    """The view's rows about what goes wrong: failures, the last error, untrained tokens, warnings, a stop."""
    rows = [("failures by cause", escape(counts_text(progress.failures)) if progress.failures else "-")]
    last = progress.last_failure
    if last is not None:
        lines = [f"{last.cause}: {last.reason}", *detail_lines(last.detail)]
        rows.append(("last error", escape("\n".join(lines))))
    untrained = untrained_tokens(progress.steps)
    if untrained is not None:
        rows.append(("untrained tokens", escape(untrained.message())))
    rows += [("[yellow]warning[/]", escape(warning.message())) for warning in progress.warnings[-1:]]
    if progress.stopped is not None:
        rows.append(("[red]stopped[/]", escape(stop_text(progress.stopped))))
    return rows


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

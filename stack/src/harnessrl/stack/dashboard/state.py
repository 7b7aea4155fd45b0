"""What the dashboard shows, kept up to date from the bus: one `RunBoard` per run seen.

Entries come from `harnessrl tail`'s `Tail` (every stream, from the start). A run's progress
(steps, policy version, lifecycle counts, failures) is `follow.RunProgress`, the same object the
terminal view of `harnessrl train` keeps; the board adds what a page shows on top: each episode's
state, reward and calls, held-out accuracy, the weight versions and the sampling rate. Messages the
board can't use are counted (`ignored`, by reason), never dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from typing import Any

import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.contracts import (
    HELDOUT_GREEDY,
    HELDOUT_SAMPLED,
    EpisodeCompleted,
    EpisodeEventBase,
    EpisodeFailed,
    EpisodeRetried,
    EpisodeScored,
    RolloutComplete,
    RunStopped,
    Span,
    StepMetrics,
    WeightVersion,
    event_kind,
)
from harnessrl.stack.follow import HeldoutPoint, RunProgress
from harnessrl.stack.health import stop_text
from harnessrl.stack.tail import Entry

# An episode in one of these states no longer runs.
DONE_STATES = frozenset({"completed", "failed", "retried"})
# Spans whose end falls this long before the newest one's count toward the sampling rate.
RATE_WINDOW_S = 60.0
# The finished episodes a board lists besides those in flight (the newest).
RECENT_DONE = 24


class EpisodeRow(msgspec.Struct, kw_only=True):
    """One episode as the page lists it."""

    episode: str
    task: str = ""
    group: str = ""
    attempt: int = 0
    state: str = "sampling"
    reward: float | None = None
    calls: int = 0
    tokens_out: int = 0
    version: int | None = None
    failure: str | None = None
    updated_at: float = 0.0

    @property
    def in_flight(self) -> bool:
        """Whether the episode still runs or waits for its grade."""
        return self.state not in DONE_STATES


class RunBoard:
    """Everything the page shows about one run."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.progress = RunProgress(run=run)
        self.episodes: dict[str, EpisodeRow] = {}
        self.weights: list[WeightVersion] = []
        self.rewards: list[float] = []
        self.outcomes: Counter[str] = Counter()  # grades by outcome: `forgery` is a forged report
        self.span_ends: deque[tuple[float, int]] = deque()
        self.ignored: Counter[str] = Counter()
        self.updated_at = 0.0

    def episode(self, episode: str) -> EpisodeRow:
        """The row of `episode`, created on its first message."""
        return self.episodes.setdefault(episode, EpisodeRow(episode=episode))

    def observe(self, entry: Entry) -> None:
        """Take one decoded entry of this run."""
        message = entry.message
        match message:
            case Span():
                self._span(message)
            case EpisodeEventBase():
                self._lifecycle(message)
            case RolloutComplete():
                self.rewards.append(message.reward)
            case WeightVersion():
                self.weights.append(message)
                self.progress.observe_weights(message)
            case StepMetrics():
                self._metrics(entry.subject.rsplit(".", 1)[-1], message)
            case RunStopped():
                self.progress.stopped = message
            case _:
                self.ignored[f"unused {entry.kind}"] += 1
        self.updated_at = time.time()

    def _span(self, span: Span) -> None:
        row = self.episode(span.episode)
        out = len(span.completions[0].token_ids) if span.completions else 0
        row.calls, row.tokens_out = row.calls + 1, row.tokens_out + out
        row.version = span.weight_version_end or span.weight_version_start
        row.updated_at = max(row.updated_at, span.started_at + span.latency_s)
        self.span_ends.append((span.started_at + span.latency_s, out))
        newest = max(end for end, _ in self.span_ends)
        while self.span_ends and self.span_ends[0][0] < newest - RATE_WINDOW_S:
            self.span_ends.popleft()

    def _lifecycle(self, event: EpisodeEventBase) -> None:
        self.progress.observe_episode(event)  # type: ignore[arg-type]
        row = self.episode(event.episode)
        row.task, row.group, row.attempt = event.task, event.group, event.attempt
        row.state, row.updated_at = event_kind(event), max(row.updated_at, event.at)
        match event:
            case EpisodeScored():
                row.reward = event.reward
                self.outcomes[event.outcome] += 1
            case EpisodeCompleted():
                row.reward = event.reward
            case EpisodeFailed():
                row.failure = f"{event.cause}: {event.reason}"
            case EpisodeRetried():
                row.failure = f"retried as {event.new_episode}"

    def _metrics(self, source: str, metrics: StepMetrics) -> None:
        if source == subjects.TRAINER_SOURCE:
            self.progress.observe_step(metrics)
        elif source == subjects.HELDOUT_SOURCE and HELDOUT_GREEDY in metrics.values:
            point = HeldoutPoint(
                step=metrics.step, greedy=metrics.values[HELDOUT_GREEDY],
                sampled=metrics.values.get(HELDOUT_SAMPLED, float("nan")),
            )  # fmt: skip
            heldout = [p for p in self.progress.heldout if p.step != point.step] + [point]
            self.progress.heldout = sorted(heldout, key=lambda p: p.step)
        else:
            self.ignored[f"metrics of source {source}"] += 1

    def sampled_tokens_per_s(self) -> float:
        """Completion tokens per second over the last `RATE_WINDOW_S` of spans."""
        if len(self.span_ends) < 2:
            return 0.0
        first, last = self.span_ends[0][0], self.span_ends[-1][0]
        return sum(out for _, out in self.span_ends) / max(last - first, 1.0)

    def episode_rows(self, state: str = "all") -> list[EpisodeRow]:
        """Episodes in `state` (`in_flight`, `done`, a lifecycle kind or `all`), newest first."""
        rows = sorted(self.episodes.values(), key=lambda row: row.updated_at, reverse=True)
        if state == "all":
            return rows
        if state == "in_flight":
            return [row for row in rows if row.in_flight]
        if state == "done":
            return [row for row in rows if not row.in_flight]
        return [row for row in rows if row.state == state]

    def summary(self) -> dict[str, Any]:
        """The page's data: curves per step, episodes by state, staleness, rates, weights."""
        progress = self.progress
        shown = self.episode_rows("in_flight") + self.episode_rows("done")[:RECENT_DONE]
        return {
            "run": self.run,
            "updated_at": self.updated_at,
            "step": progress.step,
            "version": progress.version,
            "steps": [_step_point(m) for m in progress.steps],
            "heldout": [msgspec.to_builtins(p) for p in progress.heldout],
            "episodes": {
                "by_state": dict(Counter(row.state for row in self.episodes.values())),
                "in_flight": sum(row.in_flight for row in self.episodes.values()),
                "total": len(self.episodes),
                "rows": [msgspec.to_builtins(row) for row in shown],
            },
            "rewards": {"rollouts": len(self.rewards), "mean": _mean(self.rewards)},
            "gradings": dict(self.outcomes),
            "tokens_per_s": {
                "trained": progress.value("perf/tokens_per_s"),
                "sampled": round(self.sampled_tokens_per_s(), 2),
            },
            "staleness": _staleness(progress.steps[-1]) if progress.steps else {},
            "weights": [msgspec.to_builtins(w) for w in self.weights[-50:]],
            "failures": dict(progress.failures),
            "stopped": stop_text(progress.stopped) if progress.stopped else None,
            "ignored": dict(self.ignored),
        }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _staleness(metrics: StepMetrics) -> dict[str, int]:
    """A step's rollouts by staleness (versions behind), in order."""
    return {key: metrics.staleness[key] for key in sorted(metrics.staleness, key=int)}


def _step_point(metrics: StepMetrics) -> dict[str, Any]:
    """One step of the curves."""
    values = metrics.values
    behind = [int(key) for key, n in metrics.staleness.items() if n]
    return {
        "step": metrics.step,
        "version": metrics.version,
        "trained": metrics.trained,
        "reward_mean": values.get("reward/mean"),
        "pass_rate": values.get("reward/pass_rate"),
        "tokens_per_s": values.get("perf/tokens_per_s"),
        "staleness_max": max(behind, default=0),
        "at": metrics.at,
    }


class Board:
    """Every run's board, and a signal for listeners that something changed."""

    def __init__(self) -> None:
        self.runs: dict[str, RunBoard] = {}
        self.ignored: Counter[str] = Counter()
        self.changes = 0
        self._changed = asyncio.Condition()

    async def observe(self, entry: Entry) -> None:
        """Take one entry of any run and wake the listeners."""
        run = getattr(entry.message, "run", "") if entry.message is not None else ""
        if entry.message is None:
            self.ignored[f"undecodable {entry.kind}"] += 1
        elif not run:
            self.ignored[f"{entry.kind} of no run"] += 1
        else:
            self.runs.setdefault(run, RunBoard(run)).observe(entry)
        async with self._changed:
            self.changes += 1
            self._changed.notify_all()

    async def wait_change(self, seen: int, timeout_s: float) -> int:
        """Wait until there were more than `seen` changes (or `timeout_s`); returns the count now."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: self.changes > seen), timeout_s)
            return self.changes

    def run_list(self) -> list[dict[str, Any]]:
        """The runs seen, most recently updated first."""
        boards = sorted(self.runs.values(), key=lambda board: board.updated_at, reverse=True)
        return [
            {"run": b.run, "updated_at": b.updated_at, "step": b.progress.step, "episodes": len(b.episodes)}
            for b in boards
        ]

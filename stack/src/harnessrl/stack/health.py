"""What says a run is not working, from its events: failures, a stop, steps that trained nothing.

Pure functions and Structs over decoded contracts, so the follower, the view and the summary share
one wording and tests need no bus.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import msgspec

from harnessrl.shared.contracts import RunStopped, StepMetrics

# Steps in a row that trained nothing before the view and the summary warn about it.
UNTRAINED_WARN_AFTER = 3
# Step values that count skipped groups, the reasons of a step that reported no `dropped`.
GROUP_SKIP_VALUES = ("groups/zero_variance", "groups/too_small")


class FailureNote(msgspec.Struct, frozen=True, kw_only=True):
    """The last failed episode, as the view shows it."""

    episode: str
    cause: str
    reason: str
    detail: str = ""
    logs: str = ""


class UntrainedWarning(msgspec.Struct, frozen=True, kw_only=True):
    """Consecutive steps that trained nothing, with their reason counts summed over them."""

    first_step: int
    last_step: int
    counts: dict[str, int]

    def message(self) -> str:
        """One line for a person: which steps, and why."""
        steps = self.last_step - self.first_step + 1
        which = f"steps {self.first_step}-{self.last_step} ({steps} in a row)"
        return f"{which} trained nothing: {counts_text(self.counts)}"


def counts_text(counts: Mapping[str, int]) -> str:
    """`reason count, ...`, the largest first."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{name} {count}" for name, count in ranked) or "no reason reported"


def stop_text(stop: RunStopped) -> str:
    """Why the controller stopped a run, in one line: how many episodes failed, the cause, the reason."""
    return f"{stop.episodes} episodes failed ({stop.cause}): {stop.reason}"


def step_reasons(metrics: StepMetrics) -> Counter[str]:
    """Why a step trained nothing: its `dropped` counts, else its skipped-group counts."""
    reasons = Counter({name: count for name, count in metrics.dropped.items() if count})
    if not reasons:
        values = metrics.values
        reasons.update({name: int(values[name]) for name in GROUP_SKIP_VALUES if values.get(name)})
    return reasons


def untrained_warnings(
    steps: Sequence[StepMetrics], after: int = UNTRAINED_WARN_AFTER
) -> list[UntrainedWarning]:
    """One warning per streak of at least `after` consecutive steps (in step order) that trained nothing."""
    streaks: list[list[StepMetrics]] = [[]]
    for metrics in steps:
        if metrics.trained:
            streaks.append([])
        else:
            streaks[-1].append(metrics)
    return [
        UntrainedWarning(
            first_step=streak[0].step,
            last_step=streak[-1].step,
            counts=dict(sum((step_reasons(m) for m in streak), Counter())),
        )
        for streak in streaks
        if len(streak) >= after
    ]


def detail_lines(detail: str, count: int = 2) -> list[str]:
    """The first `count` non-blank lines of a stderr tail, each cut to 160 characters."""
    lines = [line.rstrip()[:160] for line in detail.splitlines() if line.strip()]
    return lines[:count]

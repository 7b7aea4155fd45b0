"""What says a run is not working, from its events: failures, a stop, untrained steps and tokens.

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
# Step values (the trainer's sample-building counts) of sampled tokens that trained in no row, by reason.
UNTRAINED_TOKEN_VALUES = (
    "tokens/truncated",
    "tokens/prompt_too_long",
    "tokens/missing_logprob",
    "tokens/dead_end",
    "tokens/unmodeled_sampling",
    "tokens/skipped",
)
# The latest steps whose untrained tokens the view sums.
UNTRAINED_TOKENS_WINDOW = 5


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


class UntrainedTokens(msgspec.Struct, frozen=True, kw_only=True):
    """Sampled tokens that steps `first_step`-`last_step` left untrained, by reason."""

    first_step: int
    last_step: int
    sampled: int
    counts: dict[str, int]

    def message(self) -> str:
        """One line: how many of the sampled tokens, and why."""
        untrained = sum(self.counts.values())
        share = f" ({untrained / self.sampled:.1%})" if self.sampled else ""
        steps = (
            f"step {self.last_step}"
            if self.first_step == self.last_step
            else f"steps {self.first_step}-{self.last_step}"
        )
        return f"{steps}: {untrained:,} of {self.sampled:,} sampled{share}: {counts_text(self.counts)}"


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


def untrained_tokens(
    steps: Sequence[StepMetrics], window: int = UNTRAINED_TOKENS_WINDOW
) -> UntrainedTokens | None:
    """What the last `window` steps left untrained (reasons without the `tokens/`); None if nothing."""
    recent = steps[-window:]
    counts: Counter[str] = Counter()
    for metrics in recent:
        for name in UNTRAINED_TOKEN_VALUES:
            counts[name.removeprefix("tokens/")] += int(metrics.values.get(name, 0.0))
    counts = +counts
    if not counts:
        return None
    return UntrainedTokens(
        first_step=recent[0].step,
        last_step=recent[-1].step,
        sampled=int(sum(metrics.values.get("tokens/sampled", 0.0) for metrics in recent)),
        counts=dict(counts),
    )


def detail_lines(detail: str, count: int = 2) -> list[str]:
    """The first `count` non-blank lines of a stderr tail, each cut to 160 characters."""
    lines = [line.rstrip()[:160] for line in detail.splitlines() if line.strip()]
    return lines[:count]

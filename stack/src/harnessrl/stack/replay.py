"""`harnessrl replay`: what the trainer would train on a run's stored log, under a chosen policy.

Reads the run's `RolloutComplete` messages (ROLLOUTS) and each rollout's spans (SPANS), builds its
rows with the trainer's own `build_rows` under the `SampleLimits` and temperature given on the
command line, and applies the trainer's group rules and advantages (`score_groups`). Nothing runs:
no episode, no engine, no weights. Groups are replayed one at a time (advantages are computed
within a group), so only one group's rows are held at once.

As in the trainer, a rollout whose spans are not all stored is left out (`spans_incomplete`), one
whose spans can't be decoded is a member that can't train (`undecodable`), a span repeated under
one seq counts once, and the temperature rows model is `--temperature`, else the one the first
rollout showing one was sampled at (`run_temperature`). The last `RolloutComplete` of an episode
counts. Token counts are named like the trainer's step metrics: `untrained.dead_end` here is
`tokens/dead_end` there, and each reason's share is of the sampled tokens.

The trainer's sample and advantage modules load torch and verl, so they are imported when the
command runs, not when `harnessrl --help` builds the parser.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, get_args

import msgspec
from rich.console import Console
from rich.table import Table

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, BusError, NatsBus
from harnessrl.shared.contracts import ContractError, RolloutComplete, Span
from harnessrl.shared.net import NatsUnreachable, probe_nats
from harnessrl.shared.settings import SettingsError
from harnessrl.stack.health import counts_text
from harnessrl.stack.tail import nats_url_option, subject_token
from harnessrl.trainer.settings import AdvantageSettings, Estimator, SampleLimits

if TYPE_CHECKING:
    from harnessrl.trainer.advantages import AssembledRollout, GroupOutcome
    from harnessrl.trainer.samples import BuildReport

# Why sampled tokens train in no row: `BuildReport.<reason>_tokens`, `tokens/<reason>` in step metrics.
UNTRAINED_REASONS = (
    "skipped",
    "prompt_too_long",
    "truncated",
    "missing_logprob",
    "dead_end",
    "unmodeled_sampling",
)


class ReplayPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """The merge and normalisation policy a replay builds rows and advantages under."""

    limits: SampleLimits = msgspec.field(default_factory=SampleLimits)
    advantages: AdvantageSettings = msgspec.field(default_factory=AdvantageSettings)
    # The temperature rows model; None learns it from the log, as the trainer does.
    temperature: float | None = None


class RowStats(msgspec.Struct, kw_only=True):
    """How rollouts became rows; the rates are over rollouts that became at least one."""

    built: int
    per_rollout: dict[str, int]
    mean_per_rollout: float
    single_row_rate: float
    truncated: int


class TokenStats(msgspec.Struct, kw_only=True):
    """Sampled tokens: how many train (in every row; in groups that train) and why the rest don't."""

    sampled: int
    trained: int
    trained_in_scored: int
    untrained: int
    masked_share: float
    untrained_by_reason: dict[str, int]
    masked_share_by_reason: dict[str, float]
    unmodeled_sampling: dict[str, int]


class GroupStats(msgspec.Struct, kw_only=True):
    """How the group rules came out, and the rollouts they left out by reason."""

    total: int
    trained: int
    zero_variance: int
    too_small: int
    dropped: dict[str, int]


class Spread(msgspec.Struct, kw_only=True):
    """The advantages of the rollouts that would train (population std; `mean_abs` their magnitude)."""

    count: int = 0
    min: float = 0.0
    max: float = 0.0
    mean: float = 0.0
    std: float = 0.0
    mean_abs: float = 0.0


class ReplayReport(msgspec.Struct, kw_only=True):
    """Everything a replay found; `--json` prints it as one object."""

    run: str
    policy: ReplayPolicy
    # The temperature rows were built for: the policy's, else learned (None: each rollout's own or 1.0).
    temperature_used: float | None
    rollouts: dict[str, int]
    rows: RowStats
    mismatches: dict[str, int]
    tokens: TokenStats
    # Calls that started no row: failed upstream or empty (`skipped`), or a prompt too long.
    calls: dict[str, int]
    groups: GroupStats
    advantages: Spread


class Tally:
    """What the replayed groups came to, summed as each group is replayed."""

    def __init__(self, temperature: float | None = None) -> None:
        self.temperature = temperature
        self.rollouts: Counter[str] = Counter(logged=0, assembled=0, spans_incomplete=0, undecodable=0)
        self.rows_per_rollout: Counter[int] = Counter()
        self.counts: Counter[str] = Counter()
        self.untrained: Counter[str] = Counter(dict.fromkeys(UNTRAINED_REASONS, 0))
        self.mismatches: Counter[str] = Counter()
        self.unmodeled: Counter[str] = Counter()
        self.groups: Counter[str] = Counter(total=0, trained=0, zero_variance=0, too_small=0)
        self.dropped: Counter[str] = Counter()
        self.advantages: list[float] = []

    def add_report(self, rows: int, report: BuildReport) -> None:
        """One assembled rollout's rows and `build_rows` report."""
        self.rows_per_rollout[rows] += 1
        self.counts.update(
            sampled=report.sampled_tokens, trained=report.trained_tokens, truncated=report.truncated_rows,
            skipped=report.skipped_spans, prompt_too_long=report.prompt_too_long,
        )  # fmt: skip
        self.untrained.update({reason: getattr(report, f"{reason}_tokens") for reason in UNTRAINED_REASONS})
        self.mismatches.update(report.mismatches)
        self.unmodeled.update(report.unmodeled_sampling)

    def add_outcome(self, outcome: GroupOutcome) -> None:
        """One group's membership and advantages."""
        self.groups.update(
            total=1, trained=outcome.groups_trained, zero_variance=outcome.groups_zero_variance,
            too_small=outcome.groups_too_small,
        )  # fmt: skip
        self.dropped.update(outcome.dropped)
        self.advantages.extend(item.advantage for item in outcome.scored)
        self.counts["trained_in_scored"] += sum(item.assembled.trained_tokens for item in outcome.scored)

    def report(self, run: str, policy: ReplayPolicy) -> ReplayReport:
        """The report of everything tallied."""
        return ReplayReport(
            run=run, policy=policy, temperature_used=self.temperature, rollouts=dict(self.rollouts),
            rows=self._rows(), mismatches=dict(self.mismatches), tokens=self._tokens(),
            calls={"skipped": self.counts["skipped"], "prompt_too_long": self.counts["prompt_too_long"]},
            groups=GroupStats(**self.groups, dropped=dict(self.dropped)), advantages=spread(self.advantages),
        )  # fmt: skip

    def _rows(self) -> RowStats:
        per_rollout = self.rows_per_rollout
        with_rows = sum(n for count, n in per_rollout.items() if count)
        built = sum(count * n for count, n in per_rollout.items())
        return RowStats(
            built=built, per_rollout={str(count): per_rollout[count] for count in sorted(per_rollout)},
            mean_per_rollout=_ratio(built, with_rows), single_row_rate=_ratio(per_rollout[1], with_rows),
            truncated=self.counts["truncated"],
        )  # fmt: skip

    def _tokens(self) -> TokenStats:
        counts, untrained = self.counts, dict(self.untrained)
        sampled, total = counts["sampled"], sum(untrained.values())
        return TokenStats(
            sampled=sampled, trained=counts["trained"], trained_in_scored=counts["trained_in_scored"],
            untrained=total, masked_share=_ratio(total, sampled), untrained_by_reason=untrained,
            masked_share_by_reason={reason: _ratio(n, sampled) for reason, n in untrained.items()},
            unmodeled_sampling=dict(self.unmodeled),
        )  # fmt: skip


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def spread(values: Sequence[float]) -> Spread:
    """How a list of advantages is spread."""
    if not values:
        return Spread()
    return Spread(
        count=len(values), min=min(values), max=max(values), mean=statistics.fmean(values),
        std=statistics.pstdev(values), mean_abs=statistics.fmean(abs(value) for value in values),
    )  # fmt: skip


class Replayer:
    """Replays one run's log under a policy into a `Tally`."""

    def __init__(self, bus: Bus, policy: ReplayPolicy) -> None:
        self.bus = bus
        self.policy = policy
        self.tally = Tally(policy.temperature)

    async def run(self, run: str) -> Tally:
        """Read the run's rollouts, then replay their groups in the order they first appear."""
        from harnessrl.trainer.advantages import score_groups

        for members in (await self.rollouts(run)).values():
            assembled = [item for rollout in members if (item := await self.assemble(rollout)) is not None]
            self.tally.add_outcome(score_groups(assembled, self.policy.advantages))
        return self.tally

    async def rollouts(self, run: str) -> dict[str, list[RolloutComplete]]:
        """The run's rollouts by group (the last message of each episode)."""
        latest: dict[str, RolloutComplete] = {}
        for delivery in await self.bus.replay(subjects.ROLLOUTS.name, subjects.rollout(run)):
            try:
                rollout = delivery.decode(RolloutComplete)
            except ContractError:
                self.tally.rollouts["undecodable_messages"] += 1
                continue
            latest[rollout.episode] = rollout
        groups: dict[str, list[RolloutComplete]] = defaultdict(list)
        for rollout in latest.values():
            groups[rollout.group].append(rollout)
        self.tally.rollouts["logged"] = len(latest)
        return groups

    async def assemble(self, rollout: RolloutComplete) -> AssembledRollout | None:
        """A rollout with the rows the policy builds from its spans; None when spans are missing."""
        from harnessrl.trainer.advantages import AssembledRollout
        from harnessrl.trainer.assembly import spans_complete
        from harnessrl.trainer.samples import build_rows
        from harnessrl.trainer.sampling import run_temperature

        stored = await self.bus.replay(subjects.SPANS.name, subjects.span(rollout.run, rollout.episode))
        try:
            spans = by_seq([delivery.decode(Span) for delivery in stored])
        except ContractError:
            self.tally.rollouts["undecodable"] += 1
            return AssembledRollout(rollout=rollout, rows=[], unusable="undecodable")
        if not spans_complete(rollout, spans):
            self.tally.rollouts["spans_incomplete"] += 1
            return None
        if self.tally.temperature is None:
            self.tally.temperature = run_temperature(spans)
        rows, report = build_rows(
            rollout.episode, spans, self.policy.limits, temperature=self.tally.temperature
        )
        self.tally.rollouts["assembled"] += 1
        self.tally.add_report(len(rows), report)
        return AssembledRollout(rollout=rollout, rows=rows)


def by_seq(spans: Sequence[Span]) -> list[Span]:
    """One span per seq (the first stored), in seq order."""
    by_seq: dict[int, Span] = {}
    for span in spans:
        by_seq.setdefault(span.seq, span)
    return [by_seq[seq] for seq in sorted(by_seq)]


# --- output ------------------------------------------------------------------------------------------


def render(report: ReplayReport) -> Table:
    """The report for a person."""
    limits, rows, tokens, groups = report.policy.limits, report.rows, report.tokens, report.groups
    table = Table(
        title=f"replay of run {report.run}: max_seq_len {limits.max_seq_len}, max_prompt_len "
        f"{limits.max_prompt_len}, dead ends {'trained' if limits.train_dead_ends else 'untrained'}, "
        f"temperature {report.temperature_used or 'per rollout'}, {report.policy.advantages.estimator}",
        show_header=False, title_justify="left",
    )  # fmt: skip
    masked = [
        f"{reason} {n} ({tokens.masked_share_by_reason[reason]:.1%})"
        for reason, n in tokens.untrained_by_reason.items() if n
    ]  # fmt: skip
    per_rollout = ", ".join(f"{n} of {count}" for count, n in rows.per_rollout.items())
    for name, value in (
        ("rollouts", ", ".join(f"{what} {n}" for what, n in report.rollouts.items())),
        ("rows", f"{rows.built} ({rows.mean_per_rollout:.2f} per rollout; rollouts of N: {per_rollout})"),
        ("single-row rate", f"{rows.single_row_rate:.1%}"),
        ("truncated rows", str(rows.truncated)),
        ("break classes", _counts(report.mismatches)),
        ("sampled tokens", f"{tokens.sampled}, trained {tokens.trained} "
                           f"({tokens.trained_in_scored} in groups that train)"),
        ("masked share", f"{tokens.masked_share:.1%}" + (f": {', '.join(masked)}" if masked else "")),
        ("unmodeled sampling", _counts(tokens.unmodeled_sampling)),
        ("calls starting no row", ", ".join(f"{what} {n}" for what, n in report.calls.items())),
        ("groups", f"{groups.total}: trained {groups.trained}, zero variance {groups.zero_variance}, "
                   f"too small {groups.too_small}"),
        ("left out", _counts(groups.dropped)),
        ("advantages", _spread_text(report.advantages)),
    ):  # fmt: skip
        table.add_row(name, value)
    return table


def _counts(counts: dict[str, int]) -> str:
    return counts_text(counts) if counts else "-"


def _spread_text(values: Spread) -> str:
    if not values.count:
        return "-"
    return (
        f"{values.count} rollouts: min {values.min:.3f}, max {values.max:.3f}, mean {values.mean:.3f}, "
        f"std {values.std:.3f}, mean |a| {values.mean_abs:.3f}"
    )


# --- the command -------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `harnessrl replay` to the `harnessrl` parser."""
    limits = SampleLimits()
    replay = subparsers.add_parser(
        "replay", help="rebuild a run's training rows from the log under a policy; print what would train"
    )
    replay.add_argument("--run", type=subject_token, required=True, help="the run whose log to replay")
    replay.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help=f"no row grows past N tokens (default {limits.max_seq_len})",
    )
    replay.add_argument(
        "--max-prompt-len",
        type=int,
        default=None,
        metavar="N",
        help=f"a call with a longer prompt starts no row (default {limits.max_prompt_len}, or "
        "--max-seq-len minus 1 when that is shorter)",
    )
    replay.add_argument("--train-dead-ends", action="store_true", help="train completions a retry threw away")
    replay.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="the sampling temperature the loss models "
        "(default: the run's, from the first rollout that shows one)",
    )
    replay.add_argument(
        "--estimator",
        choices=get_args(Estimator),
        default=AdvantageSettings().estimator,
        help="how advantages are computed within a group (default %(default)s)",
    )
    replay.add_argument("--json", action="store_true", help="print the report as one JSON object")
    nats_url_option(replay)
    replay.set_defaults(func=cmd_replay)  # fmt: skip


def policy_of(args: argparse.Namespace) -> ReplayPolicy:
    """The policy the flags ask for; invalid limits raise `SettingsError`."""
    default = SampleLimits()
    max_seq_len = args.max_seq_len or default.max_seq_len
    max_prompt_len = args.max_prompt_len or min(default.max_prompt_len, max_seq_len - 1)
    limits = SampleLimits(
        max_seq_len=max_seq_len, max_prompt_len=max_prompt_len, train_dead_ends=args.train_dead_ends
    )
    return ReplayPolicy(
        limits=limits, advantages=AdvantageSettings(estimator=args.estimator), temperature=args.temperature
    )


async def replay_log(url: str, run: str, policy: ReplayPolicy) -> Tally:
    """Replay a run's log from the bus at `url`."""
    await probe_nats(url, timeout_s=3.0)
    bus = NatsBus(url, name="harnessrl-replay")
    await bus.connect()
    try:
        return await Replayer(bus, policy).run(run)
    finally:
        await bus.close()


def cmd_replay(args: argparse.Namespace) -> int:
    """Print what the trainer would train on the run's log under the policy the flags set."""
    try:
        policy = policy_of(args)
        tally = asyncio.run(replay_log(args.nats_url, args.run, policy))
    except SettingsError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except (BusError, NatsUnreachable) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    if not tally.rollouts["logged"]:
        sys.stderr.write(f"error: no rollout of run {args.run} is stored\n")
        return 1
    report = tally.report(args.run, policy)
    if args.json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        Console().print(render(report))
    return 0

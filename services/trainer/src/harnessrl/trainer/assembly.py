"""Rollout assembly: a rollout becomes trainable once all of its spans are in.

A `RolloutComplete` names how many spans the episode produced and the last seq. The spans arrive on
their own stream and may lag; `RolloutPool.offer` is called with whatever spans are stored so far
and keeps the rollout pending until the count and last seq match, then builds its rows. A rollout
still incomplete `span_wait_s` after it was first seen is dropped (`spans_incomplete`), never
trained half. Complete rollouts wait in their group until the group is whole (every attempt in,
infra failures aside, since those are retried as new attempts) or `group_wait_s` passed.

Rows model one sampling temperature per run: the configured one (`engine.temperature`), else the
run's own, learned once from the first rollout assembled here that shows one (`run_temperature`:
its first ok call with tokens not sampled greedily). The gateway applies the run's sampling to
every call, so that is the temperature of all of them; calls sampled otherwise are not trained.
A restarted trainer learns it again the same way.

Each rollout's report is labelled with its harness and model (`metrics.LabelledReport`), so the
step metrics show break classes per harness and model: the model is the one its spans name, the
harness the one their User-Agent names (`contracts.harness_of`), else `unknown`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec

from harnessrl.shared.contracts import RolloutComplete, Span, harness_of
from harnessrl.trainer.advantages import AssembledRollout
from harnessrl.trainer.metrics import UNKNOWN, LabelledReport
from harnessrl.trainer.samples import BuildReport, build_rows
from harnessrl.trainer.sampling import run_temperature
from harnessrl.trainer.settings import PoolSettings, SampleLimits


class _Pending(msgspec.Struct, kw_only=True):
    rollout: RolloutComplete
    first_seen: float


class _Group(msgspec.Struct, kw_only=True):
    first_seen: float
    members: dict[str, AssembledRollout] = msgspec.field(default_factory=dict)


def spans_complete(rollout: RolloutComplete, spans: Sequence[Span]) -> bool:
    """Whether `spans` hold exactly the episode's spans (count and last seq match)."""
    seqs = {span.seq for span in spans}
    if len(seqs) != rollout.span_count:
        return False
    return rollout.span_count == 0 or max(seqs) == rollout.last_seq


def _unique_spans(spans: Sequence[Span]) -> list[Span]:
    by_seq: dict[int, Span] = {}
    for span in spans:
        by_seq.setdefault(span.seq, span)
    return [by_seq[seq] for seq in sorted(by_seq)]


def labelled(report: BuildReport, spans: Sequence[Span]) -> LabelledReport:
    """`report` with its spans' harness and model labels and their count of ok calls with tokens."""
    harness = next((name for span in spans if (name := harness_of(span.client))), UNKNOWN)
    calls = sum(
        span.status == "ok" and bool(span.completions and span.completions[0].token_ids) for span in spans
    )
    return LabelledReport(
        **msgspec.structs.asdict(report),
        harness=harness,
        model=next((span.model for span in spans if span.model), UNKNOWN),
        calls=calls,
    )


class RolloutPool:
    """Pending (spans incomplete) and assembled rollouts, grouped for batching."""

    def __init__(
        self, settings: PoolSettings, limits: SampleLimits, temperature: float | None = None
    ) -> None:
        self.settings = settings
        self.limits = limits
        # The temperature rows model: configured, else learned from the first rollout showing one.
        self.temperature = temperature
        self._pending: dict[str, _Pending] = {}
        self._groups: dict[str, _Group] = {}
        self._in_pool: set[str] = set()
        self.dropped: Counter[str] = Counter()
        self.reports: dict[str, BuildReport] = {}

    def knows(self, rollout_id: str) -> bool:
        """Whether the rollout is pending or assembled here."""
        return rollout_id in self._in_pool

    def is_pending(self, rollout_id: str) -> bool:
        """Whether the rollout still waits for spans."""
        return rollout_id in self._pending

    def offer(self, rollout: RolloutComplete, spans: Sequence[Span], now: float) -> str:
        """Add or re-check a rollout; returns "assembled", "pending" or "dropped"."""
        key = rollout.episode
        pending = self._pending.get(key) or _Pending(rollout=rollout, first_seen=now)
        unique = _unique_spans(spans)
        if not spans_complete(rollout, unique):
            if now - pending.first_seen > self.settings.span_wait_s:
                self._pending.pop(key, None)
                self._in_pool.discard(key)
                self.dropped["spans_incomplete"] += 1
                return "dropped"
            self._pending[key] = pending
            self._in_pool.add(key)
            return "pending"
        self._pending.pop(key, None)
        rows, report = build_rows(key, unique, self.limits, temperature=self._temperature(unique))
        self.reports[key] = labelled(report, unique)
        versions = [span.weight_version_start for span in unique] or rollout.versions_seen or [0]
        # A gateway's stamp can lag a just-published version; the admission version can't.
        min_version = max(min(versions), rollout.admitted_version)
        self._join(AssembledRollout(rollout=rollout, rows=rows, min_version=min_version), now)
        return "assembled"

    def add_undecodable(self, rollout: RolloutComplete, now: float) -> None:
        """Make a rollout whose spans can't be decoded a member that can't train (`undecodable`).

        Its group then doesn't wait for it; the group rules drop it with that reason.
        """
        self._pending.pop(rollout.episode, None)
        min_version = max(min(rollout.versions_seen or [0]), rollout.admitted_version)
        member = AssembledRollout(rollout=rollout, rows=[], min_version=min_version, unusable="undecodable")
        self._join(member, now)

    def _join(self, member: AssembledRollout, now: float) -> None:
        group = self._groups.setdefault(member.rollout.group, _Group(first_seen=now))
        group.members[member.rollout_id] = member
        self._in_pool.add(member.rollout_id)

    def _temperature(self, spans: Sequence[Span]) -> float | None:
        """The run's sampling temperature, learned from `spans` if not known yet (None: still unknown)."""
        if self.temperature is None:
            self.temperature = run_temperature(spans)
        return self.temperature

    def ready_groups(self, now: float) -> list[str]:
        """Groups that are whole or waited long enough, oldest first."""
        ready = []
        for name, group in sorted(self._groups.items(), key=lambda item: item[1].first_seen):
            members = list(group.members.values())
            expected = max(member.rollout.group_size for member in members)
            final = [m for m in members if m.rollout.failure != "infra"]
            if len(final) >= expected or now - group.first_seen > self.settings.group_wait_s:
                ready.append(name)
        return ready

    def take(self, groups: Sequence[str]) -> list[AssembledRollout]:
        """Remove `groups` from the pool and return their members."""
        taken: list[AssembledRollout] = []
        for name in groups:
            group = self._groups.pop(name)
            taken.extend(group.members.values())
        for item in taken:
            self._in_pool.discard(item.rollout_id)
        return taken

    def expire(self, now: float) -> list[str]:
        """Drop pending rollouts past `span_wait_s` (their redelivery may never come)."""
        expired = [
            key
            for key, pending in self._pending.items()
            if now - pending.first_seen > self.settings.span_wait_s
        ]
        for key in expired:
            self._pending.pop(key)
            self._in_pool.discard(key)
            self.dropped["spans_incomplete"] += 1
        return expired

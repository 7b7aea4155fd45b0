"""Weight sync to every vLLM replica: reload, verify by a logprob probe, only then label.

CPU path (run here): each replica reloads the step's HF safetensors (`VllmReplica.reload_from`,
which needs the project's vLLM plugin so CPU linears pick the new weights up), scores a fixed token
sequence, and is labelled with the new weight version only if that probe passed (`judge_probe`):
an HTTP 200 from a reload proves nothing. GPU path: `nccl_sync.NcclReplicaSync`, vLLM's native
NCCL weight transfer behind the same interface and the same probe rule.

Passing the probe, for version v:

1. every probe logprob is within `tolerance` of the trainer's for v;
2. from the second sync of a process on, the served logprobs are nearer (Euclidean distance over
   the probe positions) to the trainer's for v than to the trainer's for the version synced
   before. A replica left on the previous weights serves those within noise, so it fails even when
   one step moved the probe by less than the tolerance. The syncer remembers the previous
   version's values (`ProbeHistory`); a process's first sync has none, and only rule 1 applies.
   Rule 2 tells versions apart only when a step moves the probe by more than a replica's noise:
   on the CPU (float32) the noise is 1e-6 (measured 9.5e-7) and an ordinary step moves the probe
   by about 0.1. On GPUs (bf16) both must be measured before relying on it, and the tolerance
   set from that noise.

Outcome: the replicas that passed serve v. A replica that failed (probe, or an admin call that
errored) is not labelled v, is logged with its gap and is withdrawn from the gateways' rings
(`on_failed`, wired by the app to `UpstreamAnnouncer.withdraw`). One that passes while this syncer
can't count on it being in the ring (its first sync, or after withdrawing it) is announced again
(`on_restored`). If none passed, `WeightSyncError` is raised after the withdrawals.

Collocated mode freezes a replica (`pause("keep")`) across the reload, so no token mixes two
weight sets, and resumes it before the probe: a paused replica schedules nothing, the probe
included. Between that resume and the label the replica serves the new weights under the previous
label; the label is what `/weight_info` (and vLLM's per-token versions) report, while the gateway
stamps spans with versions from WEIGHTS, which the trainer publishes only after the sync. So no
stamp or label claims v before the probe passed; a failing replica serves unverified weights
until the gateways have applied its withdrawal.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

import aiohttp
import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import UpstreamRegistration
from harnessrl.shared.ids import new_id
from harnessrl.shared.log import get_logger
from harnessrl.trainer.errors import ReplicaError, WeightSyncError
from harnessrl.trainer.replica import VllmReplica
from harnessrl.trainer.samples import TrainingRow

log = get_logger(__name__)
TrainerProbe = Callable[[Sequence[int]], Awaitable[list[float]]]
# Told a replica's base URL and why it failed a sync.
FailureCallback = Callable[[str, str], Awaitable[None]]
# Told a replica's base URL when it passed and may be missing from the gateways' rings.
RestoreCallback = Callable[[str], Awaitable[None]]
# What one replica's admin calls raise when that replica (not the trainer) is at fault.
REPLICA_FAILURES: tuple[type[Exception], ...] = (ReplicaError, aiohttp.ClientError, TimeoutError)


class SyncResult(msgspec.Struct, frozen=True, kw_only=True):
    """One sync: the worst probe gap among the replicas that passed, and those that failed."""

    gap: float = 0.0
    failed: tuple[str, ...] = ()


class WeightSyncer(Protocol):
    """What the service needs from a weight-sync back-end (disk reload or NCCL)."""

    async def sync(self, hf_dir: Path, version: int, trainer_probe: TrainerProbe) -> SyncResult:
        """Make the replicas serve `version`; raise `WeightSyncError` if none does."""

    async def close(self) -> None:
        """Release clients and connections."""


class ProbeReference(msgspec.Struct, frozen=True, kw_only=True):
    """What probes are judged against: the trainer's logprobs for `version` and, if known, before."""

    version: int
    expected: list[float]
    previous_version: int | None = None
    previous: list[float] | None = None


class ProbeHistory:
    """The trainer's probe logprobs of the version being synced and of the one synced before it."""

    def __init__(self) -> None:
        self._current: tuple[int, list[float]] | None = None
        self._previous: tuple[int, list[float]] | None = None

    def reference(self, version: int, expected: list[float]) -> ProbeReference:
        """Record `expected` as `version`'s; a repeated sync of one version keeps the one before."""
        if self._current is not None and self._current[0] != version:
            self._previous = self._current
        self._current = (version, list(expected))
        if self._previous is None:
            return ProbeReference(version=version, expected=list(expected))
        before, values = self._previous
        return ProbeReference(
            version=version, expected=list(expected), previous_version=before, previous=values
        )


class ProbeVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """Whether a probe passed; `gap` is its largest difference from the expected logprobs."""

    passed: bool
    gap: float
    reason: str = ""


def probe_row(token_ids: Sequence[int]) -> TrainingRow:
    """The probe sequence as a row whose logprobs the trainer reads (every token after the first)."""
    count = len(token_ids) - 1
    return TrainingRow(
        rollout_id="probe", input_ids=list(token_ids), prompt_len=1,
        loss_mask=[1] * count, logprobs=[0.0] * count, versions=[0] * count,
    )  # fmt: skip


def judge_probe(served: Sequence[float], reference: ProbeReference, tolerance: float) -> ProbeVerdict:
    """Apply the probe rule (module docstring) to the logprobs a replica served."""
    gap = _max_gap(served, reference.expected)
    if gap > tolerance:
        reason = (
            f"logprobs differ from the trainer's for version {reference.version} by {gap:.3g}"
            f" (tolerance {tolerance:.3g})"
        )
        return ProbeVerdict(passed=False, gap=gap, reason=reason)
    if reference.previous is None or reference.previous == reference.expected:
        return ProbeVerdict(passed=True, gap=gap)
    to_new = _distance(served, reference.expected)
    to_previous = _distance(served, reference.previous)
    if to_new < to_previous:
        return ProbeVerdict(passed=True, gap=gap)
    reason = (
        f"logprobs are nearer to version {reference.previous_version}'s (distance {to_previous:.3g})"
        f" than to version {reference.version}'s ({to_new:.3g}): the previous weights are still served"
    )
    return ProbeVerdict(passed=False, gap=gap, reason=reason)


class ReplicaOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """How one replica's sync ended; `gap` is None when it failed before its probe."""

    url: str
    passed: bool
    gap: float | None = None
    reason: str = ""


def failed_outcome(replica: VllmReplica, exc: BaseException) -> ReplicaOutcome:
    """The outcome of a replica whose admin call raised `exc`."""
    return ReplicaOutcome(url=replica.base_url, passed=False, reason=f"{type(exc).__name__}: {exc}")


async def check_and_label(
    replica: VllmReplica, probe_ids: Sequence[int], reference: ProbeReference, tolerance: float
) -> ReplicaOutcome:
    """Probe `replica` (it must be scheduling) and label it `reference.version` only if it passed."""
    probe = await replica.probe_logprobs(probe_ids)
    verdict = judge_probe(probe.prompt, reference, tolerance)
    if verdict.passed:
        await replica.set_weight_version(reference.version)
    return ReplicaOutcome(url=replica.base_url, passed=verdict.passed, gap=verdict.gap, reason=verdict.reason)


class RingMembership:
    """Turns a sync's outcomes into withdrawals and returns, and into its result or error."""

    def __init__(
        self, on_failed: FailureCallback | None = None, on_restored: RestoreCallback | None = None
    ) -> None:
        self.on_failed = on_failed
        self.on_restored = on_restored
        # Replicas this syncer has seen pass and not fail since: the ones it knows are routed to.
        self._in_ring: set[str] = set()

    async def settle(self, outcomes: Sequence[ReplicaOutcome], version: int) -> SyncResult:
        """`record` the outcomes; the sync's result, or `WeightSyncError` if no replica passed."""
        await self.record(outcomes, version)
        gaps = [outcome.gap for outcome in outcomes if outcome.passed and outcome.gap is not None]
        if not gaps:
            reasons = "; ".join(f"{outcome.url}: {outcome.reason}" for outcome in outcomes)
            raise WeightSyncError(f"no replica took version {version}: {reasons}")
        return SyncResult(gap=max(gaps), failed=tuple(o.url for o in outcomes if not o.passed))

    async def record(self, outcomes: Sequence[ReplicaOutcome], version: int) -> None:
        """Log every outcome, withdraw the replicas that failed and restore those that passed."""
        for outcome in outcomes:
            await (self._passed(outcome, version) if outcome.passed else self._failed(outcome, version))

    async def _passed(self, outcome: ReplicaOutcome, version: int) -> None:
        log.info("weights.synced", replica=outcome.url, version=version, probe_gap=outcome.gap)
        if outcome.url not in self._in_ring and self.on_restored is not None:
            await self.on_restored(outcome.url)
        self._in_ring.add(outcome.url)

    async def _failed(self, outcome: ReplicaOutcome, version: int) -> None:
        log.warning(
            "weights.sync_failed", replica=outcome.url, version=version, probe_gap=outcome.gap,
            reason=outcome.reason,
        )  # fmt: skip
        self._in_ring.discard(outcome.url)
        if self.on_failed is not None:
            await self.on_failed(outcome.url, outcome.reason)


class UpstreamAnnouncer:
    """Withdraws replicas from the gateways' rings, and brings them back, over the bus.

    Registrations carry no weight version: a gateway keeps the highest one a replica ever
    registered and stamps it on every run's spans, while runs' versions come from WEIGHTS.
    """

    def __init__(self, bus: Bus, model: str) -> None:
        self.bus = bus
        self.model = model

    async def withdraw(self, replica_url: str, reason: str) -> None:
        """Ask every gateway to stop routing to `replica_url`."""
        await self._publish(UpstreamRegistration(url=replica_url, model=self.model, active=False))
        log.warning("upstream.withdrawal_sent", replica=replica_url, reason=reason)

    async def restore(self, replica_url: str) -> None:
        """Ask every gateway to route to `replica_url` (a no-op where it already does)."""
        await self._publish(UpstreamRegistration(url=replica_url, model=self.model))
        log.info("upstream.registration_sent", replica=replica_url)

    async def _publish(self, message: UpstreamRegistration) -> None:
        await self.bus.publish(subjects.upstreams(), message, msg_id=new_id("upstream"))


class ReplicaSync:
    """Fans a checkpoint out to every replica: reload, probe, label the ones that passed."""

    def __init__(
        self,
        replicas: Sequence[VllmReplica],
        probe_ids: Sequence[int],
        *,
        tolerance: float = 1e-3,
        collocated: bool = False,
        on_failed: FailureCallback | None = None,
        on_restored: RestoreCallback | None = None,
    ) -> None:
        self.replicas = list(replicas)
        self.probe_ids = list(probe_ids)
        self.tolerance = tolerance
        self.collocated = collocated
        self.history = ProbeHistory()
        self.membership = RingMembership(on_failed, on_restored)

    async def close(self) -> None:
        """Close every replica client."""
        for replica in self.replicas:
            await replica.close()

    async def sync(self, hf_dir: Path, version: int, trainer_probe: TrainerProbe) -> SyncResult:
        """Reload `hf_dir` everywhere and label `version` where the probe passed."""
        if not self.replicas:
            return SyncResult()
        reference = self.history.reference(version, await trainer_probe(self.probe_ids))
        outcomes = await asyncio.gather(*(self._sync_one(r, hf_dir, reference) for r in self.replicas))
        return await self.membership.settle(outcomes, version)

    async def _sync_one(
        self, replica: VllmReplica, hf_dir: Path, reference: ProbeReference
    ) -> ReplicaOutcome:
        try:
            if self.collocated:
                await replica.reload_frozen(hf_dir)
            else:
                await replica.reload_from(hf_dir)
            return await check_and_label(replica, self.probe_ids, reference, self.tolerance)
        except REPLICA_FAILURES as exc:
            return failed_outcome(replica, exc)


def _max_gap(served: Sequence[float], expected: Sequence[float]) -> float:
    return max(abs(a - b) for a, b in zip(served, expected, strict=True))


def _distance(served: Sequence[float], expected: Sequence[float]) -> float:
    return math.sqrt(sum((a - b) ** 2 for a, b in zip(served, expected, strict=True)))

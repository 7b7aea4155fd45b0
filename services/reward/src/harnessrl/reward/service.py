"""The reward service: agent_exited events in, scored or failed events out.

Workers share one durable consumer (queue-group semantics), so each event is graded by one worker
and more workers grade more in parallel. Every result is kept in a KV bucket keyed by episode
before it is published; a redelivered event republishes that stored result with the same msg id
instead of grading again.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import Counter
from typing import Any

import msgspec

from harnessrl.reward.errors import ArtifactUnavailableError, BusUnavailableError, UnknownGraderError
from harnessrl.reward.graders.base import Grade, GradingContext
from harnessrl.reward.grading import build_grader, grading_context
from harnessrl.reward.metrics import RewardMetrics
from harnessrl.reward.settings import RewardSettings
from harnessrl.reward.swe.sandbox import SandboxUnavailableError, missing_isolation
from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, BusError, ConsumerSpec, Delivery, KeyValue, Subscription, stop_all
from harnessrl.shared.contracts import (
    AgentExited,
    ArtifactRef,
    EpisodeEvent,
    EpisodeFailed,
    EpisodeScored,
    TaskSpec,
    decode_event,
    encode,
)
from harnessrl.shared.log import get_logger

_log = get_logger(__name__)


class StoredResult(msgspec.Struct, frozen=True, kw_only=True):
    """What the results bucket keeps per episode: the exact event published."""

    subject: str
    msg_id: str
    event: bytes


def result_key(run: str, episode: str) -> str:
    """KV key of an episode's result (KV keys allow fewer characters than subject tokens)."""
    return "ep-" + hashlib.sha256(f"{run}/{episode}".encode()).hexdigest()[:40]


def grader_name(task: TaskSpec) -> str:
    """The grader a task asks for; SWE tasks default to the SWE-bench grader."""
    if task.kind == "swe" and task.grader in ("", "exact"):
        return "swebench"
    return task.grader


class RewardService:
    """Consumes agent_exited, grades, publishes scored/failed, idempotently."""

    def __init__(self, bus: Bus, settings: RewardSettings) -> None:
        self.bus = bus
        self.settings = settings
        self.context: GradingContext = grading_context(settings)
        self.graded = 0
        self.republished = 0
        # Verdicts refused instead of published as a reward, by reason (e.g. a NaN reward).
        self.refused: Counter[str] = Counter()
        self.metrics = RewardMetrics(self.refused)
        self._results: KeyValue | None = None
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        """Open the results bucket and start `concurrency` fetch loops on the shared durable."""
        self._results = await self.bus.kv(subjects.BucketSpec(name=self.settings.results_bucket))
        spec = ConsumerSpec(
            stream=subjects.EPISODES.name,
            filter_subject=f"{subjects.PREFIX}.episode.{self.settings.runs}.*.agent_exited",
            durable=self.settings.durable,
            # Short: a grading still running says so (the bus's in-progress acks), so this only
            # bounds how soon an event whose worker died, or whose delivery was lost, is graded again.
            ack_wait_s=self.settings.ack_wait_s,
            max_deliver=5,
            batch=1,
        )
        for _ in range(self.settings.concurrency):
            self._subscriptions.append(await self.bus.subscribe(spec, self.handle))
        if self.context.sandbox == "local" and (
            missing := missing_isolation(self.context.limits, self.context.python)
        ):
            # Patches will be refused (infra), not graded in a weaker sandbox; say so once, at start.
            _log.error("sandbox.unavailable", missing=missing)
        _log.info("reward.started", durable=self.settings.durable, workers=self.settings.concurrency)

    async def stop(self) -> None:
        """Stop consuming (an unfinished grading is redelivered later)."""
        await stop_all(self._subscriptions)
        self._subscriptions.clear()

    async def handle(self, delivery: Delivery) -> None:
        """Grade one agent_exited event (or republish its stored result)."""
        event = delivery.decode(AgentExited)
        assert self._results is not None, "start() first"  # noqa: S101 - programming error
        key = result_key(event.run, event.episode)
        stored = await self._results.get(key)
        if stored is not None:
            await self._publish(msgspec.msgpack.decode(stored.value, type=StoredResult))
            self.republished += 1
            self.metrics.republished.inc()
            return
        with self.metrics.grading():
            result = await self._grade_event(event)
        await self._results.put(key, msgspec.msgpack.encode(result))
        await self._publish(result)
        self.graded += 1
        self.metrics.published(result.subject)

    async def _publish(self, result: StoredResult) -> None:
        try:
            await self.bus.publish(result.subject, decode_event(result.event), msg_id=result.msg_id)
        except BusError as exc:
            raise BusUnavailableError(f"publish failed: {exc}") from exc

    async def _grade_event(self, event: AgentExited) -> StoredResult:
        log = _log.bind(run=event.run, episode=event.episode, task=event.task)
        if event.task_spec is None:
            return _failed(event, "reward-error", "agent_exited carries no task_spec")
        try:
            artifact = await self._artifact(event.artifact)
        except ArtifactUnavailableError as exc:
            return _failed(event, "infra", str(exc))
        grade = await self._run_grader(event.task_spec, artifact, log)
        log.info("episode.graded", outcome=grade.outcome, reward=grade.reward, resolved=grade.resolved)
        self.metrics.gradings.labels(grade.outcome).inc()
        if grade.scored and not math.isfinite(grade.reward):
            # A NaN or infinite reward would poison its group's baseline: the episode fails instead.
            self.refused["non_finite_reward"] += 1
            log.warning("reward.refused", reason="non_finite_reward", reward=str(grade.reward))
            return _failed(event, "reward-error", f"grader returned a non-finite reward ({grade.reward})")
        if grade.scored:
            return _scored(event, grade)
        cause = "infra" if grade.outcome == "infra-error" else "reward-error"
        return _failed(event, cause, f"{grade.outcome}: {grade.details.get('reason', '')}")

    async def _run_grader(self, task: TaskSpec, artifact: bytes, log: Any) -> Grade:
        try:
            grader = build_grader(grader_name(task), self.context)
            return await asyncio.wait_for(grader.grade(task, artifact), timeout=self.settings.grade_timeout_s)
        except TimeoutError:
            reason = f"grading ran past {self.settings.grade_timeout_s}s"
            return Grade(reward=0.0, outcome="timeout", details={"reason": reason})
        except UnknownGraderError as exc:
            return _grader_error(str(exc))
        except SandboxUnavailableError as exc:
            log.error("sandbox.refused", error=str(exc))
            return Grade(reward=0.0, outcome="infra-error", details={"reason": str(exc)})
        except Exception as exc:
            log.exception("grader.crashed")
            return _grader_error(f"grader raised {type(exc).__name__}: {exc}")

    async def _artifact(self, ref: ArtifactRef | None) -> bytes:
        if ref is None:
            return b""
        if ref.inline is not None:
            data = ref.inline
        elif ref.object_name:
            data = await self._fetch_object(ref.object_name)
        else:
            return b""
        if ref.sha256 and hashlib.sha256(data).hexdigest() != ref.sha256:
            raise ArtifactUnavailableError("artifact does not match its sha256")
        return data

    async def _fetch_object(self, name: str) -> bytes:
        try:
            return await self.bus.get_object(subjects.ARTIFACTS_BUCKET, name)
        except KeyError as exc:
            raise ArtifactUnavailableError(f"artifact {name!r} is not in the object store") from exc
        except BusError as exc:
            raise BusUnavailableError(f"object store unavailable: {exc}") from exc


def _grader_error(reason: str) -> Grade:
    return Grade(reward=0.0, outcome="grader-error", details={"reason": reason})


def _scored(event: AgentExited, grade: Grade) -> StoredResult:
    message = EpisodeScored(
        run=event.run,
        episode=event.episode,
        task=event.task,
        group=event.group,
        attempt=event.attempt,
        reward=grade.reward,
        resolved=grade.resolved,
        outcome=grade.outcome,
        details=grade.details,
    )
    return _stored(event, "scored", message)


def _failed(event: AgentExited, cause: Any, reason: str) -> StoredResult:
    message = EpisodeFailed(
        run=event.run,
        episode=event.episode,
        task=event.task,
        group=event.group,
        attempt=event.attempt,
        cause=cause,
        reason=reason[:2000],
    )
    return _stored(event, "failed", message)


def _stored(event: AgentExited, kind: str, message: EpisodeEvent) -> StoredResult:
    return StoredResult(
        subject=subjects.episode_event(event.run, event.episode, kind),
        msg_id=f"{event.episode}:{kind}",
        event=encode(message),
    )

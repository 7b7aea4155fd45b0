"""The episode state machine: one record per attempt, persisted before its events are published.

Every change goes through `commit`: write the record (unpublished) with the revision last seen,
publish the messages its phase implies (deduplicated by business key), then mark it published. A
controller killed anywhere in between republishes on restart (`republish`), so each event, and the
single terminal event of each episode, reaches the bus exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from harnessrl.controller.artifacts import read_artifact, summarize_spans
from harnessrl.controller.errors import ControllerError
from harnessrl.controller.launchers import ExitStatus
from harnessrl.controller.outbox import outbox
from harnessrl.controller.records import EpisodeRecord, episode_id
from harnessrl.controller.store import EpisodeStore
from harnessrl.shared.bus import Bus, TransientError
from harnessrl.shared.contracts import EpisodeFailed, EpisodeScored, FailureCause, Sampling, TaskSpec, now
from harnessrl.shared.log import get_logger

Relaunch = Callable[[EpisodeRecord], None]

# How soon a reward event that overtook the episode's exit is tried again.
_NOT_EXITED_RETRY_S = 0.5


class EpisodeNotExitedError(ControllerError, TransientError):
    """A reward event arrived before the controller saw the harness exit: redeliver it shortly."""

    def __init__(self, episode: str, *, delay: float = _NOT_EXITED_RETRY_S) -> None:
        super().__init__(f"episode {episode} not exited yet", delay=delay)


class RunEpisodes:
    """One run's episode records in memory, each change committed to KV and the bus."""

    def __init__(
        self,
        bus: Bus,
        store: EpisodeStore,
        tasks: dict[str, TaskSpec],
        *,
        launcher_kind: str,
        infra_retries: int,
        sampling: Sampling | None = None,
        token_in: bool | None = None,
    ) -> None:
        self._bus, self._store, self.tasks = bus, store, tasks
        self._launcher_kind, self._infra_retries = launcher_kind, infra_retries
        self._sampling, self._token_in = sampling or {}, token_in
        self.records: dict[str, EpisodeRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.on_retry: Relaunch | None = None
        # False once the run is stopped: infra failures then end for good instead of relaunching.
        self.retrying = True
        self.on_change: Callable[[], None] = lambda: None
        self._log = get_logger(__name__)

    def lock(self, episode: str) -> asyncio.Lock:
        """The lock that serialises every change of one episode."""
        return self._locks.setdefault(episode, asyncio.Lock())

    def task_of(self, record: EpisodeRecord) -> TaskSpec | None:
        """The task an episode works on (None for an ad-hoc BYO task)."""
        return self.tasks.get(record.task)

    async def load(self, records: list[EpisodeRecord]) -> None:
        """Adopt records read from KV after a restart: claim the unfinished ones, republish the unpublished.

        Claiming (`EpisodeStore.claim_episode`) fences off the controller before this one: a write
        of its that is still on its way can no longer land on a record this controller acts on.
        """
        self.records = {record.episode: record for record in records}
        for record in records:
            if record.terminal and record.published:
                continue
            async with self.lock(record.episode):
                claimed = await self._store.claim_episode(record)
                self.records[claimed.episode] = claimed
                if not claimed.published:
                    await self._publish(claimed)

    async def add(self, record: EpisodeRecord) -> EpisodeRecord:
        """Create a new episode record (an existing one wins: the schedule was replayed)."""
        if not await self._store.create_episode(record):
            existing = await self._store.episode(record.run, record.episode) or record
            self.records[record.episode] = existing
            return existing
        self.records[record.episode] = record
        await self._publish(record)
        return record

    async def commit(self, record: EpisodeRecord) -> EpisodeRecord:
        """Persist a new state of an episode, then publish its messages."""
        record = msgspec.structs.replace(record, published=False)
        await self._store.save_episode(record)
        self.records[record.episode] = record
        await self._publish(record)
        self.on_change()
        return record

    async def _publish(self, record: EpisodeRecord) -> None:
        items = outbox(record, self.task_of(record), self._launcher_kind, self._sampling, self._token_in)
        self._store.ensure_active()
        if items:
            await self._bus.publish_batch(items)
        done = msgspec.structs.replace(record, published=True)
        await self._store.save_episode(done)
        self.records[record.episode] = done

    # --- transitions -------------------------------------------------------------------------

    async def started(self, episode: str, where: str) -> None:
        """The harness runs (caller holds the episode lock)."""
        record = self.records[episode]
        if record.can_move_to("started"):
            await self.commit(msgspec.structs.replace(record, phase="started", where=where))

    async def exited(self, episode: str, status: ExitStatus) -> None:
        """The launcher saw the harness end: grade it, fail it, or retry it."""
        async with self.lock(episode):
            record = self.records.get(episode)
            if record is None or record.phase not in ("scheduled", "started"):
                return
            if record.phase == "scheduled":
                await self.started(episode, record.where)
                record = self.records[episode]
            detail, logs = status.detail, status.logs
            if status.outcome == "exited" and status.exit_code == 0:
                await self._agent_exited(record, status)
            elif status.outcome == "exited":
                reason = f"harness exited with {status.exit_code}"
                await self.finish(record, "agent", reason, status.exit_code, detail=detail, logs=logs)
            elif status.outcome == "timeout":
                code = status.exit_code
                await self.finish(record, "timeout", status.reason, code, detail=detail, logs=logs)
            else:
                await self.infra_failure(record, status.reason, detail=detail, logs=logs)

    async def _agent_exited(self, record: EpisodeRecord, status: ExitStatus) -> None:
        task = self.task_of(record)
        kind = "patch" if task is not None and task.kind == "swe" else "answer"
        artifact = await read_artifact(self._bus, record.run, record.episode, kind)
        await self.commit(
            msgspec.structs.replace(record, phase="exited", exit_code=status.exit_code, artifact=artifact)
        )

    async def infra_failure(
        self, record: EpisodeRecord, reason: str, *, detail: str = "", logs: str = ""
    ) -> None:
        """Retry as a new attempt while the limit allows; otherwise fail for good (lock held)."""
        if record.byo or not self.retrying or record.attempt >= self._infra_retries:
            await self.finish(record, "infra", reason, detail=detail, logs=logs)
            return
        attempt = record.attempt + 1
        retry = msgspec.structs.replace(
            record,
            episode=episode_id(record.batch, record.slot, record.member, attempt),
            attempt=attempt,
            phase="scheduled",
            published=False,
            where="",
            created_at=now(),
        )
        retry = await self.add(retry)
        await self.finish(record, "infra", reason, retried_as=retry.episode, detail=detail, logs=logs)
        self._log.info("episode.retried", episode=record.episode, retry=retry.episode, reason=reason)
        if self.on_retry is not None:
            self.on_retry(retry)

    async def finish(
        self,
        record: EpisodeRecord,
        cause: FailureCause,
        reason: str,
        exit_code: int | None = None,
        *,
        retried_as: str | None = None,
        by_reward: bool = False,
        detail: str = "",
        logs: str = "",
    ) -> None:
        """Fail an episode (terminal), keeping its stderr tail and logs' place; the caller holds the lock."""
        spans = await summarize_spans(self._bus, record.run, record.episode)
        await self.commit(
            msgspec.structs.replace(
                record,
                phase="failed",
                cause=cause,
                reason=reason[:500],
                detail=detail,
                logs=logs,
                exit_code=exit_code if exit_code is not None else record.exit_code,
                retried_as=retried_as,
                terminal_by_reward=by_reward,
                span_count=spans.count,
                last_seq=spans.last_seq,
                versions_seen=spans.versions,
            )
        )

    async def scored(self, event: EpisodeScored) -> None:
        """The reward service graded the episode: complete it (`EpisodeNotExitedError` if too early)."""
        async with self.lock(event.episode):
            record = self.records.get(event.episode)
            if record is None or record.terminal:
                return
            if record.phase != "exited":
                raise EpisodeNotExitedError(event.episode)
            spans = await summarize_spans(self._bus, record.run, record.episode)
            details = {**event.details, "outcome": event.outcome}
            if event.resolved is not None:
                details["resolved"] = event.resolved
            await self.commit(
                msgspec.structs.replace(
                    record,
                    phase="completed",
                    reward=event.reward,
                    details=details,
                    span_count=spans.count,
                    last_seq=spans.last_seq,
                    versions_seen=spans.versions,
                )
            )

    async def reward_failed(self, event: EpisodeFailed) -> None:
        """The reward service could not grade the episode; its `failed` event is the terminal one."""
        if event.cause != "reward-error":
            return
        async with self.lock(event.episode):
            record = self.records.get(event.episode)
            if record is None or record.terminal:
                return
            if record.phase != "exited":
                raise EpisodeNotExitedError(event.episode)
            await self.finish(record, "reward-error", event.reason, by_reward=True)

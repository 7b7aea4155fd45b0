"""One run: admission, launching groups, reconciling after a restart, and the reward and weight feeds.

Admission: batch `b` (of `batch_tasks` groups of `group_size` attempts) may start once the trainer
has made at least `b` steps in sync mode, or at least `b - staleness` in async mode (counted by the
highest `WeightVersion.step`: a step that trained nothing announces itself with the previous
weights); within that, whole groups start together while the number of live harnesses stays under
`max_concurrent`. A run whose first groups all failed the same way is stopped (`fail_fast.py`).
A group whose member failed for good still completes: every member's rollout reaches the trainer
once, failures marked with their cause, and the trainer drops them (never as reward 0 for infra).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import msgspec

from harnessrl.controller.fail_fast import FailFast, stop_run
from harnessrl.controller.harness_env import episode_env, key_env
from harnessrl.controller.launchers import (
    ExitStatus,
    Launcher,
    LaunchError,
    LauncherUnavailableError,
    LaunchRequest,
)
from harnessrl.controller.lifecycle import RunEpisodes
from harnessrl.controller.records import LIVE_PHASES, EpisodeRecord, RunRecord, episode_id, group_id
from harnessrl.controller.settings import ControllerSettings
from harnessrl.controller.store import EpisodeStore
from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, ConsumerSpec, Delivery, Subscription, stop_all
from harnessrl.shared.contracts import EpisodeFailed, EpisodeScored, RunStopped, TaskSpec, WeightVersion
from harnessrl.shared.keys import sign_episode_key
from harnessrl.shared.log import get_logger

T = TypeVar("T")

_UNAVAILABLE_RETRY_S = 2.0
# Work that must land (an episode's end, a scheduling pass) is retried this far apart at first,
# doubling up to the second.
EXIT_RETRY_FIRST_S, EXIT_RETRY_MAX_S = 0.5, 10.0


class RunDriver:
    """Schedules, launches and follows the episodes of one run."""

    def __init__(
        self,
        bus: Bus,
        store: EpisodeStore,
        record: RunRecord,
        *,
        tasks: list[TaskSpec],
        launcher: Launcher,
        settings: ControllerSettings,
    ) -> None:
        self.spec, self._record = record.spec, record
        self._bus, self._store, self._launcher, self._settings = bus, store, launcher, settings
        self._train = [task for task in tasks if not task.heldout] or tasks
        self.episodes = RunEpisodes(
            bus,
            store,
            {task.task_id: task for task in tasks},
            launcher_kind=launcher.kind,
            infra_retries=self.spec.infra_retries,
            sampling=self.spec.sampling,
            token_in=self.spec.token_in,
        )
        self.episodes.on_retry = lambda retry: self.spawn(self.launch(retry))
        self._wake = asyncio.Event()
        self.episodes.on_change = self._wake.set
        # The newest weight version (stamped on episodes) and the trainer's highest step (admission).
        self.version = 0
        self.steps = 0
        self.done = asyncio.Event()
        self._fail_fast = FailFast(self.spec)
        self.stopped: RunStopped | None = None
        self.not_launched = 0
        self._next_group = 0
        self._subscriptions: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._log = get_logger(__name__, run=self.spec.run)

    @property
    def total_groups(self) -> int:
        """How many groups the run schedules over all its batches."""
        return self.spec.max_steps * self.spec.batch_tasks

    async def _until_done(self, event: str, work: Callable[[], Awaitable[T]], **context: str) -> T:
        """`work()`, tried again while it fails (a NATS node restarting) until it succeeds.

        For work that must not be lost and is safe to repeat; each failure is logged as `event`
        with the delay before the next try, instead of ending the task that needed it in silence.
        """
        delay = EXIT_RETRY_FIRST_S
        while True:
            try:
                return await work()
            except Exception as exc:  # noqa: BLE001 - whatever it was, the work must land
                self._log.warning(event, **context, error=repr(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, EXIT_RETRY_MAX_S)

    async def _exited_until_recorded(self, episode: str, status: ExitStatus) -> None:
        """`episodes.exited` until it lands: an episode's end is never lost.

        Repeats are harmless (`exited` ignores an episode already past it).
        """
        record = functools.partial(self.episodes.exited, episode, status)
        await self._until_done("episode.exit_retry", record, episode=episode)

    async def start(self) -> None:
        """Load state, reconcile with the launcher, subscribe to feeds and start scheduling."""
        await self.episodes.load(await self._store.episodes(self.spec.run))
        scheduled = [r for r in self.episodes.records.values() if not r.byo]
        self._next_group = 1 + max((r.batch * self.spec.batch_tasks + r.slot for r in scheduled), default=-1)
        await self._complete_groups(scheduled)
        await self._launcher.start(self._exited_until_recorded)
        await self._reconcile()
        await self._subscribe()
        self._loop = asyncio.create_task(self._schedule())

    async def stop(self) -> None:
        """Stop scheduling and following (running harnesses are left to the next controller)."""
        if self._loop is not None:
            self._loop.cancel()
        for task in self._tasks:
            task.cancel()
        await stop_all(self._subscriptions)
        await self._launcher.close()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a coroutine in the background, keeping a reference until it ends."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """Forget a finished background task; a failure is logged, never silently dropped."""
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._log.error("task.failed", error=repr(error), exc_info=error)

    # --- scheduling ------------------------------------------------------------------------------

    def admitted(self, batch: int) -> bool:
        """Whether episodes of `batch` may start under the run's mode and staleness bound."""
        if batch >= self.spec.max_steps:
            return False
        lag = 0 if self.spec.mode == "sync" else self.spec.staleness
        return self.steps >= batch - lag

    def live(self, besides: str = "") -> int:
        """Harnesses scheduled or running now, those of group `besides` left out (BYO ones run elsewhere)."""
        return sum(
            1
            for r in self.episodes.records.values()
            if r.phase in LIVE_PHASES and not r.byo and r.group != besides
        )

    async def _schedule(self) -> None:
        """Admit and launch groups as the run allows, until it is done or stopped.

        A pass that fails (the bus unreachable for longer than its own retries) is tried again:
        the scheduler must never end in silence, leaving scheduled episodes unlaunched.
        """
        while not await self._until_done("schedule.retry", self._schedule_pass):
            await self._wake.wait()
            self._wake.clear()

    async def _schedule_pass(self) -> bool:
        """One pass of scheduling; True once the run is over (done or stopped)."""
        if (stopped := self._fail_fast.verdict(self.episodes.records.values())) is not None:
            await self._stop(stopped)  # safe to repeat after a failed pass: announced once
            return True
        await self._fill()
        records = self.episodes.records.values()
        if self._next_group < self.total_groups or not all(r.terminal for r in records):
            return False
        self._record = msgspec.structs.replace(self._record, state="done")
        await self._store.save_run(self._record)
        self._log.info("run.finished", episodes=len(self.episodes.records))
        self.done.set()
        return True

    async def _stop(self, stopped: RunStopped) -> None:
        """Stop the run for good: record why, say so once on the bus; running episodes end alone."""
        self.stopped = stopped
        self.episodes.retrying = False
        self._record = await stop_run(self._bus, self._store, self._record, stopped)
        self._log.error(
            "run.stopped",
            cause=stopped.cause,
            reason=stopped.reason,
            episodes=stopped.episodes,
            logs=stopped.logs,
            groups_not_scheduled=self.total_groups - self._next_group,
        )

    async def _fill(self) -> None:
        size = self.spec.group_size
        while self._next_group < self.total_groups:
            batch, slot = divmod(self._next_group, self.spec.batch_tasks)
            live = self.live(besides=group_id(batch, slot))  # a pass that failed may have begun it
            if not self.admitted(batch) or (live and live + size > self.spec.max_concurrent):
                return
            task = self._train[self._next_group % len(self._train)]
            for record in await self._add_members(batch, slot, task.task_id, range(size), self.version):
                self.spawn(self.launch(record))
            self._next_group += 1  # only once every member is recorded: a failed pass redoes the group

    async def _add_members(
        self, batch: int, slot: int, task: str, members: Iterable[int], version: int
    ) -> list[EpisodeRecord]:
        """Record first attempts of a group's `members` (an existing record wins); the records."""
        records = [
            EpisodeRecord(
                run=self.spec.run,
                episode=episode_id(batch, slot, member, 0),
                task=task,
                group=group_id(batch, slot),
                batch=batch,
                slot=slot,
                member=member,
                group_size=self.spec.group_size,
                expected_version=version,
            )
            for member in members
        ]
        return list(await asyncio.gather(*(self.episodes.add(record) for record in records)))

    async def _complete_groups(self, scheduled: list[EpisodeRecord]) -> None:
        """Add the members a controller that died while scheduling a group left unrecorded.

        Without them the group would never be whole, and the trainer never gets it. A member
        counts as recorded when any attempt of it is. They are launched by `_reconcile`, as every
        scheduled episode no harness runs for.
        """
        groups: dict[tuple[int, int], list[EpisodeRecord]] = {}
        for record in scheduled:
            groups.setdefault((record.batch, record.slot), []).append(record)
        for (batch, slot), records in sorted(groups.items()):
            missing = sorted(set(range(records[0].group_size)) - {r.member for r in records})
            if missing:
                first = records[0]
                self._log.warning("group.completed_after_restart", group=first.group, members=missing)
                await self._add_members(batch, slot, first.task, missing, first.expected_version)

    async def launch(self, record: EpisodeRecord) -> None:
        """Start a scheduled episode's harness (retried while the launcher is unreachable)."""
        request = self._request(record)
        async with self.episodes.lock(record.episode):
            if self.episodes.records[record.episode].phase != "scheduled":
                return
            if self.stopped is not None:
                self.not_launched += 1
                self._log.warning("episode.not_launched", episode=record.episode, reason="run stopped")
                return
            while True:
                self._store.ensure_active()
                try:
                    where = await self._launcher.launch(request)
                    break
                except LauncherUnavailableError as exc:
                    self._log.warning("launcher.unavailable", episode=record.episode, error=str(exc))
                    await asyncio.sleep(_UNAVAILABLE_RETRY_S)
                except LaunchError as exc:
                    await self.episodes.infra_failure(self.episodes.records[record.episode], str(exc))
                    return
            await self.episodes.started(record.episode, where)

    def _request(self, record: EpisodeRecord) -> LaunchRequest:
        task = self.episodes.task_of(record) or TaskSpec(task_id=record.task)
        timeout = self.spec.episode_timeout_s
        return LaunchRequest(
            run=record.run,
            episode=record.episode,
            task=task,
            attempt=record.attempt,
            command=list(self.spec.launcher.command),
            env=episode_env(self._settings, self.spec.launcher.env, record, task, self.spec.model),
            secret_env=key_env(self.key_for(record.episode, timeout)),
            timeout_s=timeout,
            artifact_kind="patch" if task.kind == "swe" else "answer",
        )

    def key_for(self, episode: str, timeout_s: float) -> str:
        """A fresh signed key for one episode, valid a little past its deadline."""
        ttl = timeout_s + self._settings.key_grace_s
        return sign_episode_key(self._settings.secret, self.spec.run, episode, ttl)

    # --- restart and feeds -------------------------------------------------------------------------

    async def _reconcile(self) -> None:
        observed = await self._launcher.relist()
        for record in list(self.episodes.records.values()):
            if record.byo or record.phase not in LIVE_PHASES:
                continue
            if record.episode not in observed:
                if record.phase == "scheduled":
                    self.spawn(self.launch(record))
                else:
                    async with self.episodes.lock(record.episode):
                        await self.episodes.infra_failure(
                            record, "harness lost while the controller was down"
                        )
            elif (status := observed[record.episode]) is not None:
                await self.episodes.exited(record.episode, status)
            elif record.phase == "scheduled":
                async with self.episodes.lock(record.episode):
                    await self.episodes.started(record.episode, "relisted")
        self._log.info("run.reconciled", records=len(self.episodes.records), observed=len(observed))

    async def _subscribe(self) -> None:
        run = self.spec.run
        feeds = (
            (subjects.WEIGHTS.name, subjects.weights(run), None, self._on_weights),
            (
                subjects.EPISODES.name,
                subjects.episode_events_of_run(run, "scored"),
                f"ctl-{run}-scored",
                self._on_scored,
            ),
            (
                subjects.EPISODES.name,
                subjects.episode_events_of_run(run, "failed"),
                f"ctl-{run}-failed",
                self._on_failed,
            ),
        )
        for stream, subject, durable, handler in feeds:
            spec = ConsumerSpec(
                stream=stream, filter_subject=subject, durable=durable, max_deliver=-1, ack_wait_s=10.0
            )
            self._subscriptions.append(await self._bus.subscribe(spec, handler))

    async def _on_weights(self, delivery: Delivery) -> None:
        message = delivery.decode(WeightVersion)
        if message.version > self.version or message.step > self.steps:
            self.version = max(self.version, message.version)
            self.steps = max(self.steps, message.step)
            self._wake.set()

    async def _on_scored(self, delivery: Delivery) -> None:
        await self.episodes.scored(delivery.decode(EpisodeScored))

    async def _on_failed(self, delivery: Delivery) -> None:
        await self.episodes.reward_failed(delivery.decode(EpisodeFailed))

"""Fail fast: a run whose first groups all failed the same way stops instead of running the rest.

The first `fail_fast_groups` groups of a run (in schedule order) decide. Once every member's final
attempt (the terminal one after infra retries) has ended, and all of them failed with one cause and
one reason, the run stops: nothing more is scheduled or launched, episodes already running end on
their own, the run record says `stopped` and why (so a restarted controller leaves it alone), and
one `RunStopped` goes to the RUNS stream. Any success or any second way of failing settles it the
other way: the run goes on and is never checked again.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from harnessrl.controller.records import EpisodeRecord, RunRecord
from harnessrl.controller.store import EpisodeStore
from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import RunSpec, RunStopped


class FailFast:
    """Watches the final episodes of a run's first groups and decides, once, whether to stop it."""

    def __init__(self, spec: RunSpec) -> None:
        self._run, self._batch_tasks = spec.run, spec.batch_tasks
        self._groups = min(spec.fail_fast_groups, spec.max_steps * spec.batch_tasks)
        self._members = self._groups * spec.group_size
        # Decided either way (or switched off with `fail_fast_groups = 0`): nothing left to check.
        self.settled = self._groups == 0

    def verdict(self, records: Iterable[EpisodeRecord]) -> RunStopped | None:
        """The stop, when every final episode of the first groups failed with one cause and reason."""
        if self.settled:
            return None
        finals = [r for r in records if self._first(r) and r.terminal and not r.retried_as]
        shared = {(r.cause, r.reason) for r in finals}
        if any(r.phase == "completed" for r in finals) or len(shared) > 1:
            self.settled = True
            return None
        if len({(r.group, r.member) for r in finals}) < self._members:
            return None
        self.settled = True
        ((cause, reason),) = shared
        witness = next((r for r in finals if r.detail), finals[0])
        return RunStopped(
            run=self._run,
            cause=str(cause),
            reason=reason,
            episodes=len(finals),
            detail=witness.detail,
            logs=witness.logs,
        )

    def _first(self, record: EpisodeRecord) -> bool:
        return not record.byo and record.batch * self._batch_tasks + record.slot < self._groups


async def stop_run(bus: Bus, store: EpisodeStore, record: RunRecord, stopped: RunStopped) -> RunRecord:
    """Record that the run stopped and why (never resumed after this), then announce it."""
    record = msgspec.structs.replace(record, state="stopped", stopped=stopped, stop_published=False)
    await store.save_run(record)
    return await announce_stop(bus, store, record)


async def announce_stop(bus: Bus, store: EpisodeStore, record: RunRecord) -> RunRecord:
    """Publish a stopped run's `RunStopped` (deduplicated as `<run>:stopped`), then mark it published."""
    if record.stopped is None or record.stop_published:
        return record
    run = record.spec.run
    store.ensure_active()
    await bus.publish(subjects.run_event(run, "stopped"), record.stopped, msg_id=f"{run}:stopped")
    published = msgspec.structs.replace(record, stop_published=True)
    await store.save_run(published)
    return published

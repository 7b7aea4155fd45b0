"""Run and episode records in the `hrl-episodes` KV bucket, written with optimistic concurrency.

The controller is the only writer of these keys. Every write carries the revision it last saw, so a
second controller that wrongly runs the same run fails loudly instead of corrupting state, and a
controller adopting records rewrites the live ones first (`claim_episode`), so the writes of the
one before it that are still under way fail the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import msgspec

from harnessrl.controller.errors import ControllerError
from harnessrl.controller.records import EpisodeRecord, RunRecord, episode_key, run_key
from harnessrl.shared.bus import KeyExistsError, KeyValue, RevisionMismatchError

R = TypeVar("R", bound=msgspec.Struct)
# Rewrites of an adopted record before giving up (each lost one means a late write just landed).
_CLAIM_TRIES = 3


class StateConflictError(ControllerError):
    """Another writer changed a record this controller owns."""


def always_active() -> None:
    """The `ensure_active` of a controller that is not behind a lease (tests, tools): never raises."""


class EpisodeStore:
    """Typed access to run and episode records, remembering each key's revision.

    Every write first calls `ensure_active`, which raises while this controller may not act (it
    lost its lease); so do the launches and publishes that follow from the records (`ensure_active`).
    """

    def __init__(self, kv: KeyValue, *, ensure_active: Callable[[], None] = always_active) -> None:
        self._kv = kv
        self.ensure_active = ensure_active
        self._revisions: dict[str, int] = {}
        self._encoder = msgspec.msgpack.Encoder()

    async def runs(self) -> list[RunRecord]:
        """Every submitted run."""
        keys = [key for key in await self._kv.keys() if key.startswith("run.")]
        records = [await self._get(key, RunRecord) for key in keys]
        return [record for record in records if record is not None]

    async def run(self, run: str) -> RunRecord | None:
        """One run's record."""
        return await self._get(run_key(run), RunRecord)

    async def create_run(self, record: RunRecord) -> bool:
        """Store a new run; False when a run of that name already exists."""
        return await self._create(run_key(record.spec.run), record)

    async def delete_run(self, run: str) -> None:
        """Forget a run that never started."""
        self.ensure_active()
        await self._kv.delete(run_key(run))
        self._revisions.pop(run_key(run), None)

    async def save_run(self, record: RunRecord) -> None:
        """Overwrite a run's record (its revision must be the one last seen)."""
        await self._save(run_key(record.spec.run), record)

    async def episodes(self, run: str) -> list[EpisodeRecord]:
        """Every episode record of a run."""
        prefix = episode_key(run, "")
        keys = [key for key in await self._kv.keys() if key.startswith(prefix)]
        records = [await self._get(key, EpisodeRecord) for key in keys]
        return [record for record in records if record is not None]

    async def episode(self, run: str, episode: str) -> EpisodeRecord | None:
        """One episode's record."""
        return await self._get(episode_key(run, episode), EpisodeRecord)

    async def create_episode(self, record: EpisodeRecord) -> bool:
        """Store a new episode; False when it already exists (a replayed schedule)."""
        return await self._create(episode_key(record.run, record.episode), record)

    async def save_episode(self, record: EpisodeRecord) -> None:
        """Overwrite an episode's record (its revision must be the one last seen)."""
        await self._save(episode_key(record.run, record.episode), record)

    async def claim_episode(self, record: EpisodeRecord) -> EpisodeRecord:
        """Rewrite a record this controller adopts, as it stands now; returns that state.

        The new revision makes any write an earlier controller still had in flight (queued in a
        socket while it was cut off) fail on its revision instead of landing after the adoption;
        one that landed before the rewrite is read back and adopted with it.
        """
        key = episode_key(record.run, record.episode)
        for _ in range(_CLAIM_TRIES):
            try:
                await self._save(key, record)
            except StateConflictError:
                record = await self._get(key, EpisodeRecord) or record
                continue
            return record
        raise StateConflictError(f"{key} keeps changing under another controller")

    async def _get(self, key: str, kind: type[R]) -> R | None:
        entry = await self._kv.get(key)
        if entry is None:
            return None
        self._revisions[key] = entry.revision
        return msgspec.msgpack.decode(entry.value, type=kind)

    async def _create(self, key: str, record: msgspec.Struct) -> bool:
        self.ensure_active()
        try:
            self._revisions[key] = await self._kv.create(key, self._encoder.encode(record))
        except KeyExistsError:
            return False
        return True

    async def _save(self, key: str, record: msgspec.Struct) -> None:
        self.ensure_active()
        revision = self._revisions.get(key)
        data = self._encoder.encode(record)
        try:
            if revision is None:
                self._revisions[key] = await self._kv.put(key, data)
            else:
                self._revisions[key] = await self._kv.update(key, data, revision)
        except RevisionMismatchError as exc:
            raise StateConflictError(f"{key} was changed by another controller") from exc

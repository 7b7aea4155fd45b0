"""JetStream key-value buckets behind the `KeyValue` interface."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.js.errors

from harnessrl.shared.bus.base import BusError, KeyExistsError, KeyValue, KvEntry, RevisionMismatchError
from harnessrl.shared.bus.nats.retry import retrying

T = TypeVar("T")


class NatsKeyValue(KeyValue):
    """A KV bucket whose calls ride out a lost or late reply within `retry_s`.

    A write whose reply timed out may still have landed. Before retrying, the key is read back: our
    value at a newer revision means it did (that revision is returned); the revision we wrote against
    still current means it did not (the write is retried); anything else is someone else's write
    (`RevisionMismatchError` / `KeyExistsError`). So a slow server never turns into a false conflict.
    """

    def __init__(self, bucket: Any, retry_s: float) -> None:
        self._kv = bucket
        self._retry_s = retry_s

    async def retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        return await retrying(
            self._retry_s,
            lambda _: call(),
            lambda exc: BusError(f"KV {what} not answered in {self._retry_s:g} s: {exc!r}"),
        )

    async def get(self, key: str) -> KvEntry | None:
        return await self.retrying(f"get {key}", lambda: self._get(key))

    async def _get(self, key: str) -> KvEntry | None:
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return KvEntry(key=key, value=bytes(entry.value), revision=int(entry.revision or 0))

    async def put(self, key: str, value: bytes) -> int:
        return await self.retrying(f"put {key}", lambda: self._put(key, value))

    async def _put(self, key: str, value: bytes) -> int:
        return int(await self._kv.put(key, value))

    async def create(self, key: str, value: bytes) -> int:
        return await self._write(key, value, None)

    async def update(self, key: str, value: bytes, revision: int) -> int:
        return await self._write(key, value, revision)

    async def _write(self, key: str, value: bytes, revision: int | None) -> int:
        """Create (`revision` None) or update at `revision`, resolving lost replies by reading back."""
        uncertain = False

        async def attempt() -> int:
            nonlocal uncertain
            if uncertain:
                stored = await self._get(key)
                if stored is not None and stored.value == value and stored.revision != revision:
                    return stored.revision  # the earlier attempt landed
            uncertain = True
            try:
                if revision is None:
                    result = int(await self._kv.create(key, value))
                else:
                    result = int(await self._kv.update(key, value, last=revision))
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                stored = await self._get(key)
                if stored is not None and stored.value == value:
                    return stored.revision  # ours, written by an attempt whose reply was lost
                raise (KeyExistsError if revision is None else RevisionMismatchError)(key) from exc
            uncertain = False
            return result

        return await self.retrying(f"write {key}", attempt)

    async def delete(self, key: str) -> None:
        await self.retrying(f"delete {key}", lambda: self._delete(key))

    async def _delete(self, key: str) -> None:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self._kv.delete(key)

    async def keys(self) -> list[str]:
        return await self.retrying("keys", self._keys)

    async def _keys(self) -> list[str]:
        try:
            return list(await self._kv.keys())
        except nats.js.errors.NoKeysError:
            return []

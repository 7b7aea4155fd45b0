"""JetStream key-value buckets behind the `KeyValue` interface."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from harnessrl.shared.bus.base import BusError, KeyExistsError, KeyValue, KvEntry, RevisionMismatchError
from harnessrl.shared.bus.nats.retry import retrying

T = TypeVar("T")

# How a KV entry says it is gone (a delete or purge marker stays the last entry of its key).
_OPERATION = "KV-Operation"
_REMOVED = frozenset({"DEL", "PURGE"})


class NatsKeyValue(KeyValue):
    """A KV bucket whose calls ride out a lost or late reply within `retry_s`.

    A write whose reply timed out may still have landed. Before retrying, the key is read back: our
    value at a newer revision means it did (that revision is returned); the revision we wrote against
    still current means it did not (the write is retried); anything else is someone else's write
    (`RevisionMismatchError` / `KeyExistsError`). So a slow server never turns into a false conflict.
    """

    def __init__(self, bucket: Any, retry_s: float, *, js: JetStreamContext, name: str) -> None:
        self._kv = bucket
        self._retry_s = retry_s
        self._js = js
        self._stream, self._prefix = f"KV_{name}", f"$KV.{name}."

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        return await retrying(
            self._retry_s,
            lambda _: call(),
            lambda exc: BusError(f"KV {what} not answered in {self._retry_s:g} s: {exc!r}"),
        )

    async def get(self, key: str) -> KvEntry | None:
        return await self._call(f"get {key}", lambda: self._get(key))

    async def _get(self, key: str) -> KvEntry | None:
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return KvEntry(key=key, value=bytes(entry.value), revision=int(entry.revision or 0))

    async def put(self, key: str, value: bytes) -> int:
        return await self._call(f"put {key}", lambda: self._put(key, value))

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

        return await self._call(f"write {key}", attempt)

    async def delete(self, key: str) -> None:
        await self._call(f"delete {key}", lambda: self._delete(key))

    async def _delete(self, key: str) -> None:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self._kv.delete(key)

    async def keys(self) -> list[str]:
        return await self._call("keys", self._keys)

    async def _keys(self) -> list[str]:
        """Every live key, from the last entry per key, read with a pull consumer.

        Not nats-py's `keys()`: its watcher decides "nothing more" from the consumer's pending count
        next to the number of entries its callback has handled so far, and can end early when the
        server pushed entries the callback has not seen yet (our suspect for a CI run in which a
        restarted controller resumed no run). A pull consumer delivers only what
        is fetched, so its pending count at creation is exact.
        """
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=api.AckPolicy.EXPLICIT,
            headers_only=True,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        sub = await self._js.pull_subscribe(self._prefix + ">", stream=self._stream, config=config)
        try:
            pending = (await sub.consumer_info()).num_pending or 0
            keys = []
            while pending > 0:
                for msg in await sub.fetch(min(pending, 256), timeout=5.0):
                    if (msg.headers or {}).get(_OPERATION) not in _REMOVED:
                        keys.append(msg.subject[len(self._prefix) :])
                    pending = msg.metadata.num_pending
            return keys
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

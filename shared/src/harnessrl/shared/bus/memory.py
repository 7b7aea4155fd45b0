"""An in-memory `Bus` with JetStream's semantics, for pure unit tests.

Streams keep every message; `Nats-Msg-Id` dedupe lasts for the bus's lifetime; durable consumers
share one cursor (queue semantics) and redeliver nak'ed messages after their delay, up to
`max_deliver`. It is single-process and not persistent: tests of crash recovery use the real server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import msgspec

from harnessrl.shared.bus.base import (
    Backlog,
    Bus,
    BusError,
    ConsumerSpec,
    Delivery,
    Handler,
    KeyExistsError,
    KeyValue,
    KvEntry,
    LastOnSubject,
    LastSequenceMismatchError,
    Outgoing,
    PubAck,
    Responder,
    RevisionMismatchError,
    StreamDriftError,
    Subscription,
    stop_all,
)
from harnessrl.shared.bus.outcome import settle
from harnessrl.shared.contracts import encode
from harnessrl.shared.subjects import ALL_STREAMS, BucketSpec, StreamSpec, dead_letter


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: `*` is one token, `>` one or more trailing tokens."""
    want, have = pattern.split("."), subject.split(".")
    for i, part in enumerate(want):
        if part == ">":
            return len(have) > i
        if i >= len(have) or (part not in ("*", have[i])):
            return False
    return len(want) == len(have)


class _Stored(msgspec.Struct):
    seq: int
    subject: str
    data: bytes
    msg_id: str


class _Stream:
    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.messages: list[_Stored] = []
        self.ids: dict[str, int] = {}
        self.changed = asyncio.Event()


class _Cursor:
    """Delivery state of one consumer (shared by every subscriber of a durable)."""

    def __init__(self, start: int) -> None:
        self.next_index = start
        self.redeliver: dict[int, tuple[float, int]] = {}  # seq -> (due time, deliveries so far)
        self.done: set[int] = set()


class MemoryBus(Bus):
    """Everything in one process's memory."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._cursors: dict[str, _Cursor] = {}
        self._kv: dict[str, _MemoryKeyValue] = {}
        self._objects: dict[tuple[str, str], bytes] = {}
        self._responders: dict[str, list[Responder]] = {}
        self._subs: list[Subscription] = []
        self._connected = False

    @property
    def connected(self) -> bool:
        """True between connect and close."""
        return self._connected

    async def connect(self) -> None:
        """Nothing to connect to."""
        self._connected = True

    async def close(self) -> None:
        """Stop every subscription."""
        await stop_all(list(self._subs))
        self._subs.clear()
        self._connected = False

    async def ensure_streams(self, specs: Sequence[StreamSpec] = ALL_STREAMS) -> None:
        """Create missing streams; a different existing one raises `StreamDriftError`."""
        for spec in specs:
            have = self._streams.get(spec.name)
            if have is None:
                self._streams[spec.name] = _Stream(spec)
            elif have.spec != spec:
                raise StreamDriftError(f"stream {spec.name} differs from this build")

    def _stream_for(self, subject: str) -> _Stream:
        for stream in self._streams.values():
            if any(subject_matches(p, subject) for p in stream.spec.subjects):
                return stream
        raise BusError(f"no stream captures subject {subject}")

    async def publish(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        msg_id: str,
        budget_s: float | None = None,
        expect: LastOnSubject | None = None,
    ) -> PubAck:
        """Append unless `msg_id` was seen; the ack says which (never waits: `budget_s` is moot).

        `expect` is checked first, then `msg_id`, as JetStream does.
        """
        if expect is not None:
            self._check_last(subject, expect)
        return self._append(subject, encode(message), msg_id)

    def _check_last(self, subject: str, expect: LastOnSubject) -> None:
        stream = self._stream_for(subject)
        if stream.spec.name != expect.stream:
            raise BusError(f"{subject} is stored in {stream.spec.name}, not {expect.stream}")
        # Stream sequences count from 1 without gaps here: message `seq` is at index `seq - 1`.
        newer = [m for m in stream.messages[expect.seq :] if m.subject == subject]
        last = newer[-1].seq if newer else _last_up_to(stream, subject, expect.seq)
        if last != expect.seq:
            found = [
                Delivery(subject=m.subject, data=m.data, stream_seq=m.seq, msg_id=m.msg_id) for m in newer
            ]
            raise LastSequenceMismatchError(subject, expected=expect.seq, last_seq=last, newer=found)

    def _append(self, subject: str, data: bytes, msg_id: str) -> PubAck:
        stream = self._stream_for(subject)
        if msg_id in stream.ids:
            return PubAck(stream=stream.spec.name, seq=stream.ids[msg_id], duplicate=True)
        seq = len(stream.messages) + 1
        stream.messages.append(_Stored(seq=seq, subject=subject, data=data, msg_id=msg_id))
        stream.ids[msg_id] = seq
        stream.changed.set()
        return PubAck(stream=stream.spec.name, seq=seq)

    async def publish_batch(self, items: Sequence[Outgoing]) -> list[PubAck]:
        """Publish each in order."""
        return [await self.publish(i.subject, i.message, msg_id=i.msg_id) for i in items]

    async def subscribe(self, spec: ConsumerSpec, handler: Handler) -> Subscription:
        """Start a consumer task on the stream."""
        stream = self._streams.get(spec.stream)
        if stream is None:
            raise BusError(f"stream {spec.stream} not found")
        key = spec.durable or f"ephemeral-{id(handler)}-{len(self._subs)}"
        if key not in self._cursors:
            start = len(stream.messages) if spec.deliver == "new" else 0
            self._cursors[key] = _Cursor(start)
        sub = _MemorySubscription(self, stream, spec, self._cursors[key], handler)
        self._subs.append(sub)
        return sub

    def _live_subscriptions(self) -> list[Subscription]:
        return list(self._subs)

    async def replay(self, stream: str, filter_subject: str) -> list[Delivery]:
        """Every stored message under the filter."""
        if stream not in self._streams:
            raise BusError(f"stream {stream} not found")
        return [
            Delivery(subject=m.subject, data=m.data, stream_seq=m.seq, msg_id=m.msg_id)
            for m in self._streams[stream].messages
            if subject_matches(filter_subject, m.subject)
        ]

    async def kv(self, spec: BucketSpec) -> KeyValue:
        """Open or create a bucket."""
        return self._kv.setdefault(spec.name, _MemoryKeyValue())

    async def put_object(self, bucket: str, name: str, data: bytes) -> None:
        """Store a blob."""
        self._objects[(bucket, name)] = bytes(data)

    async def get_object(self, bucket: str, name: str) -> bytes:
        """Read a blob; `KeyError` when absent."""
        return self._objects[(bucket, name)]

    async def request(self, subject: str, payload: bytes, *, timeout: float = 5.0) -> bytes:
        """Call the first responder registered for `subject`."""
        responders = self._responders.get(subject)
        if not responders:
            raise BusError(f"no service answers {subject}")
        try:
            return await asyncio.wait_for(responders[0](payload), timeout)
        except TimeoutError as exc:
            raise BusError(f"request to {subject} timed out after {timeout}s") from exc

    async def serve(self, subject: str, responder: Responder, *, queue: str = "") -> Subscription:
        """Register a responder."""
        self._responders.setdefault(subject, []).append(responder)
        sub = _MemoryResponder(self._responders[subject], responder)
        self._subs.append(sub)
        return sub

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Copy a message to its dead-letter subject."""
        self._append(dead_letter(delivery.subject), delivery.data, f"dlq:{delivery.msg_id}")


def _last_up_to(stream: _Stream, subject: str, seq: int) -> int:
    """The stream sequence of the subject's last message at or before `seq` (0: none)."""
    for index in range(min(seq, len(stream.messages)) - 1, -1, -1):
        if stream.messages[index].subject == subject:
            return stream.messages[index].seq
    return 0


class _MemoryResponder(Subscription):
    def __init__(self, registry: list[Responder], responder: Responder) -> None:
        self.registry, self.responder = registry, responder

    async def stop(self) -> None:
        if self.responder in self.registry:
            self.registry.remove(self.responder)


class _MemorySettler:
    def __init__(self, sub: _MemorySubscription, delivery: Delivery) -> None:
        self.sub, self.delivery = sub, delivery

    async def ack(self) -> None:
        self.sub.cursor.done.add(self.delivery.stream_seq)

    async def nak(self, delay: float) -> None:
        due = asyncio.get_running_loop().time() + delay
        self.sub.cursor.redeliver[self.delivery.stream_seq] = (due, self.delivery.num_delivered)

    async def term(self, reason: str) -> None:
        self.sub.bus.dead_letter(self.delivery, reason)
        self.sub.cursor.done.add(self.delivery.stream_seq)


class _MemorySubscription(Subscription):
    def __init__(
        self, bus: MemoryBus, stream: _Stream, spec: ConsumerSpec, cursor: _Cursor, handler: Handler
    ) -> None:
        self.bus, self.stream, self.spec, self.cursor, self.handler = (
            bus,
            stream,
            spec,
            cursor,
            handler,
        )
        self._task = asyncio.create_task(self._run())

    def _next(self) -> tuple[_Stored, int] | None:
        now = asyncio.get_running_loop().time()
        for seq, (due, count) in sorted(self.cursor.redeliver.items()):
            if due <= now:
                del self.cursor.redeliver[seq]
                return self.stream.messages[seq - 1], count + 1
        while self.cursor.next_index < len(self.stream.messages):
            stored = self.stream.messages[self.cursor.next_index]
            self.cursor.next_index += 1
            if subject_matches(self.spec.filter_subject, stored.subject):
                return stored, 1
        return None

    async def _run(self) -> None:
        while True:
            item = self._next()
            if item is None:
                self.stream.changed.clear()
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow our cancellation.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await self.stream.changed.wait()
                continue
            stored, count = item
            delivery = Delivery(
                subject=stored.subject,
                data=stored.data,
                stream_seq=stored.seq,
                num_delivered=count,
                msg_id=stored.msg_id,
            )
            settler = _MemorySettler(self, delivery)
            await settle(delivery, self.handler, self.spec.max_deliver, settler)

    async def backlog(self) -> Backlog | None:
        """Matching messages past the cursor, plus those waiting for redelivery."""
        if self._task.done():
            return None
        later = self.stream.messages[self.cursor.next_index :]
        pending = sum(subject_matches(self.spec.filter_subject, m.subject) for m in later)
        return Backlog(
            consumer=self.spec.durable or self.spec.filter_subject,
            pending=pending,
            unacked=len(self.cursor.redeliver),
        )

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class _MemoryKeyValue(KeyValue):
    def __init__(self) -> None:
        self._data: dict[str, KvEntry] = {}
        self._revision = 0

    def _write(self, key: str, value: bytes) -> int:
        self._revision += 1
        self._data[key] = KvEntry(key=key, value=bytes(value), revision=self._revision)
        return self._revision

    async def get(self, key: str) -> KvEntry | None:
        return self._data.get(key)

    async def put(self, key: str, value: bytes) -> int:
        return self._write(key, value)

    async def create(self, key: str, value: bytes) -> int:
        if key in self._data:
            raise KeyExistsError(key)
        return self._write(key, value)

    async def update(self, key: str, value: bytes, revision: int) -> int:
        current = self._data.get(key)
        if current is None or current.revision != revision:
            raise RevisionMismatchError(key)
        return self._write(key, value)

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def keys(self) -> list[str]:
        return sorted(self._data)

"""The JetStream implementation of `Bus` over nats-py.

Publishing always awaits the JetStream ack and carries `Nats-Msg-Id`; a timed-out publish is retried
with the same id until `publish_retry_s` runs out, so a retry after a lost ack is deduplicated by the
server. Consumers are pull consumers with explicit acks; see `bus.base` for how a handler's outcome
maps to ack / nak / term + dead-letter.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from harnessrl.shared.bus.base import (
    Bus,
    BusError,
    ConsumerSpec,
    Delivery,
    Handler,
    KeyExistsError,
    KeyValue,
    KvEntry,
    Outgoing,
    PubAck,
    PublishError,
    Responder,
    RevisionMismatchError,
    StreamDriftError,
    Subscription,
)
from harnessrl.shared.bus.outcome import settle
from harnessrl.shared.contracts import encode
from harnessrl.shared.log import get_logger
from harnessrl.shared.subjects import ALL_STREAMS, BucketSpec, StreamSpec, dead_letter

T = TypeVar("T")

log = get_logger("harnessrl.bus")

MSG_ID = "Nats-Msg-Id"
DLQ_REASON = "Hrl-Dlq-Reason"
_DELIVER = {
    "all": api.DeliverPolicy.ALL,
    "new": api.DeliverPolicy.NEW,
    "last_per_subject": api.DeliverPolicy.LAST_PER_SUBJECT,
}
_RETRYABLE = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


class NatsBus(Bus):
    """JetStream-backed bus; one instance per process, shared by all its handlers."""

    def __init__(
        self,
        url: str,
        *,
        name: str = "harnessrl",
        publish_timeout_s: float = 5.0,
        publish_retry_s: float = 30.0,
        connect_timeout_s: float = 15.0,
    ) -> None:
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self.name = name
        self.publish_timeout_s = publish_timeout_s
        self.publish_retry_s = publish_retry_s
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._subscriptions: list[Subscription] = []

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context; raises when not connected."""
        if self._js is None:
            raise BusError("bus is not connected")
        return self._js

    @property
    def nc(self) -> Client:
        """The core NATS client; raises when not connected."""
        if self._nc is None:
            raise BusError("bus is not connected")
        return self._nc

    @property
    def connected(self) -> bool:
        """Whether the underlying connection is up right now."""
        return self._nc is not None and self._nc.is_connected

    async def connect(self) -> None:
        """Connect once (clear error if the server is unreachable), then reconnect forever."""
        try:
            self._nc = await asyncio.wait_for(self._connect(), timeout=self.connect_timeout_s)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise BusError(f"cannot connect to NATS at {self.url}: {exc!r}") from exc
        self._js = self._nc.jetstream(timeout=self.publish_timeout_s)

    async def _connect(self) -> Client:
        return await nats.connect(
            self.url,
            name=self.name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            connect_timeout=2,
            allow_reconnect=True,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
        )

    async def _on_error(self, exc: Exception) -> None:
        log.warning("nats.error", error=str(exc))

    async def _on_disconnect(self) -> None:
        log.warning("nats.disconnected", url=self.url)

    async def _on_reconnect(self) -> None:
        log.info("nats.reconnected", url=self.url)

    async def close(self) -> None:
        """Stop subscriptions, flush and close."""
        for sub in list(self._subscriptions):
            await sub.stop()
        self._subscriptions.clear()
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error, OSError, asyncio.TimeoutError):
                await self._nc.flush(timeout=2)
            # With the server gone, nats.py's close still writes what it buffered for a reconnect to
            # the dead socket (uvloop raises RuntimeError); its tasks are stopped by then, nothing to do.
            with contextlib.suppress(RuntimeError, OSError):
                await self._nc.close()
        self._nc = self._js = None

    # --- streams ---------------------------------------------------------------------------------

    async def ensure_streams(self, specs: Sequence[StreamSpec] = ALL_STREAMS) -> None:
        """Create missing streams; an existing stream that differs raises `StreamDriftError`."""
        for spec in specs:
            try:
                info = await self.js.stream_info(spec.name)
            except nats.js.errors.NotFoundError:
                await self.js.add_stream(_stream_config(spec))
                continue
            _check_drift(spec, info.config)

    # --- publishing ------------------------------------------------------------------------------

    async def publish(
        self, subject: str, message: msgspec.Struct, *, msg_id: str, budget_s: float | None = None
    ) -> PubAck:
        """Publish and await the ack; retry timeouts with the same msg id until the budget ends."""
        return await self._publish_raw(subject, encode(message), msg_id, budget_s)

    async def _publish_raw(
        self, subject: str, payload: bytes, msg_id: str, budget_s: float | None = None
    ) -> PubAck:
        async def attempt(left_s: float) -> PubAck:
            timeout = max(min(self.publish_timeout_s, left_s), 0.01)
            ack = await self.js.publish(subject, payload, timeout=timeout, headers={MSG_ID: msg_id})
            return PubAck(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))

        return await _retrying(
            self.publish_retry_s if budget_s is None else budget_s,
            attempt,
            lambda exc: PublishError(f"publish to {subject} not acknowledged: {exc!r}"),
        )

    async def publish_batch(self, items: Sequence[Outgoing]) -> list[PubAck]:
        """Pipeline publishes (publish_async) and await every ack; stragglers retry one by one."""
        payloads = [(item.subject, encode(item.message), item.msg_id) for item in items]
        futures: list[asyncio.Future[api.PubAck] | None] = []
        for subject, payload, msg_id in payloads:
            try:
                futures.append(await self.js.publish_async(subject, payload, headers={MSG_ID: msg_id}))
            except (*_RETRYABLE, nats.js.errors.TooManyStalledMsgsError):
                futures.append(None)
        done = await _gather_acks(futures, self.publish_timeout_s)
        acks: list[PubAck] = []
        for (subject, payload, msg_id), ack in zip(payloads, done, strict=True):
            acks.append(ack if ack is not None else await self._publish_raw(subject, payload, msg_id))
        return acks

    # --- consuming -------------------------------------------------------------------------------

    async def subscribe(self, spec: ConsumerSpec, handler: Handler) -> Subscription:
        """Start a pull-consumer loop that settles each message by the handler's outcome."""
        sub = _PullSubscription(self, spec, handler)
        await sub.start()
        self._subscriptions.append(sub)
        return sub

    async def replay(self, stream: str, filter_subject: str) -> list[Delivery]:
        """Read every stored message under a filter with a throwaway no-ack consumer.

        An exact subject with nothing stored (a new episode's spans: the gateway's first sight of
        every episode) costs one request and no consumer.
        """
        if not _has_wildcard(filter_subject) and not await self._stored(stream, filter_subject):
            return []
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=30.0,
            filter_subject=filter_subject,
        )
        psub = await self.js.pull_subscribe(filter_subject, stream=stream, config=config)
        name = ""
        try:
            info = await psub.consumer_info()
            name, pending = info.name, info.num_pending or 0
            out: list[Delivery] = []
            while len(out) < pending:
                msgs = await psub.fetch(min(pending - len(out), 512), timeout=5)
                out.extend(_delivery(m) for m in msgs)
            return out
        finally:
            with contextlib.suppress(nats.errors.Error):
                await psub.unsubscribe()
            # Gone now, not `inactive_threshold` later: replays come by the hundred per second
            # (every new episode the gateway sees, every rollout the trainer reads), and the
            # server refuses new consumers once about a thousand linger.
            if name:
                with contextlib.suppress(nats.errors.Error):
                    await self.js.delete_consumer(stream, name)

    async def _stored(self, stream: str, subject: str) -> bool:
        """Whether `stream` holds any message on the exact `subject`."""
        try:
            await self.js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def dead_letter(self, msg: Msg, reason: str) -> None:
        """Copy a message that will never be handled to its dead-letter subject."""
        msg_id = (msg.headers or {}).get(MSG_ID) or f"seq-{msg.metadata.sequence.stream}"
        headers = {MSG_ID: f"dlq:{msg_id}", DLQ_REASON: reason[:512]}
        await self.js.publish(dead_letter(msg.subject), msg.data, headers=headers)

    # --- kv, objects, request-reply --------------------------------------------------------------

    async def kv(self, spec: BucketSpec) -> KeyValue:
        """Open or create the bucket."""
        try:
            bucket = await self.js.key_value(spec.name)
        except nats.js.errors.BucketNotFoundError:
            bucket = await self.js.create_key_value(bucket=spec.name, history=spec.history)
        return _NatsKeyValue(bucket, self.publish_retry_s)

    async def _object_store(self, bucket: str) -> Any:
        try:
            return await self.js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            return await self.js.create_object_store(bucket)

    async def put_object(self, bucket: str, name: str, data: bytes) -> None:
        """Store a blob (chunked by the object store)."""
        store = await self._object_store(bucket)
        await store.put(name, data)

    async def get_object(self, bucket: str, name: str) -> bytes:
        """Read a blob; `KeyError` when absent."""
        store = await self._object_store(bucket)
        try:
            result = await store.get(name)
        except nats.js.errors.NotFoundError as exc:
            raise KeyError(name) from exc
        return bytes(result.data or b"")

    async def request(self, subject: str, payload: bytes, *, timeout: float = 5.0) -> bytes:
        """Core NATS request; `BusError` on timeout or when nobody serves the subject."""
        try:
            reply = await self.nc.request(subject, payload, timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise BusError(f"no service answers {subject}") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise BusError(f"request to {subject} timed out after {timeout}s") from exc
        return bytes(reply.data)

    async def serve(self, subject: str, responder: Responder, *, queue: str = "") -> Subscription:
        """Answer requests on `subject`; members of one queue group share the load."""

        async def on_request(msg: Msg) -> None:
            await msg.respond(await responder(msg.data))

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_request)
        served = _CoreSubscription(sub)
        self._subscriptions.append(served)
        return served


class _Settler:
    def __init__(self, bus: NatsBus, msg: Msg) -> None:
        self.bus, self.msg = bus, msg

    async def ack(self) -> None:
        await self.msg.ack()

    async def nak(self, delay: float) -> None:
        await self.msg.nak(delay=delay)

    async def term(self, reason: str) -> None:
        await self.bus.dead_letter(self.msg, reason)
        await self.msg.term()


class _CoreSubscription(Subscription):
    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def stop(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()


class _PullSubscription(Subscription):
    """A fetch loop on one pull consumer; recreates the consumer if the server lost it."""

    def __init__(self, bus: NatsBus, spec: ConsumerSpec, handler: Handler) -> None:
        self.bus, self.spec, self.handler = bus, spec, handler
        self._psub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        await self._bind()
        self._task = asyncio.create_task(self._run(), name=f"consume:{self.spec.filter_subject}")

    async def _bind(self) -> None:
        spec = self.spec
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=_DELIVER[spec.deliver],
            ack_wait=spec.ack_wait_s,
            max_deliver=spec.max_deliver,
            filter_subject=spec.filter_subject,
            inactive_threshold=None if spec.durable else 60.0,
            max_ack_pending=max(spec.batch * 4, 256),
        )
        self._psub = await self.bus.js.pull_subscribe(
            spec.filter_subject, durable=spec.durable, stream=spec.stream, config=config
        )

    async def _run(self) -> None:
        while not self._stopping:
            try:
                msgs = await self._psub.fetch(self.spec.batch, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except nats.js.errors.NotFoundError:
                await self._rebind()
                continue
            except (nats.errors.Error, OSError) as exc:
                log.warning("consumer.fetch_failed", filter=self.spec.filter_subject, error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await settle(_delivery(msg), self.handler, self.spec.max_deliver, _Settler(self.bus, msg))

    async def _rebind(self) -> None:
        log.info("consumer.rebind", filter=self.spec.filter_subject, durable=self.spec.durable)
        try:
            await self._bind()
        except (nats.errors.Error, OSError) as exc:
            log.warning("consumer.rebind_failed", error=str(exc))
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), timeout=2.0)
            if not self._task.done():
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        if self._psub is not None:
            # Ends only our inbox subscription; a durable consumer stays on the server.
            with contextlib.suppress(nats.errors.Error):
                await self._psub.unsubscribe()


class _NatsKeyValue(KeyValue):
    """A KV bucket whose calls ride out a lost or late reply within `retry_s`.

    A write whose reply timed out may still have landed. Before retrying, the key is read back: our
    value at a newer revision means it did (that revision is returned); the revision we wrote against
    still current means it did not (the write is retried); anything else is someone else's write
    (`RevisionMismatchError` / `KeyExistsError`). So a slow server never turns into a false conflict.
    """

    def __init__(self, bucket: Any, retry_s: float) -> None:
        self._kv = bucket
        self._retry_s = retry_s

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        return await _retrying(
            self._retry_s,
            lambda _: call(),
            lambda exc: BusError(f"KV {what} not answered in {self._retry_s:g} s: {exc!r}"),
        )

    async def get(self, key: str) -> KvEntry | None:
        return await self._retrying(f"get {key}", lambda: self._get(key))

    async def _get(self, key: str) -> KvEntry | None:
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return KvEntry(key=key, value=bytes(entry.value), revision=int(entry.revision or 0))

    async def put(self, key: str, value: bytes) -> int:
        return await self._retrying(f"put {key}", lambda: self._put(key, value))

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

        return await self._retrying(f"write {key}", attempt)

    async def delete(self, key: str) -> None:
        await self._retrying(f"delete {key}", lambda: self._delete(key))

    async def _delete(self, key: str) -> None:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self._kv.delete(key)

    async def keys(self) -> list[str]:
        return await self._retrying("keys", self._keys)

    async def _keys(self) -> list[str]:
        try:
            return list(await self._kv.keys())
        except nats.js.errors.NoKeysError:
            return []


async def _retrying(
    budget_s: float, call: Callable[[float], Awaitable[T]], failed: Callable[[Exception], BusError]
) -> T:
    """`call(seconds left)` until it answers, retrying lost or late replies within `budget_s`.

    Retries back off from 50 ms to 1 s; once the budget is spent, `failed(last error)` is raised.
    """
    deadline = time.monotonic() + budget_s
    delay = 0.05
    while True:
        try:
            return await call(deadline - time.monotonic())
        except _RETRYABLE as exc:
            if time.monotonic() + delay > deadline:
                raise failed(exc) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


def _has_wildcard(subject: str) -> bool:
    return any(token in ("*", ">") for token in subject.split("."))


def _delivery(msg: Msg) -> Delivery:
    meta = msg.metadata if msg.reply else None
    return Delivery(
        subject=msg.subject,
        data=msg.data,
        stream_seq=meta.sequence.stream if meta else 0,
        num_delivered=meta.num_delivered if meta else 1,
        msg_id=(msg.headers or {}).get(MSG_ID),
    )


async def _gather_acks(
    futures: list[asyncio.Future[api.PubAck] | None], timeout: float
) -> list[PubAck | None]:
    live = [f for f in futures if f is not None]
    if live:
        await asyncio.wait(live, timeout=timeout)
    out: list[PubAck | None] = []
    for fut in futures:
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            if fut is not None and not fut.done():
                fut.cancel()
            out.append(None)
            continue
        ack = fut.result()
        out.append(PubAck(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate)))
    return out


def _stream_config(spec: StreamSpec) -> api.StreamConfig:
    return api.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        storage=api.StorageType(spec.storage),
        max_age=spec.max_age_s or None,
        duplicate_window=spec.duplicate_window_s,
        max_msg_size=spec.max_msg_size,
    )


def _check_drift(spec: StreamSpec, have: api.StreamConfig) -> None:
    want = _stream_config(spec)
    diffs = []
    if sorted(have.subjects or []) != sorted(want.subjects or []):
        diffs.append(f"subjects {have.subjects} != {want.subjects}")
    if have.storage != want.storage:
        diffs.append(f"storage {have.storage} != {want.storage}")
    if abs((have.duplicate_window or 0) - (want.duplicate_window or 0)) > 1e-3:
        diffs.append(f"duplicate_window {have.duplicate_window} != {want.duplicate_window}")
    if abs((have.max_age or 0) - (want.max_age or 0)) > 1e-3:
        diffs.append(f"max_age {have.max_age} != {want.max_age}")
    if diffs:
        raise StreamDriftError(f"stream {spec.name} differs from this build: " + "; ".join(diffs))

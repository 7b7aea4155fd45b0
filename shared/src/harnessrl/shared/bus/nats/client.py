"""The JetStream implementation of `Bus` over nats-py.

Publishing always awaits the JetStream ack and carries `Nats-Msg-Id`; a timed-out publish is retried
with the same id until `publish_retry_s` runs out, so a retry after a lost ack is deduplicated by the
server. Consumers are pull consumers with explicit acks; see `bus.base` for how a handler's outcome
maps to ack / nak / term + dead-letter.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
    KeyValue,
    LastOnSubject,
    LastSequenceMismatchError,
    Outgoing,
    PubAck,
    PublishError,
    Responder,
    Subscription,
    stop_all,
)
from harnessrl.shared.bus.nats.acks import gather_acks
from harnessrl.shared.bus.nats.consumers import (
    DLQ_REASON,
    MSG_ID,
    CoreSubscription,
    PullSubscription,
)
from harnessrl.shared.bus.nats.kv import NatsKeyValue
from harnessrl.shared.bus.nats.objects import get_object, put_object
from harnessrl.shared.bus.nats.replay import replay
from harnessrl.shared.bus.nats.retry import RETRYABLE, retrying
from harnessrl.shared.bus.nats.streams import check_drift, deployment_replicas, scaled_up, stream_config
from harnessrl.shared.contracts import encode
from harnessrl.shared.log import get_logger
from harnessrl.shared.nats_permissions import inbox, redacted, url_user
from harnessrl.shared.net import nats_servers
from harnessrl.shared.subjects import ALL_STREAMS, BucketSpec, StreamSpec, dead_letter

log = get_logger(__name__)
T = TypeVar("T")
# JetStream's error code for a stream created by someone else between our lookup and our create.
_STREAM_NAME_IN_USE = 10058
# nats-py's inbox without a login; with one, the user's own (`nats_permissions.inbox`).
_DEFAULT_INBOX = "_INBOX"


class NatsBus(Bus):
    """JetStream-backed bus; one instance per process, shared by all its handlers.

    `url` names every server of the deployment (a comma-separated string or a list): the client
    connects to one of them and, when it dies, reconnects to another. `replicas` is how many servers
    hold each stream and bucket it creates (default `HRL_NATS_REPLICAS`, else 1).
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        name: str = "harnessrl",
        publish_timeout_s: float = 5.0,
        publish_retry_s: float = 30.0,
        connect_timeout_s: float = 15.0,
        replicas: int | None = None,
    ) -> None:
        self.servers = nats_servers(url)
        # Credentials travel in the URL (`nats_permissions.with_credentials`); logs see it redacted.
        self.url = redacted(",".join(self.servers))
        user = url_user(self.url)
        self.inbox_prefix = inbox(user) if user else _DEFAULT_INBOX
        self.replicas = deployment_replicas() if replicas is None else replicas
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
            servers=self.servers,
            name=self.name,
            inbox_prefix=self.inbox_prefix,
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
        if self._nc is not None and self._nc.is_closed:
            return  # our own close, not a lost server
        log.warning("nats.disconnected", url=self.url)

    async def _on_reconnect(self) -> None:
        server = self._nc.connected_url if self._nc is not None else None
        log.info("nats.reconnected", server=server.netloc if server else "")

    async def close(self) -> None:
        """Stop subscriptions, flush and close."""
        await stop_all(list(self._subscriptions))
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
        """Create missing streams at `replicas`; an existing stream that differs raises `StreamDriftError`.

        Replicas are a floor, not drift: a stream with fewer is scaled up, one with more is kept.
        A stream another process created a moment earlier counts as existing.
        """
        for spec in specs:
            await self._setting_up(f"stream {spec.name}", functools.partial(self._ensure_stream, spec))

    async def _ensure_stream(self, spec: StreamSpec) -> None:
        try:
            info = await self.js.stream_info(spec.name)
        except nats.js.errors.NotFoundError:
            if await self._add_stream(spec):
                return
            info = await self.js.stream_info(spec.name)
        check_drift(spec, info.config)
        await self._scale_up(info.config)

    async def _setting_up(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """A stream or bucket lookup/creation, retried while the JetStream API is late or away.

        A cluster that just formed, or one electing a new meta leader after a node died, leaves
        API requests unanswered for a few seconds; every step here is idempotent, so it is retried
        within `publish_retry_s` instead of failing the service's start.
        """

        def failed(exc: Exception) -> BusError:
            return BusError(
                f"setting up {what}: JetStream did not answer within {self.publish_retry_s}s ({exc!r})"
            )

        async def attempt(_left_s: float) -> T:
            return await call()

        return await retrying(self.publish_retry_s, attempt, failed)

    async def _add_stream(self, spec: StreamSpec) -> bool:
        """Create a stream; False when another process created it first."""
        try:
            await self.js.add_stream(stream_config(spec, self.replicas))
        except nats.js.errors.APIError as exc:
            if exc.err_code == _STREAM_NAME_IN_USE:
                return False
            raise self._replication_error(f"create stream {spec.name}", exc) from exc
        return True

    async def _scale_up(self, have: api.StreamConfig) -> None:
        """Raise a stream (or a bucket's stream) to `replicas` if it has fewer."""
        raised = scaled_up(have, self.replicas)
        if raised is None:
            return
        try:
            await self.js.update_stream(raised)
        except nats.js.errors.APIError as exc:
            raise self._replication_error(f"scale stream {have.name} up", exc) from exc
        log.info("stream.scaled_up", stream=have.name, replicas=self.replicas, had=have.num_replicas or 1)

    def _replication_error(self, what: str, exc: nats.js.errors.APIError) -> BusError:
        """The server's refusal, and what a replicated deployment needs when that is the likely cause."""
        hint = f"; {self.replicas} replicas need a cluster of {self.replicas} or more servers"
        return BusError(f"cannot {what}: {exc.description}{hint if self.replicas > 1 else ''}")

    # --- publishing ------------------------------------------------------------------------------

    async def publish(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        msg_id: str,
        budget_s: float | None = None,
        expect: LastOnSubject | None = None,
    ) -> PubAck:
        """Publish and await the ack; retry timeouts with the same msg id until the budget ends.

        A conditional publish that lost its race reads what beat it (see `_lost_race`).
        """
        if expect is None:
            return await self._publish_raw(subject, encode(message), msg_id, budget_s)
        condition = {
            api.Header.EXPECTED_STREAM.value: expect.stream,
            api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(expect.seq),
        }
        try:
            return await self._publish_raw(subject, encode(message), msg_id, budget_s, condition)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _WRONG_LAST_SEQUENCE:
                raise
            raise await self._lost_race(subject, expect, exc.description or "") from exc

    async def _lost_race(
        self, subject: str, expect: LastOnSubject, refusal: str
    ) -> LastSequenceMismatchError:
        """The error for a conditional publish that lost: up to `_NEWER_READ` messages that beat it.

        The refusal names the subject's last sequence ("wrong last sequence: 42"); the messages in
        between are read one request each, which is cheap for the few a race leaves.
        """
        last = refusal.rsplit(":", 1)[-1].strip()
        last_seq = int(last) if last.isdigit() else 0
        newer: list[Delivery] = []
        after = expect.seq
        while after < last_seq and len(newer) < _NEWER_READ:
            try:
                msg = await self.js.get_msg(expect.stream, seq=after + 1, subject=subject, next=True)
            except (nats.errors.Error, TimeoutError):
                break  # what was read is still right: `complete` tells the caller to read the rest
            after = int(msg.seq or last_seq)
            msg_id = (msg.headers or {}).get(MSG_ID)
            newer.append(Delivery(subject=subject, data=msg.data or b"", stream_seq=after, msg_id=msg_id))
        return LastSequenceMismatchError(subject, expected=expect.seq, last_seq=last_seq, newer=newer)

    async def _publish_raw(
        self,
        subject: str,
        payload: bytes,
        msg_id: str,
        budget_s: float | None = None,
        condition: dict[str, str] | None = None,
    ) -> PubAck:
        headers = {MSG_ID: msg_id, **(condition or {})}

        async def attempt(left_s: float) -> PubAck:
            timeout = max(min(self.publish_timeout_s, left_s), 0.01)
            ack = await self.js.publish(subject, payload, timeout=timeout, headers=headers)
            return PubAck(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))

        return await retrying(
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
            except (*RETRYABLE, nats.js.errors.TooManyStalledMsgsError):
                futures.append(None)
        done = await gather_acks(futures, self.publish_timeout_s)
        acks: list[PubAck] = []
        for (subject, payload, msg_id), ack in zip(payloads, done, strict=True):
            acks.append(ack if ack is not None else await self._publish_raw(subject, payload, msg_id))
        return acks

    # --- consuming -------------------------------------------------------------------------------

    async def subscribe(self, spec: ConsumerSpec, handler: Handler) -> Subscription:
        """Start a pull-consumer loop that settles each message by the handler's outcome."""
        sub = PullSubscription(self, spec, handler)
        await sub.start()
        self._subscriptions.append(sub)
        return sub

    def _live_subscriptions(self) -> list[Subscription]:
        return list(self._subscriptions)

    async def replay(self, stream: str, filter_subject: str) -> list[Delivery]:
        """Read every stored message under a filter (see `replay.replay`)."""
        return await replay(self.js, stream, filter_subject)

    async def dead_letter(self, msg: Msg, reason: str) -> None:
        """Copy a message that will never be handled to its dead-letter subject."""
        msg_id = (msg.headers or {}).get(MSG_ID) or f"seq-{msg.metadata.sequence.stream}"
        headers = {MSG_ID: f"dlq:{msg_id}", DLQ_REASON: reason[:512]}
        await self.js.publish(dead_letter(msg.subject), msg.data, headers=headers)

    # --- kv, objects, request-reply --------------------------------------------------------------

    async def kv(self, spec: BucketSpec) -> KeyValue:
        """Open or create the bucket."""
        bucket = await self._setting_up(f"bucket {spec.name}", functools.partial(self._open_bucket, spec))
        return NatsKeyValue(bucket, self.publish_retry_s, js=self.js, name=spec.name)

    async def _open_bucket(self, spec: BucketSpec) -> Any:
        try:
            bucket = await self.js.key_value(spec.name)
        except nats.js.errors.BucketNotFoundError:
            return await self.js.create_key_value(
                bucket=spec.name, history=spec.history, replicas=self.replicas
            )
        await self._scale_up((await self.js.stream_info(f"KV_{spec.name}")).config)
        return bucket

    async def put_object(self, bucket: str, name: str, data: bytes) -> None:
        """Store a blob (chunked by the object store)."""
        await put_object(self.js, bucket, name, data, self.replicas)

    async def get_object(self, bucket: str, name: str) -> bytes:
        """Read a blob; `KeyError` when absent."""
        return await get_object(self.js, bucket, name, self.replicas)

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
        # Once this returns the server knows the subscription: a request sent right after (from
        # any connection) finds its responder instead of "no responders". Disconnected, the client
        # sends it on reconnect anyway.
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self.nc.flush(timeout=max(1, int(self.publish_timeout_s)))
        served = CoreSubscription(sub)
        self._subscriptions.append(served)
        return served


# JetStream's error code for a failed `Nats-Expected-Last-Subject-Sequence` (or -Sequence) check.
_WRONG_LAST_SEQUENCE = 10071
# At most this many messages that beat a conditional publish are read into its error.
_NEWER_READ = 16

"""The bus interface every service codes against, and the error types that decide acknowledgement.

A handler's outcome decides what happens to a message (as in FastStream): returning acks it,
`TransientError` naks it with a delay (it comes back, up to `max_deliver` times), `PermanentError`
(or a `ContractError` while decoding) terminates it and copies it to the dead-letter subject.
Any other exception is treated as transient: a bug should not silently drop data.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Literal, TypeVar

import msgspec

from harnessrl.shared.contracts import decode
from harnessrl.shared.subjects import ALL_STREAMS, BucketSpec, StreamSpec

M = TypeVar("M")


class BusError(RuntimeError):
    """Base of every bus failure."""


class PublishError(BusError):
    """A publish was not acknowledged by JetStream within the retry budget."""


class StreamDriftError(BusError):
    """An existing stream's configuration differs from the one this build expects."""


class KeyExistsError(BusError):
    """`create` found the key already present."""


class RevisionMismatchError(BusError):
    """`update` lost an optimistic-concurrency race."""


class LastSequenceMismatchError(BusError):
    """A conditional publish (`LastOnSubject`) found another message last on its subject: it lost a race.

    `last_seq` is the stream sequence of the subject's last message now. `newer` holds the subject's
    messages after the expected one, oldest first: all of them when `complete`, else only the first
    few (`replay` reads the rest). One of them may be the message itself, stored by an attempt whose
    ack was lost (JetStream checks the expectation before `Nats-Msg-Id` dedupe).
    """

    def __init__(self, subject: str, *, expected: int, last_seq: int, newer: list[Delivery]) -> None:
        super().__init__(f"{subject}: expected its last message at {expected}, found {last_seq}")
        self.subject = subject
        self.expected = expected
        self.last_seq = last_seq
        self.newer = newer

    @property
    def complete(self) -> bool:
        """Whether `newer` holds every message after the expected one."""
        return bool(self.newer) and self.newer[-1].stream_seq == self.last_seq


class TransientError(Exception):
    """The handler could not process the message now; redeliver it after `delay` seconds."""

    def __init__(self, message: str = "", *, delay: float = 1.0) -> None:
        super().__init__(message)
        self.delay = delay


class PermanentError(Exception):
    """The message can never be processed; terminate it and copy it to the dead-letter subject."""


class PubAck(msgspec.Struct, frozen=True, kw_only=True):
    """JetStream's acknowledgement of one publish."""

    stream: str
    seq: int
    duplicate: bool = False


class LastOnSubject(msgspec.Struct, frozen=True, kw_only=True):
    """The condition of a conditional publish: the subject's last message in `stream` is at `seq`.

    `seq` is a stream sequence (a `PubAck.seq`, a `Delivery.stream_seq`); 0 means the subject holds
    no message yet. The server checks it atomically with the write
    (`Nats-Expected-Last-Subject-Sequence`), so of two publishes that expect the same last message
    exactly one is stored: an append-only log per subject with no gaps and no forks.
    """

    stream: str
    seq: int


class Outgoing(msgspec.Struct, frozen=True, kw_only=True):
    """One message to publish: subject, contract and the business key used as `Nats-Msg-Id`."""

    subject: str
    message: msgspec.Struct
    msg_id: str


class Delivery(msgspec.Struct, kw_only=True):
    """One message handed to a handler."""

    subject: str
    data: bytes
    stream_seq: int = 0
    num_delivered: int = 1
    msg_id: str | None = None

    def decode(self, kind: type[M]) -> M:
        """Decode the payload; a `ContractError` here terminates the message."""
        return decode(self.data, kind)


class ConsumerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A pull consumer. `durable=None` makes an ephemeral one (e.g. each gateway replica)."""

    stream: str
    filter_subject: str
    durable: str | None = None
    deliver: Literal["all", "new", "last_per_subject"] = "all"
    max_deliver: int = 5
    ack_wait_s: float = 30.0
    batch: int = 64
    queue: str | None = None


class KvEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A key-value entry with the revision used for optimistic concurrency."""

    key: str
    value: bytes
    revision: int


Handler = Callable[[Delivery], Awaitable[None]]
Responder = Callable[[bytes], Awaitable[bytes]]


class Backlog(msgspec.Struct, frozen=True, kw_only=True):
    """How far one consumer is behind its stream (its lag)."""

    consumer: str  # the durable name, or the filter subject of an ephemeral consumer
    pending: int  # stored under the filter, not delivered yet
    unacked: int  # delivered, neither acknowledged nor given up yet


class Subscription(abc.ABC):
    """A running consumer or responder; `stop()` drains and ends it."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop receiving; in-flight handler calls finish first."""

    async def backlog(self) -> Backlog | None:
        """The consumer's lag (None for what has none: a responder, a consumer not bound yet)."""
        return None


async def stop_all(subscriptions: Iterable[Subscription]) -> None:
    """Stop subscriptions together.

    A pull consumer's stop waits out its pending fetch (up to 1 s): one after another, a service
    with several consumers took seconds to stop.
    """
    await asyncio.gather(*(sub.stop() for sub in subscriptions))


class KeyValue(abc.ABC):
    """A JetStream KV bucket (or its in-memory twin)."""

    @abc.abstractmethod
    async def get(self, key: str) -> KvEntry | None:
        """The current entry, or None when absent or deleted."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes) -> int:
        """Write unconditionally; returns the new revision."""

    @abc.abstractmethod
    async def create(self, key: str, value: bytes) -> int:
        """Write only if absent; raises `KeyExistsError` otherwise."""

    @abc.abstractmethod
    async def update(self, key: str, value: bytes, revision: int) -> int:
        """Write only if the current revision is `revision`; raises `RevisionMismatchError`."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the key (absent keys are fine)."""

    @abc.abstractmethod
    async def keys(self) -> list[str]:
        """Every live key."""


class Bus(abc.ABC):
    """Publish, consume, replay, KV, objects and request-reply over JetStream."""

    @abc.abstractmethod
    async def connect(self) -> None:
        """Connect (reconnecting forever afterwards)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop every subscription and disconnect."""

    @abc.abstractmethod
    async def ensure_streams(self, specs: Sequence[StreamSpec] = ALL_STREAMS) -> None:
        """Create missing streams; raise `StreamDriftError` when an existing one differs."""

    @abc.abstractmethod
    async def publish(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        msg_id: str,
        budget_s: float | None = None,
        expect: LastOnSubject | None = None,
    ) -> PubAck:
        """Publish and await the JetStream ack, retrying timeouts with the same `msg_id`.

        `budget_s` bounds the whole publish, retries included (default: the bus's retry budget);
        past it, `PublishError`. With `expect` the message is stored only if the subject's last
        message is the expected one, else `LastSequenceMismatchError` (not retried: the caller
        decides what to publish instead).
        """

    @abc.abstractmethod
    async def publish_batch(self, items: Sequence[Outgoing]) -> list[PubAck]:
        """Publish many messages with pipelined acks; all acked or `PublishError`."""

    @abc.abstractmethod
    async def subscribe(self, spec: ConsumerSpec, handler: Handler) -> Subscription:
        """Run `handler` for every message; its outcome decides the ack (see module doc)."""

    @abc.abstractmethod
    async def replay(self, stream: str, filter_subject: str) -> list[Delivery]:
        """Every message currently stored under `filter_subject`, in stream order, unacked."""

    @abc.abstractmethod
    async def kv(self, spec: BucketSpec) -> KeyValue:
        """Open (creating if needed) a KV bucket."""

    @abc.abstractmethod
    async def put_object(self, bucket: str, name: str, data: bytes) -> None:
        """Store a large blob in the object store."""

    @abc.abstractmethod
    async def get_object(self, bucket: str, name: str) -> bytes:
        """Read a blob back; raises `KeyError` when absent."""

    @abc.abstractmethod
    async def request(self, subject: str, payload: bytes, *, timeout: float = 5.0) -> bytes:
        """Core-NATS request-reply; raises `BusError` on timeout or no responder."""

    @abc.abstractmethod
    async def serve(self, subject: str, responder: Responder, *, queue: str = "") -> Subscription:
        """Answer requests on `subject` (a queue group shares the load)."""

    async def backlogs(self) -> list[Backlog]:
        """The lag of every stream consumer this bus runs (one a moment's query can't answer is left out)."""
        found = [await sub.backlog() for sub in self._live_subscriptions()]
        return [backlog for backlog in found if backlog is not None]

    @abc.abstractmethod
    def _live_subscriptions(self) -> list[Subscription]:
        """The subscriptions started and not stopped."""

    @property
    @abc.abstractmethod
    def connected(self) -> bool:
        """Whether the bus is connected right now (for readiness probes)."""

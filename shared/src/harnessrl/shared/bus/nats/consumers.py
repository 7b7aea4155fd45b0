"""JetStream consumers: pull-consumer fetch loops, core subscriptions, and settling each message.

A handler's outcome maps to ack / nak with a delay / term + dead-letter (see `bus.base` and
`bus.outcome`). A pull consumer the server lost (a restart without its store) is recreated.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from harnessrl.shared.bus.base import Backlog, ConsumerSpec, Delivery, Handler, Subscription
from harnessrl.shared.bus.outcome import settle
from harnessrl.shared.log import get_logger

if TYPE_CHECKING:
    from harnessrl.shared.bus.nats.client import NatsBus

log = get_logger(__name__)

MSG_ID = "Nats-Msg-Id"
DLQ_REASON = "Hrl-Dlq-Reason"
# A handler still running after this share of its consumer's ack wait says so to the server (+WPI).
WORKING_FRACTION = 1 / 3
DELIVER = {
    "all": api.DeliverPolicy.ALL,
    "new": api.DeliverPolicy.NEW,
    "last_per_subject": api.DeliverPolicy.LAST_PER_SUBJECT,
}


def delivery(msg: Msg) -> Delivery:
    """A received message as handlers see it (stream seq and delivery count from its ack metadata)."""
    meta = msg.metadata if msg.reply else None
    return Delivery(
        subject=msg.subject,
        data=msg.data,
        stream_seq=meta.sequence.stream if meta else 0,
        num_delivered=meta.num_delivered if meta else 1,
        msg_id=(msg.headers or {}).get(MSG_ID),
    )


class Settler:
    """Settles one JetStream message: ack, nak with a delay, or dead-letter then term."""

    def __init__(self, bus: NatsBus, msg: Msg) -> None:
        self.bus, self.msg = bus, msg

    async def ack(self) -> None:
        await self.msg.ack()

    async def nak(self, delay: float) -> None:
        await self.msg.nak(delay=delay)

    async def term(self, reason: str) -> None:
        await self.bus.dead_letter(self.msg, reason)
        await self.msg.term()


class CoreSubscription(Subscription):
    """A core NATS subscription (request-reply serving), ended by unsubscribing."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def stop(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()


class PullSubscription(Subscription):
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
            deliver_policy=DELIVER[spec.deliver],
            ack_wait=spec.ack_wait_s,
            max_deliver=spec.max_deliver,
            filter_subject=spec.filter_subject,
            inactive_threshold=None if spec.durable else 60.0,
            max_ack_pending=max(spec.batch * 4, 256),
        )
        if spec.durable:
            await self._update_durable(spec.durable, config)
        self._psub = await self.bus.js.pull_subscribe(
            spec.filter_subject, durable=spec.durable, stream=spec.stream, config=config
        )

    async def _update_durable(self, durable: str, config: api.ConsumerConfig) -> None:
        """Bring an existing durable consumer's ack wait and redelivery limit to this spec's.

        Binding keeps the configuration a consumer was created with, so without this a release
        that changes either would never reach a deployment's consumers.
        """
        try:
            info = await self.bus.js.consumer_info(self.spec.stream, durable)
        except nats.js.errors.NotFoundError:
            return
        wanted = (config.ack_wait, config.max_deliver)
        if (info.config.ack_wait, info.config.max_deliver) != wanted:
            info.config.ack_wait, info.config.max_deliver = wanted
            await self.bus.js.add_consumer(self.spec.stream, config=info.config)
            log.info("consumer.updated", durable=durable, ack_wait_s=wanted[0], max_deliver=wanted[1])

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
                await self._handle(msg)

    async def _handle(self, msg: Msg) -> None:
        """Settle one message, telling the server it is still being worked on while the handler runs.

        So `ack_wait_s` bounds how long a delivery lost with its worker (killed, or its fetch reply
        lost with a NATS node) waits for redelivery, not how long a handler may take.
        """
        working = asyncio.create_task(self._keep_working(msg))
        try:
            await settle(delivery(msg), self.handler, self.spec.max_deliver, Settler(self.bus, msg))
        finally:
            working.cancel()

    async def _keep_working(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(self.spec.ack_wait_s * WORKING_FRACTION)
            # A lost one costs a redelivery (settled again idempotently), as a dead worker's would.
            with contextlib.suppress(nats.errors.Error, OSError):
                await msg.in_progress()

    async def _rebind(self) -> None:
        log.info("consumer.rebind", filter=self.spec.filter_subject, durable=self.spec.durable)
        try:
            await self._bind()
        except (nats.errors.Error, OSError) as exc:
            log.warning("consumer.rebind_failed", error=str(exc))
            await asyncio.sleep(0.5)

    async def backlog(self) -> Backlog | None:
        """Pending and unacknowledged messages as the server counts them (None once stopped)."""
        if self._stopping or self._psub is None:
            return None
        try:
            info = await self._psub.consumer_info()
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            log.warning("consumer.info_failed", filter=self.spec.filter_subject, error=str(exc))
            return None
        return Backlog(
            consumer=self.spec.durable or self.spec.filter_subject,
            pending=info.num_pending or 0,
            unacked=info.num_ack_pending or 0,
        )

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            # A handler still running 2 s on is cancelled: its message, unsettled, is redelivered.
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), timeout=2.0)
            if not self._task.done():
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        if self._psub is not None:
            # Ends only our inbox subscription; a durable consumer stays on the server.
            with contextlib.suppress(nats.errors.Error):
                await self._psub.unsubscribe()

"""Reading a stream's stored messages under a filter, with a throwaway no-ack consumer."""

from __future__ import annotations

import contextlib

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from harnessrl.shared.bus.base import Delivery
from harnessrl.shared.bus.nats.consumers import delivery


async def replay(js: JetStreamContext, stream: str, filter_subject: str) -> list[Delivery]:
    """Every stored message under `filter_subject`, oldest first.

    An exact subject with nothing stored (a new episode's spans: the gateway's first sight of
    every episode) costs one request and no consumer.
    """
    if not _has_wildcard(filter_subject) and not await _stored(js, stream, filter_subject):
        return []
    config = api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.ALL,
        inactive_threshold=30.0,
        filter_subject=filter_subject,
    )
    psub = await js.pull_subscribe(filter_subject, stream=stream, config=config)
    name = ""
    try:
        info = await psub.consumer_info()
        name, pending = info.name, info.num_pending or 0
        out: list[Delivery] = []
        while len(out) < pending:
            msgs = await psub.fetch(min(pending - len(out), 512), timeout=5)
            out.extend(delivery(m) for m in msgs)
        return out
    finally:
        with contextlib.suppress(nats.errors.Error):
            await psub.unsubscribe()
        # Gone now, not `inactive_threshold` later: replays come by the hundred per second
        # (every new episode the gateway sees, every rollout the trainer reads), and the
        # server refuses new consumers once about a thousand linger.
        if name:
            with contextlib.suppress(nats.errors.Error):
                await js.delete_consumer(stream, name)


async def _stored(js: JetStreamContext, stream: str, subject: str) -> bool:
    """Whether `stream` holds any message on the exact `subject`."""
    try:
        await js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return False
    return True


def _has_wildcard(subject: str) -> bool:
    return any(token in ("*", ">") for token in subject.split("."))

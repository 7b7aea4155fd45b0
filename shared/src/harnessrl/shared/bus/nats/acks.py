"""The acks of a batch of asynchronous JetStream publishes, awaited together."""

from __future__ import annotations

import asyncio

from nats.js import api

from harnessrl.shared.bus.base import PubAck


async def gather_acks(
    futures: list[asyncio.Future[api.PubAck] | None], timeout: float
) -> list[PubAck | None]:
    """Each publish's ack, or None where it failed, was never sent, or missed `timeout` (cancelled)."""
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

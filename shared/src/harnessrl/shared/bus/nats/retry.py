"""Riding out lost or late replies from NATS within a time budget (publishes and KV calls alike)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from harnessrl.shared.bus.base import BusError

T = TypeVar("T")

# What a retry can cure: the server, or the reply, was late or briefly away.
RETRYABLE = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


async def retrying(
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
        except RETRYABLE as exc:
            if time.monotonic() + delay > deadline:
                raise failed(exc) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

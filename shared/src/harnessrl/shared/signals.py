"""Running a service until it is told to stop: the one stop-and-signal loop every service uses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable
from typing import Protocol


class Service(Protocol):
    """What a process runs: started once, stopped once (stop also runs after a failed start)."""

    async def start(self) -> None:
        """Begin consuming and serving."""

    async def stop(self) -> None:
        """Finish what is in flight and release everything."""


async def run_until_signalled(
    service: Service, *, finished: Awaitable[None] | None = None, stop: asyncio.Event | None = None
) -> None:
    """Start `service`, wait for SIGTERM/SIGINT, `stop`, or `finished` to end, then stop it.

    An exception raised by `finished` propagates after the service has been stopped.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(stop.wait())
    done = asyncio.ensure_future(finished) if finished is not None else None
    try:
        await service.start()
        await asyncio.wait({waiter, *([done] if done else [])}, return_when=asyncio.FIRST_COMPLETED)
        if done is not None and done.done():
            done.result()
    finally:
        waiter.cancel()
        if done is not None and not done.done():
            done.cancel()
        await service.stop()


def signal_group(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send `sig` to the process group led by `pid`, if it still exists.

    Harnesses, tests and vLLM start children of their own; signalling the group reaches every one
    (a group outlives its leader while a child still runs).
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)

"""When a local deployment is serving: its controller answers and its run's trainer has subscribed.

A started process is not yet a serving one: the controller answers requests and the trainer
subscribes to its run's rollouts seconds after their processes start. `harnessrl up` says `up:` only
once both hold, so a command typed right after it (`harnessrl run submit`, `harnessrl train
--nats-url`) finds them serving instead of "no service answers" or "no trainer has subscribed".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import nats.js.errors

from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus import BusError, NatsBus
from harnessrl.stack.supervisor import SupervisorError


async def controller_answers(bus: NatsBus) -> bool:
    """Whether a controller answers a status request now."""
    try:
        await bus.request(control_api.subject("status"), control_api.encode(control_api.StatusRequest()))
    except BusError:
        return False
    return True


async def trainer_subscribed(bus: NatsBus, run: str) -> bool:
    """Whether the run's trainer has its durable consumer on ROLLOUTS."""
    try:
        await bus.js.consumer_info(subjects.ROLLOUTS.name, subjects.trainer_consumer(run))
    except nats.js.errors.NotFoundError:
        return False
    return True


async def _serving(nats_url: str, run: str | None, check: Callable[[], None], timeout_s: float) -> None:
    bus = NatsBus(nats_url)
    await bus.connect()
    try:
        await bus.ensure_streams()
        deadline = time.monotonic() + timeout_s
        while not await controller_answers(bus) or (
            run is not None and not await trainer_subscribed(bus, run)
        ):
            if time.monotonic() > deadline:
                waits = "the controller" + (f" and the trainer of run {run}" if run else "")
                raise SupervisorError(f"{waits} did not start serving within {timeout_s:.0f} s: see the logs")
            await asyncio.to_thread(check)
            await asyncio.sleep(0.5)
    finally:
        await bus.close()


def wait_serving(nats_url: str, run: str | None, check: Callable[[], None], timeout_s: float = 300.0) -> None:
    """Block until the controller answers and (given `run`) that run's trainer has subscribed.

    `check` runs between polls (the supervisor's crash check, which raises when a service keeps
    crashing), so a service that cannot start fails this at once instead of at the timeout.
    """
    asyncio.run(_serving(nats_url, run, check, timeout_s))

"""The weight book over a real nats-server: a step that carries the previous weights is no new version."""

from __future__ import annotations

import asyncio

from harnessrl.gateway.weights import WeightBook
from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus
from harnessrl.shared.contracts import WeightVersion
from harnessrl.shared.ids import new_id


async def announce(bus: Bus, run: str, version: int, step: int, *, carries_previous: bool = False) -> None:
    """What the trainer publishes for a step (msg id as its own: a carried step adds the step)."""
    message = WeightVersion(run=run, version=version, step=step, carries_previous=carries_previous)
    msg_id = f"{run}:{version}:step-{step}" if carries_previous else f"{run}:{version}"
    await bus.publish(subjects.weights(run), message, msg_id=msg_id)


async def seen(book: WeightBook, run: str, version: int) -> None:
    for _ in range(250):
        if book.version(run) == version:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"book at {book.version(run)}, expected {version}")


async def test_carried_announcements_keep_the_version_for_followers_and_late_starters(bus: Bus) -> None:
    run = new_id("wrun")
    following = WeightBook(bus)
    await following.start()
    try:
        await announce(bus, run, 1, 1)
        await seen(following, run, 1)
        await announce(bus, run, 1, 2, carries_previous=True)
        await announce(bus, run, 2, 3)
        await announce(bus, run, 2, 4, carries_previous=True)
        await seen(following, run, 2)
        await asyncio.sleep(0.2)  # anything after version 2's announcement has been read by now
        assert following.version(run) == 2
    finally:
        await following.stop()
    # A gateway starting now reads only the last announcement, a carried one: still version 2.
    late = WeightBook(bus)
    await late.start()
    try:
        await seen(late, run, 2)
    finally:
        await late.stop()

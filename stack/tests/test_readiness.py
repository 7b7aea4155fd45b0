"""`harnessrl up` says `up:` only once its controller answers and its run's trainer has subscribed."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus import ConsumerSpec, Delivery, NatsBus
from harnessrl.stack.natsserver import NatsServer
from harnessrl.stack.readiness import wait_serving
from harnessrl.stack.supervisor import SupervisorError


async def test_nothing_serving_times_out_naming_what_it_waited_for(nats_server: NatsServer) -> None:
    run = f"ready-{os.urandom(3).hex()}"
    with pytest.raises(SupervisorError, match=f"the controller and the trainer of run {run} did not start"):
        await asyncio.to_thread(wait_serving, nats_server.url, run, lambda: None, 2.0)


async def test_a_crash_check_that_raises_ends_the_wait_at_once(nats_server: NatsServer) -> None:
    def crashed() -> None:
        raise SupervisorError("controller keeps crashing")

    with pytest.raises(SupervisorError, match="keeps crashing"):
        await asyncio.to_thread(wait_serving, nats_server.url, None, crashed, 60.0)


async def test_returns_once_the_controller_answers_and_the_trainer_subscribed(
    nats_server: NatsServer, bus: NatsBus
) -> None:
    run = f"ready-{os.urandom(3).hex()}"
    waiting = asyncio.create_task(asyncio.to_thread(wait_serving, nats_server.url, run, lambda: None, 30.0))

    async def status(_request: bytes) -> bytes:
        return json.dumps({"ok": True, "runs": {}}).encode()

    await asyncio.sleep(1.5)
    assert not waiting.done()
    await bus.serve(control_api.subject("status"), status)
    await asyncio.sleep(1.5)
    assert not waiting.done()  # the controller answers; the trainer has not subscribed yet

    async def ignore(_delivery: Delivery) -> None:
        return None

    consumer = ConsumerSpec(
        stream=subjects.ROLLOUTS.name,
        filter_subject=subjects.rollout(run),
        durable=subjects.trainer_consumer(run),
    )
    subscription = await bus.subscribe(consumer, ignore)
    try:
        await asyncio.wait_for(waiting, 10)
    finally:
        await subscription.stop()

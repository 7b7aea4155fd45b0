"""kill -9 of nats-server mid-stream: nothing acknowledged is lost and the durable consumer resumes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import uvloop

from harnessrl.shared import subjects
from harnessrl.shared.bus import ConsumerSpec, Delivery, NatsBus, PublishError
from harnessrl.shared.contracts import WeightVersion
from harnessrl.shared.ids import new_id
from harnessrl.stack.natsserver import NatsServer

TOTAL = 300


async def test_kill_nats_mid_stream_loses_nothing(nats_server: NatsServer) -> None:
    bus = NatsBus(nats_server.url, publish_timeout_s=1.0, publish_retry_s=30.0)
    await bus.connect()
    await bus.ensure_streams()
    run = new_id("crash")
    seen: list[Delivery] = []

    async def handler(delivery: Delivery) -> None:
        seen.append(delivery)

    spec = ConsumerSpec(
        stream=subjects.WEIGHTS.name,
        filter_subject=subjects.weights(run),
        durable=new_id("crash-consumer"),
        ack_wait_s=2.0,
    )
    await bus.subscribe(spec, handler)
    acked: list[int] = []

    async def publisher() -> None:
        for v in range(TOTAL):
            msg = WeightVersion(run=run, version=v, step=v)
            await bus.publish(subjects.weights(run), msg, msg_id=f"{run}:{v}")
            acked.append(v)

    task = asyncio.create_task(publisher())
    while len(acked) < TOTAL // 3:
        await asyncio.sleep(0.005)
    await asyncio.to_thread(nats_server.kill)
    assert not task.done()
    await asyncio.sleep(0.5)
    await asyncio.to_thread(nats_server.start)
    await asyncio.wait_for(task, timeout=60)
    assert acked == list(range(TOTAL))

    stored = await bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
    versions = [d.decode(WeightVersion).version for d in stored]
    assert sorted(versions) == list(range(TOTAL)), "every acked message stored exactly once"

    for _ in range(600):
        if {d.decode(WeightVersion).version for d in seen} == set(range(TOTAL)):
            break
        await asyncio.sleep(0.05)
    assert {d.decode(WeightVersion).version for d in seen} == set(range(TOTAL))
    await bus.close()


def test_close_after_losing_the_server_is_clean(tmp_path: Path) -> None:
    """A bus whose server died (publishes were buffered for the reconnect) still closes without an
    error, as a service shutting down after its NATS does needs (run on uvloop, as services are)."""
    server = NatsServer(tmp_path)
    server.start()

    async def lose_server_then_close() -> float:
        bus = NatsBus(server.url, publish_timeout_s=0.2)
        await bus.connect()
        await bus.ensure_streams([subjects.WEIGHTS])
        subject = subjects.weights("lost")
        spec = ConsumerSpec(stream=subjects.WEIGHTS.name, filter_subject=subject, durable="lost")
        await bus.subscribe(spec, _ignore)
        server.kill()
        with pytest.raises(PublishError):
            await bus.publish(subject, WeightVersion(run="lost", version=1, step=1), msg_id="m", budget_s=0.5)
        started = time.monotonic()
        await bus.close()
        return time.monotonic() - started

    try:
        assert uvloop.run(lose_server_then_close()) < 5
    finally:
        server.stop()


async def _ignore(delivery: Delivery) -> None:
    del delivery


async def test_kv_keys_right_after_a_restart_list_every_live_key(nats_server: NatsServer) -> None:
    """A restarted controller lists its runs from KV at once: every live key, no deleted one.

    (A CI run once saw a restarted controller resume no run; nats-py's watcher-based `keys()`,
    which can end before it has seen what the server pushed, is no longer used.)
    """
    bucket = subjects.BucketSpec(name=new_id("kv"))
    writer = NatsBus(nats_server.url)
    await writer.connect()
    kv = await writer.kv(bucket)
    for i in range(300):
        await kv.put(f"ep.{i:03d}", b"x" * 200)
    for i in range(0, 300, 3):
        await kv.delete(f"ep.{i:03d}")
    await writer.close()
    live = sorted(f"ep.{i:03d}" for i in range(300) if i % 3)
    await asyncio.to_thread(nats_server.stop)
    await asyncio.to_thread(nats_server.start)
    for _ in range(10):
        reader = NatsBus(nats_server.url)
        await reader.connect()
        assert sorted(await (await reader.kv(bucket)).keys()) == live
        await reader.close()


async def test_streams_and_buckets_set_up_while_the_server_is_away_for_a_moment(
    nats_server: NatsServer,
) -> None:
    """A service starting while its NATS restarts (or a cluster elects a meta leader, as a CI run
    saw: `stream_info` unanswered within 1 s) waits it out instead of crashing at start."""
    bus = NatsBus(nats_server.url, publish_timeout_s=0.5, publish_retry_s=30.0)
    await bus.connect()
    await asyncio.to_thread(nats_server.kill)

    async def back_after_a_while() -> None:
        await asyncio.sleep(2.0)
        await asyncio.to_thread(nats_server.start)

    comeback = asyncio.create_task(back_after_a_while())
    bucket = subjects.BucketSpec(name=new_id("kv"))
    await bus.ensure_streams([subjects.WEIGHTS])
    kv = await bus.kv(bucket)
    await comeback
    await kv.put("k", b"v")
    assert (await bus.js.stream_info(subjects.WEIGHTS.name)).config.name == subjects.WEIGHTS.name
    await bus.close()

"""One behavioural suite for the bus, run against the in-memory twin and a real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import nats.errors
import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus import (
    Bus,
    ConsumerSpec,
    Delivery,
    KeyExistsError,
    MemoryBus,
    NatsBus,
    Outgoing,
    PermanentError,
    PublishError,
    RevisionMismatchError,
    StreamDriftError,
    TransientError,
)
from harnessrl.shared.bus.base import LastOnSubject, LastSequenceMismatchError
from harnessrl.shared.contracts import WeightVersion
from harnessrl.shared.ids import new_id
from harnessrl.shared.subjects import StreamSpec
from harnessrl.stack.natsserver import NatsServer


@pytest.fixture(params=["memory", "nats"])
async def any_bus(request: pytest.FixtureRequest, nats_server: NatsServer) -> AsyncIterator[Bus]:
    client: Bus
    client = MemoryBus() if request.param == "memory" else NatsBus(nats_server.url, publish_retry_s=10.0)
    await client.connect()
    await client.ensure_streams()
    yield client
    await client.close()


def weight(run: str, version: int) -> WeightVersion:
    return WeightVersion(run=run, version=version, step=version)


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def collect(
    bus: Bus, run: str, behaviour: Callable[[Delivery], Awaitable[None]] | None = None, **kw: object
) -> list[Delivery]:
    seen: list[Delivery] = []

    async def handler(delivery: Delivery) -> None:
        seen.append(delivery)
        if behaviour is not None:
            await behaviour(delivery)

    spec = ConsumerSpec(
        stream=subjects.WEIGHTS.name,
        filter_subject=subjects.weights(run),
        durable=new_id("dur"),
        **kw,  # type: ignore[arg-type]
    )
    await bus.subscribe(spec, handler)
    return seen


async def test_publish_then_consume_in_order(any_bus: Bus) -> None:
    run = new_id("run")
    for v in range(5):
        await any_bus.publish(subjects.weights(run), weight(run, v), msg_id=f"{run}:{v}")
    seen = await collect(any_bus, run)
    await eventually(lambda: len(seen) == 5)
    assert [d.decode(WeightVersion).version for d in seen] == [0, 1, 2, 3, 4]


async def test_retried_publish_is_deduplicated(any_bus: Bus) -> None:
    run = new_id("run")
    first = await any_bus.publish(subjects.weights(run), weight(run, 1), msg_id="same")
    again = await any_bus.publish(subjects.weights(run), weight(run, 1), msg_id="same")
    assert not first.duplicate and again.duplicate and again.seq == first.seq
    replayed = await any_bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
    assert len(replayed) == 1


async def test_batch_publish_acks_everything(any_bus: Bus) -> None:
    run = new_id("run")
    items = [
        Outgoing(subject=subjects.weights(run), message=weight(run, v), msg_id=f"{run}:{v}")
        for v in range(200)
    ]
    acks = await any_bus.publish_batch(items)
    assert len(acks) == 200 and not any(a.duplicate for a in acks)
    replayed = await any_bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
    assert [d.decode(WeightVersion).version for d in replayed] == list(range(200))


async def test_transient_error_redelivers(any_bus: Bus) -> None:
    run = new_id("run")

    async def fail_first(delivery: Delivery) -> None:
        if delivery.num_delivered == 1:
            raise TransientError("not yet", delay=0.1)

    seen = await collect(any_bus, run, fail_first)
    await any_bus.publish(subjects.weights(run), weight(run, 1), msg_id=f"{run}:1")
    await eventually(lambda: len(seen) == 2)
    await asyncio.sleep(0.3)
    assert [d.num_delivered for d in seen] == [1, 2]


async def test_permanent_error_goes_to_dead_letter(any_bus: Bus) -> None:
    run = new_id("run")

    async def refuse(delivery: Delivery) -> None:
        raise PermanentError("never")

    seen = await collect(any_bus, run, refuse)
    await any_bus.publish(subjects.weights(run), weight(run, 1), msg_id=f"{run}:1")
    await eventually(lambda: len(seen) == 1)
    dlq = subjects.dead_letter(subjects.weights(run))
    await eventually_async(lambda: any_bus.replay(subjects.DLQ.name, dlq), 1)
    await asyncio.sleep(0.3)
    assert len(seen) == 1


async def test_garbage_payload_is_dead_lettered_not_crashing(any_bus: Bus) -> None:
    run = new_id("run")
    decoded: list[int] = []

    async def decode(delivery: Delivery) -> None:
        decoded.append(delivery.decode(WeightVersion).version)

    await collect(any_bus, run, decode)
    await any_bus.publish(
        subjects.weights(run),
        weight(run, 1).__class__(run=run, version=1, step=1, schema=99),
        msg_id="bad",
    )
    await any_bus.publish(subjects.weights(run), weight(run, 2), msg_id="good")
    await eventually(lambda: decoded == [2])
    dlq = subjects.dead_letter(subjects.weights(run))
    await eventually_async(lambda: any_bus.replay(subjects.DLQ.name, dlq), 1)


async def test_exhausted_redeliveries_are_dead_lettered(any_bus: Bus) -> None:
    run = new_id("run")

    async def always_busy(delivery: Delivery) -> None:
        raise TransientError("busy", delay=0.05)

    seen = await collect(any_bus, run, always_busy, max_deliver=3)
    await any_bus.publish(subjects.weights(run), weight(run, 1), msg_id=f"{run}:1")
    dlq = subjects.dead_letter(subjects.weights(run))
    await eventually_async(lambda: any_bus.replay(subjects.DLQ.name, dlq), 1)
    assert [d.num_delivered for d in seen] == [1, 2, 3]


async def test_durable_consumers_share_work(any_bus: Bus) -> None:
    run = new_id("run")
    durable = new_id("shared")
    got: list[tuple[str, int]] = []

    def handler_for(name: str) -> Callable[[Delivery], Awaitable[None]]:
        async def handle(delivery: Delivery) -> None:
            got.append((name, delivery.decode(WeightVersion).version))

        return handle

    spec = ConsumerSpec(stream=subjects.WEIGHTS.name, filter_subject=subjects.weights(run), durable=durable)
    await any_bus.subscribe(spec, handler_for("a"))
    await any_bus.subscribe(spec, handler_for("b"))
    for v in range(40):
        await any_bus.publish(subjects.weights(run), weight(run, v), msg_id=f"{run}:{v}")
    await eventually(lambda: len(got) >= 40)
    await asyncio.sleep(0.2)
    assert sorted(v for _, v in got) == list(range(40))


async def test_kv_optimistic_concurrency(any_bus: Bus) -> None:
    kv = await any_bus.kv(subjects.BucketSpec(name=new_id("kv")))
    rev = await kv.create("ep-1", b"scheduled")
    with pytest.raises(KeyExistsError):
        await kv.create("ep-1", b"again")
    rev2 = await kv.update("ep-1", b"started", rev)
    with pytest.raises(RevisionMismatchError):
        await kv.update("ep-1", b"stale", rev)
    entry = await kv.get("ep-1")
    assert entry is not None and entry.value == b"started" and entry.revision == rev2
    assert await kv.keys() == ["ep-1"]
    await kv.delete("ep-1")
    assert await kv.get("ep-1") is None


async def test_objects_round_trip(any_bus: Bus) -> None:
    blob = bytes(range(256)) * 2000
    await any_bus.put_object(subjects.ARTIFACTS_BUCKET, "run/ep/patch", blob)
    assert await any_bus.get_object(subjects.ARTIFACTS_BUCKET, "run/ep/patch") == blob
    with pytest.raises(KeyError):
        await any_bus.get_object(subjects.ARTIFACTS_BUCKET, "run/ep/missing")


async def test_request_reply(any_bus: Bus) -> None:
    subject = subjects.control("test", new_id("verb"))

    async def echo(payload: bytes) -> bytes:
        return payload[::-1]

    await any_bus.serve(subject, echo, queue="q")
    assert await any_bus.request(subject, b"abc") == b"cba"


async def test_stream_drift_is_reported(any_bus: Bus) -> None:
    drifted = StreamSpec(
        name=subjects.WEIGHTS.name, subjects=subjects.WEIGHTS.subjects, duplicate_window_s=30.0
    )
    with pytest.raises(StreamDriftError):
        await any_bus.ensure_streams([drifted])
    await any_bus.ensure_streams()


async def eventually_async(read: Callable[[], Awaitable[list[Delivery]]], count: int) -> None:
    for _ in range(200):
        if len(await read()) == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"expected {count} messages")


class _LossyBucket:
    """A nats KV bucket whose next writes lose their reply (after landing) or fail before sending."""

    def __init__(self, bucket: object) -> None:
        self.bucket = bucket
        self.lose_reply = 0
        self.fail_before = 0

    async def _write(self, call: Callable[[], Awaitable[int]]) -> int:
        if self.fail_before:
            self.fail_before -= 1
            raise nats.errors.TimeoutError
        revision = await call()
        if self.lose_reply:
            self.lose_reply -= 1
            raise nats.errors.TimeoutError
        return revision

    async def create(self, key: str, value: bytes) -> int:
        return await self._write(lambda: self.bucket.create(key, value))  # type: ignore[attr-defined, no-any-return]

    async def update(self, key: str, value: bytes, last: int) -> int:
        return await self._write(lambda: self.bucket.update(key, value, last=last))  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self.bucket, name)


async def test_kv_writes_ride_out_lost_replies(nats_server: NatsServer) -> None:
    bus = NatsBus(nats_server.url, publish_retry_s=10.0)
    await bus.connect()
    try:
        kv = await bus.kv(subjects.BucketSpec(name=new_id("kv")))
        lossy = _LossyBucket(kv._kv)  # type: ignore[attr-defined]
        kv._kv = lossy  # type: ignore[attr-defined]
        lossy.lose_reply = 1
        rev = await kv.create("ep-1", b"scheduled")  # landed, reply lost: not "already exists"
        lossy.lose_reply = 1
        rev2 = await kv.update("ep-1", b"started", rev)  # landed, reply lost: not a conflict
        lossy.fail_before = 2
        rev3 = await kv.update("ep-1", b"exited", rev2)  # never sent: sent again
        entry = await kv.get("ep-1")
        assert entry is not None and entry.value == b"exited" and entry.revision == rev3 > rev2 > rev
        assert lossy.lose_reply == lossy.fail_before == 0
        with pytest.raises(RevisionMismatchError):  # a real conflict is still one
            await kv.update("ep-1", b"someone else", rev2)
        with pytest.raises(KeyExistsError):
            await kv.create("ep-1", b"again")
    finally:
        await bus.close()


async def test_a_working_handler_keeps_its_message_and_a_dead_one_loses_it_within_the_ack_wait(
    nats_server: NatsServer,
) -> None:
    """A handler running past `ack_wait_s` says it is still working, so a second worker on the same
    durable is not handed the message; a worker that dies mid-handler loses it within `ack_wait_s`."""
    bus = NatsBus(nats_server.url, publish_retry_s=10.0)
    await bus.connect()
    try:
        await bus.ensure_streams([subjects.WEIGHTS])
        run = new_id("run")
        spec = ConsumerSpec(
            stream=subjects.WEIGHTS.name, filter_subject=subjects.weights(run), durable=new_id("work"),
            ack_wait_s=1.0, batch=1,
        )  # fmt: skip
        got: list[tuple[str, int, int]] = []

        Handle = Callable[[Delivery], Awaitable[None]]

        def worker(name: str, behaviour: Callable[[], Awaitable[object]]) -> Handle:
            async def handle(delivery: Delivery) -> None:
                got.append((name, delivery.decode(WeightVersion).version, delivery.num_delivered))
                await behaviour()

            return handle

        slow = await bus.subscribe(spec, worker("slow", lambda: asyncio.sleep(3.5)))
        await bus.publish(subjects.weights(run), weight(run, 0), msg_id=f"{run}:0")
        await eventually(lambda: bool(got))
        other = await bus.subscribe(spec, worker("other", lambda: asyncio.sleep(0)))
        await asyncio.sleep(4.0)  # 3.5 ack waits
        assert got == [("slow", 0, 1)]
        await slow.stop()
        await other.stop()

        dying = await bus.subscribe(spec, worker("dying", asyncio.Event().wait))
        await bus.publish(subjects.weights(run), weight(run, 1), msg_id=f"{run}:1")
        await eventually(lambda: len(got) == 2)
        await bus.subscribe(spec, worker("next", lambda: asyncio.sleep(0)))
        await dying.stop()  # the worker dies mid-handler (cancelled after 2 s), its message unsettled
        await eventually(lambda: len(got) == 3, timeout=5.0)
        assert got[1:] == [("dying", 1, 1), ("next", 1, 2)]
    finally:
        await bus.close()


async def test_binding_a_durable_brings_its_ack_wait_and_redelivery_limit_to_the_spec(
    nats_server: NatsServer,
) -> None:
    """A release that shortens a consumer's ack wait reaches the consumer a deployment already has."""
    bus = NatsBus(nats_server.url, publish_retry_s=10.0)
    await bus.connect()
    try:
        await bus.ensure_streams([subjects.WEIGHTS])
        old = ConsumerSpec(
            stream=subjects.WEIGHTS.name, filter_subject=subjects.weights(new_id("run")),
            durable=new_id("kept"), ack_wait_s=360.0, max_deliver=5,
        )  # fmt: skip
        await (await bus.subscribe(old, _ignore)).stop()
        new = msgspec.structs.replace(old, ack_wait_s=30.0, max_deliver=-1)
        await bus.subscribe(new, _ignore)
        info = await bus.js.consumer_info(old.stream, str(old.durable))
        assert (info.config.ack_wait, info.config.max_deliver) == (30.0, -1)
        assert info.config.filter_subject == old.filter_subject
    finally:
        await bus.close()


async def test_publish_budget_bounds_the_retries(nats_server: NatsServer) -> None:
    bus = NatsBus(nats_server.url, publish_retry_s=30.0)
    await bus.connect()
    await bus.ensure_streams([subjects.WEIGHTS])
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(PublishError, match="not acknowledged"):  # no stream takes it: retried
            await bus.publish("nowhere.stored", weight("r", 1), msg_id="m-1", budget_s=0.5)
        assert 0.3 < loop.time() - started < 2.0  # its own budget, not the bus's 30 s
        ack = await bus.publish(subjects.weights("budget"), weight("budget", 1), msg_id="m-2", budget_s=0.5)
        assert ack.seq > 0 and not ack.duplicate
    finally:
        await bus.close()


async def test_replay_leaves_no_consumer_behind(nats_server: NatsServer) -> None:
    bus = NatsBus(nats_server.url)
    await bus.connect()
    name = new_id("REPLAY").replace("-", "_")
    stream = StreamSpec(name=name, subjects=[f"{name}.>"])
    await bus.ensure_streams([stream])
    try:
        await bus.publish(f"{name}.a", weight("r", 1), msg_id="m-1")
        for _ in range(5):  # the gateway replays for every new episode, the trainer for every rollout
            assert len(await bus.replay(name, f"{name}.a")) == 1
        assert await bus.replay(name, f"{name}.b") == []  # nothing stored: answered without a consumer
        assert [d.subject for d in await bus.replay(name, f"{name}.>")] == [f"{name}.a"]
        assert (await bus.js.stream_info(name)).state.consumer_count == 0
    finally:
        await bus.js.delete_stream(name)
        await bus.close()


async def test_conditional_publish_stores_only_against_the_subjects_last_message(any_bus: Bus) -> None:
    run, other = new_id("run"), new_id("run")
    subject = subjects.weights(run)
    first = await any_bus.publish(
        subject, weight(run, 0), msg_id=f"{run}:0", expect=LastOnSubject(stream="WEIGHTS", seq=0)
    )
    await any_bus.publish(subjects.weights(other), weight(other, 0), msg_id=f"{other}:0")  # per subject
    with pytest.raises(LastSequenceMismatchError) as lost:  # a second writer that saw no message
        await any_bus.publish(
            subject, weight(run, 9), msg_id=f"{run}:9", expect=LastOnSubject(stream="WEIGHTS", seq=0)
        )
    assert lost.value.last_seq == first.seq and lost.value.complete
    assert [(d.msg_id, d.stream_seq) for d in lost.value.newer] == [(f"{run}:0", first.seq)]
    second = await any_bus.publish(
        subject, weight(run, 1), msg_id=f"{run}:1", expect=LastOnSubject(stream="WEIGHTS", seq=first.seq)
    )
    replayed = await any_bus.replay(subjects.WEIGHTS.name, subject)
    assert [d.decode(WeightVersion).version for d in replayed] == [0, 1]
    assert replayed[-1].stream_seq == second.seq


async def test_conditional_publish_retried_after_a_lost_ack_finds_itself(any_bus: Bus) -> None:
    """A retry of a stored conditional publish: deduplicated, or refused naming the message itself."""
    run = new_id("run")
    subject, expect = subjects.weights(run), LastOnSubject(stream="WEIGHTS", seq=0)
    first = await any_bus.publish(subject, weight(run, 0), msg_id=f"{run}:0", expect=expect)
    try:
        again = await any_bus.publish(subject, weight(run, 0), msg_id=f"{run}:0", expect=expect)
    except LastSequenceMismatchError as lost:  # JetStream checks the expectation first
        assert [d.msg_id for d in lost.newer] == [f"{run}:0"]
    else:
        assert again.duplicate and again.seq == first.seq
    assert len(await any_bus.replay(subjects.WEIGHTS.name, subject)) == 1


async def test_a_lost_race_names_the_messages_that_beat_it_oldest_first(any_bus: Bus) -> None:
    run = new_id("run")
    subject = subjects.weights(run)
    acks = [await any_bus.publish(subject, weight(run, v), msg_id=f"{run}:{v}") for v in range(40)]
    with pytest.raises(LastSequenceMismatchError) as lost:
        await any_bus.publish(
            subject,
            weight(run, 99),
            msg_id=f"{run}:99",
            expect=LastOnSubject(stream="WEIGHTS", seq=acks[9].seq),
        )
    assert lost.value.last_seq == acks[-1].seq
    newer = [d.decode(WeightVersion).version for d in lost.value.newer]
    assert newer == list(range(10, 10 + len(newer))) and newer  # a prefix of what came after
    assert lost.value.complete == (len(newer) == 30)


async def test_backlog_counts_what_a_consumer_has_not_received_and_not_settled(any_bus: Bus) -> None:
    run = new_id("run")
    release = asyncio.Event()
    started: list[int] = []

    async def slow(delivery: Delivery) -> None:
        started.append(delivery.stream_seq)
        await release.wait()

    for version in range(1, 11):
        await any_bus.publish(subjects.weights(run), weight(run, version), msg_id=f"{run}:{version}")
    durable = f"lag-{run}"
    spec = ConsumerSpec(
        stream=subjects.WEIGHTS.name, filter_subject=subjects.weights(run), durable=durable, batch=1
    )
    sub = await any_bus.subscribe(spec, slow)
    await eventually(lambda: len(started) == 1)
    (backlog,) = [b for b in await any_bus.backlogs() if b.consumer == durable]
    # One message in the handler; the rest wait (NATS counts a fetched batch as unacked).
    assert backlog.pending + backlog.unacked >= 9 and backlog.pending <= 9
    release.set()
    await eventually(lambda: len(started) == 10)

    async def drained() -> bool:
        found = [b for b in await any_bus.backlogs() if b.consumer == durable]
        return found[0].pending == 0 and found[0].unacked == 0

    for _ in range(100):
        if await drained():
            break
        await asyncio.sleep(0.05)
    assert await drained()
    await sub.stop()
    assert not [b for b in await any_bus.backlogs() if b.consumer == durable]


async def _ignore(_: Delivery) -> None:
    """A handler that settles every message as done."""

"""NatsBus on a three-node JetStream cluster: R3 streams and buckets, and a node killed -9 mid-traffic.

The kill tests publish with msg ids from a task while one node dies and comes back, then replay the
stream: every acknowledged message is stored exactly once and a durable consumer saw them all.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import nats
import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus import BusError, ConsumerSpec, Delivery, NatsBus
from harnessrl.shared.bus.nats.streams import REPLICAS_ENV
from harnessrl.shared.contracts import WeightVersion
from harnessrl.shared.ids import new_id
from harnessrl.shared.log import get_logger
from harnessrl.shared.subjects import StreamSpec
from harnessrl.stack.natsserver import NatsCluster, NatsServer

log = get_logger(__name__)
TOTAL = 2000


@pytest.fixture
async def cluster_bus(nats_cluster: NatsCluster) -> AsyncIterator[NatsBus]:
    """A bus given every node's URL, with R3 streams, that retries a lost ack after a second."""
    bus = NatsBus(nats_cluster.urls, publish_timeout_s=1.0, publish_retry_s=30.0, replicas=3)
    await bus.connect()
    await bus.ensure_streams()
    yield bus
    await bus.close()


def test_url_lists_and_replicas_come_from_the_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPLICAS_ENV, raising=False)
    bus = NatsBus(" nats://a:1, nats://b:2 ,")
    assert bus.servers == ["nats://a:1", "nats://b:2"] and bus.replicas == 1
    assert NatsBus(["nats://a:1", "nats://b:2"]).url == "nats://a:1,nats://b:2"
    monkeypatch.setenv(REPLICAS_ENV, "3")
    assert NatsBus("nats://a:1").replicas == 3
    assert NatsBus("nats://a:1", replicas=1).replicas == 1
    monkeypatch.setenv(REPLICAS_ENV, "three")
    with pytest.raises(ValueError, match=REPLICAS_ENV):
        NatsBus("nats://a:1")


async def test_streams_and_buckets_are_r3_on_the_cluster(cluster_bus: NatsBus) -> None:
    for spec in subjects.ALL_STREAMS:
        info = await cluster_bus.js.stream_info(spec.name)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and info.cluster.leader and len(info.cluster.replicas or []) == 2
    bucket = subjects.BucketSpec(name=new_id("kv"))
    await (await cluster_bus.kv(bucket)).put("k", b"v")
    assert (await cluster_bus.js.stream_info(f"KV_{bucket.name}")).config.num_replicas == 3
    store = new_id("obj")
    await cluster_bus.put_object(store, "o", b"data")
    assert (await cluster_bus.js.stream_info(f"OBJ_{store}")).config.num_replicas == 3


async def test_fewer_replicas_are_raised_more_are_kept(
    cluster_bus: NatsBus, nats_cluster: NatsCluster
) -> None:
    spec = StreamSpec(name=new_id("LOW"), subjects=[f"{new_id('low')}.>"])
    single = NatsBus(nats_cluster.url, replicas=1)
    await single.connect()
    try:
        await single.ensure_streams([spec])
        assert (await single.js.stream_info(spec.name)).config.num_replicas == 1
        await cluster_bus.ensure_streams([spec])
        assert (await single.js.stream_info(spec.name)).config.num_replicas == 3
        await single.ensure_streams([spec])  # a client told 1 never shrinks it
        assert (await single.js.stream_info(spec.name)).config.num_replicas == 3
    finally:
        await single.js.delete_stream(spec.name)
        await single.close()


async def test_replicas_on_a_single_server_are_refused_clearly(nats_server: NatsServer) -> None:
    bus = NatsBus(nats_server.url, replicas=3)
    await bus.connect()
    try:
        with pytest.raises(BusError, match="3 replicas need a cluster"):
            await bus.ensure_streams([StreamSpec(name=new_id("R3"), subjects=[f"{new_id('r3')}.>"])])
    finally:
        await bus.close()


@pytest.mark.parametrize("victim", ["stream-leader", "client-node"])
async def test_node_killed_mid_traffic_loses_and_duplicates_nothing(
    cluster_bus: NatsBus, nats_cluster: NatsCluster, victim: str
) -> None:
    run = new_id("cluster")
    seen: set[int] = set()

    async def handler(delivery: Delivery) -> None:
        seen.add(delivery.decode(WeightVersion).version)

    durable = new_id("cluster-consumer")
    spec = ConsumerSpec(
        stream=subjects.WEIGHTS.name, filter_subject=subjects.weights(run), durable=durable, ack_wait_s=2.0
    )
    await cluster_bus.subscribe(spec, handler)
    acked: list[tuple[int, float]] = []

    async def publisher() -> None:
        for v in range(TOTAL):
            msg = WeightVersion(run=run, version=v, step=v)
            await cluster_bus.publish(subjects.weights(run), msg, msg_id=f"{run}:{v}")
            acked.append((v, time.monotonic()))

    task = asyncio.create_task(publisher())
    await _until(lambda: len(acked) >= TOTAL // 3)
    node = await _victim(cluster_bus, nats_cluster, victim)
    killed_at = time.monotonic()
    try:
        await asyncio.to_thread(node.kill)
        await _until(lambda: len(acked) >= 2 * TOTAL // 3, timeout_s=60)
        await asyncio.to_thread(node.restart, 30.0)
        await asyncio.wait_for(task, timeout=120)  # generous: a loaded 2-core machine
    finally:
        if not node.healthy():
            await asyncio.to_thread(node.restart, 30.0)
    assert [v for v, _ in acked] == list(range(TOTAL))
    stored = await cluster_bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
    versions = [d.decode(WeightVersion).version for d in stored]
    assert sorted(versions) == list(range(TOTAL)), "every acked message stored exactly once"
    await _until(lambda: seen == set(range(TOTAL)), timeout_s=30)
    times = [t for _, t in acked]
    gap = max(b - a for a, b in itertools.pairwise(times) if b >= killed_at)
    log.info("cluster.failover", victim=victim, longest_ack_gap_s=round(gap, 2), messages=TOTAL)
    assert gap < 20  # measured: 7.6 s for a stream leader's election, 1 s for the client's node
    await cluster_bus.js.delete_consumer(subjects.WEIGHTS.name, durable)


async def _victim(bus: NatsBus, cluster: NatsCluster, victim: str) -> NatsServer:
    """The node to kill: the WEIGHTS leader, or the client's own server, made a follower first."""
    info = await bus.js.stream_info(subjects.WEIGHTS.name)
    assert info.cluster is not None and info.cluster.leader
    if victim == "stream-leader":
        return cluster.node(info.cluster.leader)
    connected = bus.nc.connected_url
    assert connected is not None
    mine = next(node for node in cluster.nodes if node.port == connected.port)
    if mine.name == info.cluster.leader:
        await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{subjects.WEIGHTS.name}", b"", timeout=5)
        await _until_async(lambda: _leader_is_not(bus, mine.name))
    return mine


async def _leader_is_not(bus: NatsBus, server: str) -> bool:
    try:
        info = await bus.js.stream_info(subjects.WEIGHTS.name)
    except (TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
        return False  # mid-election the stream's info request goes unanswered: ask again
    return info.cluster is not None and bool(info.cluster.leader) and info.cluster.leader != server


async def _until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def _until_async(condition: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)

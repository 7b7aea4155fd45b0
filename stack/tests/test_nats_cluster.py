"""A local JetStream cluster: started only once a meta leader leads it, one node killed and restarted,
and `harnessrl up --nats-cluster 3` handing every service the URL list and the replica count, so
what the services create is replicated too."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nats.js.errors
import psutil
import pytest

from harnessrl.shared.bus import NatsBus
from harnessrl.stack.cli import build_parser
from harnessrl.stack.natsserver import NatsCluster, NatsServer
from harnessrl.stack.supervisor import read_state


def jsz(node: NatsServer) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", node.monitor_port, timeout=2)
    try:
        conn.request("GET", "/jsz")
        return dict(json.loads(conn.getresponse().read()))
    finally:
        conn.close()


def test_a_cluster_is_ready_once_a_meta_leader_leads_it(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path, 3)
    first = cluster.nodes[0]
    try:
        first.launch()
        time.sleep(1.0)
        assert not first.healthy(), "a lone member of a three-node cluster has no meta leader"
        for node in cluster.nodes[1:]:
            node.launch()
        for node in cluster.nodes:
            node.wait_ready(60)  # generous: an election on a loaded 2-core machine
        # Ready means a meta leader with a quorum (two of three); the third peer joins the meta group's
        # view a moment later on a loaded machine (seen: cluster_size 2 just after every node was ready).
        meta = jsz(first)["meta_cluster"]
        deadline = time.monotonic() + 30
        while meta.get("cluster_size") != 3 and time.monotonic() < deadline:
            time.sleep(0.5)
            meta = jsz(first)["meta_cluster"]
        assert meta["cluster_size"] == 3 and meta["leader"] in {n.name for n in cluster.nodes}
        assert len({n.name for n in cluster.nodes}) == 3 and len({n.store_dir for n in cluster.nodes}) == 3

        leader = cluster.node(meta["leader"])
        victim = next(n for n in cluster.nodes if n is not leader)
        victim.kill()
        survivors = [n for n in cluster.nodes if n is not victim]
        for node in survivors:  # losing a follower keeps the quorum: they stay (or become) healthy
            node.wait_ready(30)
        assert jsz(leader)["meta_cluster"]["leader"] == leader.name, "losing a follower keeps the leader"
        victim.restart(30)
        assert all(n.healthy() for n in cluster.nodes)
    finally:
        cluster.stop()


def test_up_takes_a_cluster_size() -> None:
    parser = build_parser()
    assert parser.parse_args(["up", "--nats-cluster", "3"]).nats_cluster == 3
    assert parser.parse_args(["up"]).nats_cluster == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--nats-cluster", "0"])


def test_up_with_a_cluster_hands_every_service_the_url_list_and_replicas(tmp_path: Path) -> None:
    home = tmp_path / "home"
    cli = str(Path(sys.executable).parent / "harnessrl")
    up = subprocess.Popen(
        [cli, "up", "--home", str(home), "--nats-cluster", "3"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(up.stderr or []), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C stops" not in "".join(lines):
            assert up.poll() is None and time.monotonic() < deadline, "".join(lines)[-2000:]
            time.sleep(0.2)
        urls = re.findall(r"nats://127\.0\.0\.1:\d+", "".join(lines))
        assert len(set(urls)) == 3
        for state in read_state(home):
            environ = Path(f"/proc/{state.pid}/environ").read_bytes().split(b"\0")
            assert b"HRL_NATS_REPLICAS=3" in environ, state.name
            prefix = f"HRL_{state.name.upper()}_NATS_URL=".encode()
            assert prefix + ",".join(urls).encode() in environ, state.name
        asyncio.run(_expect_replicated(urls))
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0, "".join(lines)[-2000:]
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(home) in " ".join(p.info["cmdline"] or [])]
    assert left == [], "every nats-server and service stopped with `up`"


async def _expect_replicated(urls: list[str]) -> None:
    """Streams are R3 (laid out by the stack), and so are the buckets the controller created itself."""
    bus = NatsBus(urls, replicas=1)  # an onlooker: it neither creates nor scales anything
    await bus.connect()
    try:
        assert (await bus.js.stream_info("SPANS")).config.num_replicas == 3
        deadline = time.monotonic() + 60
        while True:
            replicas = {
                name: info.config.num_replicas
                for name in ("KV_hrl-episodes", "KV_hrl-controller-lease")
                if (info := await _stream_info(bus, name)) is not None
            }
            if len(replicas) == 2:
                break
            assert time.monotonic() < deadline, f"the controller created only {replicas}"
            await asyncio.sleep(0.2)
        assert set(replicas.values()) == {3}
    finally:
        await bus.close()


async def _stream_info(bus: NatsBus, name: str) -> Any:
    try:
        return await bus.js.stream_info(name)
    except nats.js.errors.NotFoundError:  # not created yet
        return None

"""The kube-proxy stand-in of `make cluster-check`: each connection to the next pod, dead pods skipped.

The proxy script runs here as it runs in its container (`python3 service_proxy.py CONFIG`), in
front of plain TCP servers that answer with their own name; the Service-to-listener mapping is
checked on the chart's rendered local-cpu scenario.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from harnessrl.testkit import cluster, service_proxy
from harnessrl.testkit.cluster import PROXY_SCRIPT, free_port


def _named_server(name: str) -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(16)
                conn.sendall(name.encode())

    threading.Thread(target=serve, daemon=True).start()
    return server, int(server.getsockname()[1])


def _ask(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"hello")
        conn.shutdown(socket.SHUT_WR)
        return conn.recv(64).decode()


@pytest.fixture
def proxy() -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A proxy over pods a and b and one port nothing listens on."""
    (a, port_a), (b, port_b) = _named_server("a"), _named_server("b")
    listen, dead = free_port("127.0.0.1"), free_port("127.0.0.1")
    backends = [["127.0.0.1", port_a], ["127.0.0.1", dead], ["127.0.0.1", port_b]]
    config = {"listeners": [{"port": listen, "backends": backends}]}
    process = subprocess.Popen(
        [sys.executable, str(PROXY_SCRIPT), json.dumps(config)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().startswith("serving")
    yield listen, process
    process.terminate()
    process.wait(10)
    a.close()
    b.close()


def test_connections_go_to_each_pod_in_turn_and_a_dead_one_is_skipped(
    proxy: tuple[int, subprocess.Popen[str]],
) -> None:
    port, process = proxy
    answers = [_ask(port) for _ in range(6)]
    # Turns a, dead (so the next: b), b, a, dead -> b, b: both pods serve, none is lost.
    assert answers == ["a", "b", "b", "a", "b", "b"]
    process.terminate()
    log = process.communicate(timeout=10)[0]
    assert log.count("connect ") == 6


def test_every_clusterip_service_gets_a_proxy_and_headless_ones_resolve_to_pods() -> None:
    objects = cluster.render()
    gateway = next(w for w in cluster.workloads(objects) if w.component == "gateway")
    labels = gateway.template["metadata"]["labels"]
    (service,) = cluster.services_of(objects, labels)
    config = cluster.proxy_config(service, gateway.template["spec"]["containers"][0], ["g-0", "g-1"])
    http = next(int(p["containerPort"]) for p in gateway.template["spec"]["containers"][0]["ports"])
    assert [item["backends"] for item in config["listeners"]] == [[["g-0", http], ["g-1", http]]] * 2
    assert cluster.service_aliases(objects, labels, "g-0") == []  # the gateway's names are the proxy's
    vllm = next(w for w in cluster.workloads(objects) if w.component == "vllm")
    names = cluster.service_aliases(objects, vllm.template["metadata"]["labels"], f"{vllm.name}-0")
    assert f"{vllm.name}-0.{vllm.service_name}.{cluster.NAMESPACE}.svc" in names


def test_a_connection_waits_for_a_pod_that_comes_up() -> None:
    """With no pod answering, a connection is held (trying each round again) until one does."""
    late, listen = free_port("127.0.0.1"), free_port("127.0.0.1")
    config = {"listeners": [{"port": listen, "backends": [["127.0.0.1", late]]}]}
    process = subprocess.Popen(
        [sys.executable, str(PROXY_SCRIPT), json.dumps(config)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().startswith("serving")
        timer = threading.Timer(1.0, lambda: _serve_on(late, "late"))
        timer.start()
        assert _ask(listen) == "late"
    finally:
        process.terminate()
        process.wait(10)


def _serve_on(port: int, name: str) -> None:
    server = socket.create_server(("127.0.0.1", port))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(16)
            conn.sendall(name.encode())
        server.close()

    threading.Thread(target=serve, daemon=True).start()


async def test_a_pod_whose_name_stops_resolving_is_reached_at_its_last_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """podman's DNS fails names for a moment while containers start; kube-proxy would not care."""
    server, port = _named_server("a")
    listener = service_proxy.Listener(9, [("localhost", port)])
    first = await listener._connect()
    assert first is not None and first[0] == "localhost"
    first[3].close()

    def no_dns(*_: object, **__: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    again = await listener._connect()
    assert again is not None
    again[3].close()
    server.close()

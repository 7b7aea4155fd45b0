"""The kube-proxy stand-in of `make cluster-check`: connections spread over the pods, dead pods skipped.

The proxy script runs here as it runs in its container (`python3 service_proxy.py CONFIG`), in
front of plain TCP servers that answer with their own name; the Service-to-listener mapping is
checked on the chart's rendered local-cpu scenario.
"""

from __future__ import annotations

import contextlib
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


def _proxy_over(*ports: int) -> contextlib.AbstractContextManager[tuple[int, subprocess.Popen[str]]]:
    """The proxy script in front of these local ports (by name): its listening port and its process."""
    return _proxy([["127.0.0.1", port, ""] for port in ports])


@contextlib.contextmanager
def _proxy(backends: list[list[object]]) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """The proxy script in front of these backends (name, port, address): its port and its process."""
    listen = free_port("127.0.0.1")
    config = {"listeners": [{"port": listen, "backends": backends}]}
    process = subprocess.Popen(
        [sys.executable, str(PROXY_SCRIPT), json.dumps(config)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().startswith("serving")
        yield listen, process
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def proxy() -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A proxy over pods a and b and one port nothing listens on."""
    (a, port_a), (b, port_b) = _named_server("a"), _named_server("b")
    with _proxy_over(port_a, free_port("127.0.0.1"), port_b) as proxied:
        yield proxied
    a.close()
    b.close()


def test_connections_spread_over_the_pods_and_a_dead_one_is_skipped(
    proxy: tuple[int, subprocess.Popen[str]],
) -> None:
    port, process = proxy
    answers = [_ask(port) for _ in range(40)]
    # Every connection is served (the dead backend is skipped), and both pods take a share.
    assert set(answers) == {"a", "b"}
    process.terminate()
    log = process.communicate(timeout=10)[0]
    assert log.count("connect ") == 40
    # Each time the dead pod was drawn, the skip was logged with why.
    skips = [line for line in log.splitlines() if line.startswith("skip ")]
    assert skips and all("ConnectionRefusedError" in line for line in skips)


def test_episodes_run_one_after_another_reach_both_pods() -> None:
    """An episode opens two connections (its calls, then its upload): a strict turn over two pods
    sends every episode's calls to one of them (a cluster check saw 53 calls on one gateway, none on
    the other).
    """
    (a, port_a), (b, port_b) = _named_server("a"), _named_server("b")
    with _proxy_over(port_a, port_b) as (port, _):
        calls = []
        for _ in range(30):
            calls.append(_ask(port))
            _ask(port)  # the episode's artifact upload
    a.close()
    b.close()
    assert set(calls) == {"a", "b"}


def test_every_clusterip_service_gets_a_proxy_and_headless_ones_resolve_to_pods() -> None:
    objects = cluster.render()
    gateway = next(w for w in cluster.workloads(objects) if w.component == "gateway")
    labels = gateway.template["metadata"]["labels"]
    (service,) = cluster.services_of(objects, labels)
    endpoints = {"g-0": "10.89.0.7", "g-1": ""}
    config = cluster.proxy_config(service, gateway.template["spec"]["containers"][0], endpoints)
    http = next(int(p["containerPort"]) for p in gateway.template["spec"]["containers"][0]["ports"])
    backends = [["g-0", http, "10.89.0.7"], ["g-1", http, ""]]
    assert [item["backends"] for item in config["listeners"]] == [backends] * 2
    assert cluster.service_aliases(objects, labels, "g-0") == []  # the gateway's names are the proxy's
    vllm = next(w for w in cluster.workloads(objects) if w.component == "vllm")
    names = cluster.service_aliases(objects, vllm.template["metadata"]["labels"], f"{vllm.name}-0")
    assert f"{vllm.name}-0.{vllm.service_name}.{cluster.NAMESPACE}.svc" in names


def test_a_connection_waits_for_a_pod_that_comes_up() -> None:
    """With no pod answering, a connection is held (trying each round again) until one does."""
    late = free_port("127.0.0.1")
    with _proxy_over(late) as (listen, _):
        timer = threading.Timer(1.0, lambda: _serve_on(late, "late"))
        timer.start()
        assert _ask(listen) == "late"


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
    listener = service_proxy.Listener(9, [("localhost", port, "")])
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


def test_pods_are_dialled_at_their_given_address_and_their_names_looked_up_only_when_it_fails() -> None:
    """kube-proxy knows endpoints by address: the proxy must not need DNS for a pod it was given the
    address of (podman's DNS timed out so often under load that one gateway pod got no connection).
    A pod that stops answering at its given address is looked up by name (it may have moved)."""
    (a, port_a), (b, port_b) = _named_server("a"), _named_server("b")
    # Pod a's name never resolves; pod b is not at its given address any more, only at its name.
    backends: list[list[object]] = [["a.invalid", port_a, "127.0.0.1"], ["localhost", port_b, "127.0.0.2"]]
    with _proxy(backends) as (port, process):
        answers = [_ask(port) for _ in range(30)]
        process.terminate()
        log = process.communicate(timeout=10)[0]
    a.close()
    b.close()
    assert set(answers) == {"a", "b"}
    assert "skip " not in log

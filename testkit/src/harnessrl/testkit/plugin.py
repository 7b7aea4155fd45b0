"""The harnessrl pytest plugin: a real nats-server per session and a connected bus per test.

`nats_cluster` is a real three-node JetStream cluster (started only for the tests that ask for it).
Every session ends with the table of where its time went (`harnessrl.testkit.timing`); under xdist
each test file is one unit of work, costliest first (`harnessrl.testkit.parallel`).

Model and vLLM fixtures live in `model_fixtures` and are re-exported here, so every package's tests
get `nats_server`, `bus`, `tiny_model` and `vllm_server` without a conftest.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from harnessrl.shared.bus import NatsBus
from harnessrl.stack.natsserver import NatsCluster, NatsServer
from harnessrl.testkit.model_fixtures import tiny_model, vllm_server

pytest_plugins = ["harnessrl.testkit.timing", "harnessrl.testkit.parallel"]
__all__ = ["bus", "nats_cluster", "nats_server", "open_bus", "say", "tiny_model", "vllm_server"]


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A real nats-server with JetStream on a temporary file store, for the whole session."""
    server = NatsServer(Path(tmp_path_factory.mktemp("nats")))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """Three nats-servers with JetStream clustered on loopback, for the whole session.

    A test that kills a node restarts it before it ends, so the next one finds all three serving.
    """
    cluster = NatsCluster(Path(tmp_path_factory.mktemp("nats-cluster")), 3)
    cluster.start()
    yield cluster
    cluster.stop()


@asynccontextmanager
async def open_bus(url: str) -> AsyncIterator[NatsBus]:
    """A connected NatsBus with every harnessrl stream ensured (publishes retried for 15 s)."""
    client = NatsBus(url, publish_retry_s=15.0)
    await client.connect()
    try:
        await client.ensure_streams()
        yield client
    finally:
        await client.close()


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[NatsBus]:
    """A connected NatsBus with every harnessrl stream ensured."""
    if nats_server.process is None or nats_server.process.poll() is not None:
        nats_server.start()
    async with open_bus(nats_server.url) as client:
        yield client


@pytest.fixture
def say(capsys: pytest.CaptureFixture[str]) -> Callable[[str], None]:
    """Writes a measured figure (a fuzz count, a rate) to the terminal whatever the capture mode.

    Not a log line: an app under test may reconfigure logging and drop pytest's handlers.
    """

    def write(line: str) -> None:
        with capsys.disabled():
            sys.stdout.write(f"\n{line}\n")

    return write

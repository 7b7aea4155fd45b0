"""Gateway test fixtures: episodes with keys and a canned upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from harnessrl.shared.bus import NatsBus
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for
from harnessrl.testkit.plugin import open_bus


@pytest.fixture
def episode() -> KeyedEpisode:
    return KeyedEpisode()


@pytest.fixture
async def canned() -> AsyncIterator[CannedUpstream]:
    upstream = CannedUpstream()
    await upstream.start()
    yield upstream
    await upstream.stop()


@pytest.fixture(scope="module")
async def module_bus(nats_server: NatsServer) -> AsyncIterator[NatsBus]:
    """A bus shared by one module's tests (the gateway's teardown costs a second per bus)."""
    async with open_bus(nats_server.url) as client:
        yield client


@pytest.fixture(scope="module")
async def module_canned() -> AsyncIterator[CannedUpstream]:
    upstream = CannedUpstream()
    await upstream.start()
    yield upstream
    await upstream.stop()


@pytest.fixture(scope="module")
async def canned_gateway(module_canned: CannedUpstream, module_bus: NatsBus) -> AsyncIterator[RunningGateway]:
    """One gateway in front of the canned upstream for a whole module (4 KiB body limit)."""
    settings = settings_for([module_canned.url], max_body_bytes=4096)
    async with serve_gateway(settings, module_bus) as running:
        yield running

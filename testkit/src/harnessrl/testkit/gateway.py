"""Test support: a real gateway over HTTP (uvicorn inside the test's loop), episode keys, spans."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import uvicorn

from harnessrl.gateway.app import server_config
from harnessrl.gateway.asgi_app import GatewayApp, create_app
from harnessrl.gateway.service import Gateway
from harnessrl.gateway.settings import GatewaySettings
from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus
from harnessrl.shared.contracts import Span
from harnessrl.shared.ids import new_id
from harnessrl.shared.keys import sign_episode_key
from harnessrl.shared.net import free_port
from harnessrl.testkit.canned_upstream import CannedUpstream

# Test-only credentials: `settings_for` gives them to the gateway, `KeyedEpisode` signs with the first.
TEST_KEY_SECRET = "test-secret"  # noqa: S105 - signs test episodes' keys; never a real secret
TEST_ADMIN_TOKEN = "admin-token"  # noqa: S105 - the admin routes' bearer token in tests


class KeyedEpisode:
    """A fresh episode id of `run` with its key, signed with `TEST_KEY_SECRET` (valid 10 minutes)."""

    def __init__(self, run: str = "run1") -> None:
        self.run = run
        self.episode = new_id("ep")
        self.key = sign_episode_key(TEST_KEY_SECRET.encode(), run, self.episode, 600)

    async def spans(self, bus: Bus) -> list[Span]:
        """The episode's stored spans in seq order."""
        deliveries = await bus.replay(subjects.SPANS.name, subjects.span(self.run, self.episode))
        return sorted((d.decode(Span) for d in deliveries), key=lambda s: s.seq)


def settings_for(upstreams: list[str], **overrides: Any) -> GatewaySettings:
    """Test settings: the test secret and admin token, quick health probes, no access log."""
    values: dict[str, Any] = {
        "key_secret": TEST_KEY_SECRET,
        "admin_token": TEST_ADMIN_TOKEN,
        "upstreams": upstreams,
        "access_log": False,
        "health_interval_s": 0.2,
        "shutdown_grace_s": 2,
        **overrides,
    }
    return GatewaySettings(**values)


class RunningGateway:
    """A gateway served over HTTP: its app and base URL."""

    def __init__(self, app: GatewayApp, url: str) -> None:
        self.app = app
        self.url = url

    @property
    def gateway(self) -> Gateway:
        """The gateway's running parts."""
        return self.app.gateway


@asynccontextmanager
async def serve_gateway(settings: GatewaySettings, bus: Bus) -> AsyncIterator[RunningGateway]:
    """Run the gateway on a free port with uvicorn inside the test's event loop."""
    app, port = create_app(settings, bus), free_port()
    server = uvicorn.Server(server_config(app, settings, port=port))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield RunningGateway(app, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        await task


@contextmanager
def threaded_canned_upstream(**options: Any) -> Iterator[CannedUpstream]:
    """A canned upstream on its own thread and loop (for sync tests, e.g. hypothesis)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="canned-upstream", daemon=True)
    thread.start()
    upstream = CannedUpstream(**options)
    asyncio.run_coroutine_threadsafe(upstream.start(), loop).result(10)
    try:
        yield upstream
    finally:
        asyncio.run_coroutine_threadsafe(upstream.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

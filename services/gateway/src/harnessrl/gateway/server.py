"""Running the gateway: the app and the uvicorn server behind `harnessrl gateway`."""

from __future__ import annotations

import uvicorn

from harnessrl.gateway.app import GatewayApp, create_app
from harnessrl.gateway.settings import GatewaySettings
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.log import configure_logging


def app_from_settings(settings: GatewaySettings) -> GatewayApp:
    """An app that owns its NatsBus (connected at start-up, closed at shutdown)."""
    return create_app(settings, NatsBus(settings.nats_url, name="harnessrl-gateway"), owns_bus=True)


def server_config(app: GatewayApp, settings: GatewaySettings, *, port: int | None = None) -> uvicorn.Config:
    """The uvicorn configuration the gateway runs with.

    On SIGTERM it stops accepting, lets calls in flight finish for up to `shutdown_grace_s`, then
    cancels the rest (answered 503; a stream already started just ends) and closes the bus. Without that
    bound one call on a replica that never answers (a vLLM stopping at the same moment can leave
    one hanging) keeps the gateway, and through its open connection that replica, alive.
    """
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port if port is None else port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        proxy_headers=False,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )


def serve(settings: GatewaySettings) -> None:
    """Serve until SIGTERM/SIGINT."""
    configure_logging("json", settings.log_level)
    uvicorn.Server(server_config(app_from_settings(settings), settings)).run()

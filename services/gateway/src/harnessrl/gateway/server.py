"""Running the gateway: the app factory used by `harnessrl gateway` and ASGI servers."""

from __future__ import annotations

from pathlib import Path

from harnessrl.gateway.app import GatewayApp, create_app
from harnessrl.gateway.settings import GatewaySettings, load_gateway_settings
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.log import configure_logging


def app_from_settings(settings: GatewaySettings) -> GatewayApp:
    """An app that owns its NatsBus (connected at start-up, closed at shutdown)."""
    return create_app(settings, NatsBus(settings.nats_url, name="harnessrl-gateway"), owns_bus=True)


def app_from_env() -> GatewayApp:
    """ASGI factory: settings from `HRL_GATEWAY_*` (and `HRL_GATEWAY_CONFIG`, a TOML file)."""
    import os

    config = os.environ.get("HRL_GATEWAY_CONFIG")
    settings = load_gateway_settings(Path(config) if config else None)
    configure_logging("json", settings.log_level)
    return app_from_settings(settings)


def serve(settings: GatewaySettings) -> None:
    """Serve until interrupted, with the server named in settings."""
    configure_logging("json", settings.log_level)
    if settings.server == "granian":
        _serve_granian(settings)
        return
    import uvicorn

    uvicorn.run(
        app_from_settings(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        proxy_headers=False,
        log_level="warning",
        lifespan="on",
    )


def _serve_granian(settings: GatewaySettings) -> None:
    """Granian's embedded server: its Rust HTTP layer inside this process's uvloop."""
    import uvloop
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    server = Server(
        app_from_settings(settings),
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        http=HTTPModes.http1,
        log_access=False,
    )
    uvloop.run(server.serve())

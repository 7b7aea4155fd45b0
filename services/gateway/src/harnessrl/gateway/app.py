"""Running the gateway as a process: settings, logging, bus, the ASGI app, uvicorn until signalled.

Unlike the other services the gateway does not use `run_until_signalled`: uvicorn owns the signal
loop. On SIGTERM/SIGINT it stops accepting, gives calls in flight `shutdown_grace_s` to finish,
runs the app's lifespan shutdown (gateway, then bus) and ends the process by the signal it got.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from harnessrl.gateway.settings import GatewaySettings, read_settings
from harnessrl.shared.process import service_main

if TYPE_CHECKING:
    import uvicorn

    from harnessrl.gateway.asgi_app import GatewayApp

# Flags that override settings of the same name (None: not given).
_FLAGS = ("host", "port", "nats_url", "upstreams")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The process options: a config file and the settings most often set by hand."""
    parser.add_argument("--config", help="TOML file with a [gateway] table")
    parser.add_argument("--host", help="listen address")
    parser.add_argument("--port", type=int, help="listen port")
    parser.add_argument("--nats-url", dest="nats_url", help="NATS server URL")
    parser.add_argument("--upstream", dest="upstreams", action="append", help="vLLM base URL")


def run(args: argparse.Namespace) -> int:
    """Load settings and serve until SIGTERM/SIGINT; 2 (and one line on stderr) on bad settings."""
    flags = {name: getattr(args, name) for name in _FLAGS}
    return service_main("gateway", lambda: read_settings(args.config, **flags), serve)


def serve(settings: GatewaySettings) -> None:
    """Serve an app that owns its NatsBus (connected at start-up, closed at shutdown)."""
    # Imported here: `harnessrl --help` must not load the server, Litestar and the bus client.
    import uvicorn

    from harnessrl.gateway.asgi_app import create_app
    from harnessrl.shared.bus import NatsBus

    app = create_app(settings, NatsBus(settings.nats_url, name="harnessrl-gateway"), owns_bus=True)
    uvicorn.Server(server_config(app, settings)).run()


def server_config(app: GatewayApp, settings: GatewaySettings, *, port: int | None = None) -> uvicorn.Config:
    """The uvicorn configuration the gateway runs with (`port` overrides the settings' one).

    On SIGTERM it stops accepting, lets calls in flight finish for up to `shutdown_grace_s`, then
    cancels the rest (answered 503; a stream already started just ends) and closes the bus. Without that
    bound one call on a replica that never answers (a vLLM stopping at the same moment can leave
    one hanging) keeps the gateway, and through its open connection that replica, alive.
    """
    import uvicorn

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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m harnessrl.gateway [--config FILE] [flags]`."""
    parser = argparse.ArgumentParser(prog="python -m harnessrl.gateway", description="Run the LLM gateway.")
    add_arguments(parser)
    return run(parser.parse_args(argv))

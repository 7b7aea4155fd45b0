"""The gateway's ASGI app (what uvicorn serves): harness-facing routes to `Proxy`, the rest to Litestar.

The harness-facing routes (`/v1/...`, `/e/<key>/v1/...`, `/harnessrl/...`) are the hot path: they
go to the raw ASGI `Proxy` without Litestar's router and middleware. Operations (`/healthz`,
`/readyz`, `/metrics`), admin (`/admin/...`) and the lifespan are an ordinary Litestar app.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request, Response, get
from litestar.exceptions import HTTPException

from harnessrl.gateway.admin import admin_router
from harnessrl.gateway.asgi import Receive, Scope, Send
from harnessrl.gateway.errors import error_for_status
from harnessrl.gateway.proxy import Proxy
from harnessrl.gateway.service import Gateway
from harnessrl.gateway.settings import GatewaySettings
from harnessrl.shared.bus.base import Bus

_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


_PROXY_PREFIXES = ("/v1/", "/e/", "/harnessrl/")


class GatewayApp:
    """The ASGI app a server runs: proxy paths to `Proxy`, everything else (and lifespan) to Litestar."""

    def __init__(self, operations: Litestar, proxy: Proxy) -> None:
        self.operations = operations
        self.proxy = proxy
        self.gateway: Gateway = proxy.gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Dispatch on the path; the proxy sees the raw (undecoded) path."""
        if scope["type"] == "http" and scope["path"].startswith(_PROXY_PREFIXES):
            raw_path = scope.get("raw_path")
            if raw_path:
                scope["path"] = raw_path.decode("latin-1")
            await self.proxy(scope, receive, send)
            return
        await self.operations(scope, receive, send)  # type: ignore[arg-type]


def create_app(settings: GatewaySettings, bus: Bus, *, owns_bus: bool = False) -> GatewayApp:
    """Build the gateway app; its lifespan starts and stops the gateway (and the bus if owned)."""
    gateway = Gateway(settings, bus)
    proxy = Proxy(gateway)

    @get("/healthz", sync_to_thread=False)
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @get("/readyz", sync_to_thread=False)
    def readyz() -> Response[dict[str, Any]]:
        """Readiness: bus connected and at least one healthy upstream."""
        ready = gateway.ready
        body = {"ready": ready, "bus": gateway.bus.connected, "upstreams": gateway.pool.any_healthy}
        return Response(body, status_code=200 if ready else 503)

    @get("/metrics", sync_to_thread=False)
    def metrics() -> Response[bytes]:
        """Prometheus exposition."""
        return Response(gateway.metrics.render(), media_type=_PROMETHEUS)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await gateway.start()
        # Start-up objects (modules, the app, clients) never become garbage: out of the collector's
        # sight, a full collection scans only what requests leave behind (shorter tail pauses).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await gateway.stop()
            if proxy.access_log is not None:
                proxy.access_log.flush()
            if owns_bus:
                await bus.close()

    app = Litestar(
        route_handlers=[healthz, readyz, metrics, admin_router(gateway)],
        lifespan=[lifespan],
        exception_handlers={HTTPException: _http_error, RecursionError: _too_deep},
        openapi_config=None,
        debug=False,
    )
    return GatewayApp(app, proxy)


def _too_deep(request: Request[Any, Any, Any], exc: RecursionError) -> Response[bytes]:
    """A body nested past what the JSON decoder recurses through (an admin route's): a 400."""
    error = error_for_status(400, "request body is nested too deeply")
    headers = {k.decode(): v.decode() for k, v in error.headers()}
    return Response(error.body("openai"), status_code=error.status, headers=headers)


def _http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    """Litestar's own errors (unknown route, wrong method) in the OpenAI envelope."""
    if exc.status_code == 404:
        message = f"unknown route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} not allowed"
    else:
        message = str(exc.detail)
        if isinstance(exc.extra, list) and exc.extra:  # a validation error: say what was wrong
            said = (item.get("message", item) if isinstance(item, dict) else item for item in exc.extra)
            message += ": " + "; ".join(map(str, said))
    error = error_for_status(exc.status_code, message)
    headers = {k.decode(): v.decode() for k, v in error.headers()}
    return Response(error.body("openai"), status_code=error.status, headers=headers)

"""Admin routes, behind a token harnesses never see: pause/resume, upstream registration, status.

The trainer pauses the gateway around a weight update: `POST /admin/pause?drain_s=30` holds new
calls and waits until the calls in flight have finished; `POST /admin/resume` releases them.
"""

from __future__ import annotations

import hmac
import urllib.parse
from typing import Any

import msgspec
from litestar import Router, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers import BaseRouteHandler
from litestar.params import FromQuery, JSONBody

from harnessrl.gateway.service import Gateway
from harnessrl.shared.contracts import UpstreamRegistration


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """Body of `POST /admin/upstreams` (the fields of an `UpstreamRegistration`)."""

    url: str
    model: str = ""
    weight_version: int = 0
    active: bool = True

    def __post_init__(self) -> None:
        """A replica is an `http(s)://host[:port]` base URL (anything else could never be reached)."""
        try:
            parts = urllib.parse.urlsplit(self.url)
            parts.port  # noqa: B018 - raises on a port that is no number or out of range
        except ValueError as exc:
            raise ValueError(f"`url` {self.url!r} is not an http(s)://host:port URL: {exc}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"`url` {self.url!r} is not an http(s)://host:port URL")


def admin_router(gateway: Gateway) -> Router:
    """The `/admin` routes of `gateway`, guarded by its admin token."""
    token = gateway.settings.admin_token

    def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        scheme, _sep, given = connection.headers.get("authorization", "").partition(" ")
        valid = bool(token) and scheme.lower() == "bearer"
        if not valid or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise NotAuthorizedException("admin token required")

    @post("/pause", status_code=200)
    async def pause(drain_s: FromQuery[float] = 0.0) -> dict[str, Any]:
        """Hold new calls; with `drain_s`, wait up to that long for in-flight calls to finish."""
        gateway.gate.pause()
        drained = await gateway.gate.drained(drain_s) if drain_s > 0 else gateway.gate.in_flight == 0
        return {"paused": True, "drained": drained, "in_flight": gateway.gate.in_flight}

    @post("/resume", status_code=200)
    async def resume() -> dict[str, Any]:
        """Release held calls."""
        gateway.gate.resume()
        return {"paused": False}

    @post("/upstreams", status_code=200)
    async def register(data: JSONBody[Registration]) -> dict[str, Any]:
        """Register (or withdraw, `active: false`) a vLLM replica."""
        gateway.register(UpstreamRegistration(**msgspec.structs.asdict(data)))
        return {"upstreams": [u.status() for u in gateway.pool.upstreams.values()]}

    @get("/status", sync_to_thread=False)
    def status() -> dict[str, object]:
        """Pause state, in-flight calls, replicas, weight versions."""
        return gateway.status()

    return Router("/admin", route_handlers=[pause, resume, register, status], guards=[require_admin])

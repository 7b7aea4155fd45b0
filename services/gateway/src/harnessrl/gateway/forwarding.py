"""The upstream hop: pick the episode's replica, send, retry only when nothing reached it.

A call is retried on the next replica of the ring only when the connection could not be
established (refused, connect timeout): then the upstream never saw the request and nothing was
sampled twice. Every other failure is answered (502, or 504 on a read timeout), never retried.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from harnessrl.gateway.asgi import Scope, Send, header, respond
from harnessrl.gateway.dialects import Api
from harnessrl.gateway.errors import BadGateway, GatewayTimeout, Unavailable
from harnessrl.gateway.recorder import CallRecord
from harnessrl.gateway.service import Gateway
from harnessrl.gateway.upstreams import Upstream
from harnessrl.shared.keys import EpisodeClaims
from harnessrl.shared.log import get_logger

log = get_logger(__name__)

_encoder = msgspec.json.Encoder()
_FORWARDED_HEADERS = (b"anthropic-version", b"anthropic-beta")
NOT_REACHED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)

Headers = list[tuple[bytes, bytes]]


class Forwarder:
    """Sends calls to replicas through the pool's shared session."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.pool = gateway.pool
        self.metrics = gateway.metrics
        settings = gateway.settings
        self.served_model = settings.served_model
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
        )

    async def open(
        self, api: Api, call: CallRecord, body: dict[str, Any], scope: Scope
    ) -> tuple[Upstream, aiohttp.ClientResponse]:
        """Send the call to the first reachable replica; the caller must `finish` the response."""
        headers = _upstream_headers(scope)
        unreachable: Exception | None = None
        requested = body.get("model", "")  # each candidate gets its own name, not the last one tried
        for upstream in self.pool.candidates(call.episode):
            await upstream.slots.acquire()
            upstream.in_flight += 1
            body["model"] = self.served_model or upstream.model or requested
            call.model = body["model"]
            call.upstream = upstream.url
            call.weight_version_start = self.gateway.weights.version(call.run, upstream.weight_version)
            try:
                response = await self.pool.session.post(
                    upstream.url + api.upstream_path,
                    data=_encoder.encode(body),
                    headers=headers,
                    timeout=self.timeout,
                )
            except NOT_REACHED as exc:
                self._failed(upstream)
                self.metrics.upstream_retries.inc()
                unreachable = exc
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._failed(upstream)
                raise transport_error(upstream, exc) from exc
            except BaseException:
                upstream.in_flight -= 1
                upstream.slots.release()
                raise
            upstream.succeeded()
            return upstream, response
        if unreachable is None:
            raise Unavailable("no healthy upstream", retry_after=5.0)
        raise Unavailable(f"no upstream reachable: {unreachable}", retry_after=2.0)

    def finish(self, upstream: Upstream, response: aiohttp.ClientResponse) -> None:
        """Release the response's connection and the replica's in-flight slot."""
        response.release()
        upstream.in_flight -= 1
        upstream.slots.release()

    def abort(self, upstream: Upstream, response: aiohttp.ClientResponse) -> None:
        """Close the connection mid-response (vLLM then aborts the request) and free the slot."""
        response.close()
        upstream.in_flight -= 1
        upstream.slots.release()

    def _failed(self, upstream: Upstream) -> None:
        upstream.in_flight -= 1
        upstream.slots.release()
        upstream.failed(self.pool.unhealthy_after)

    async def call(
        self, api: Api, call: CallRecord, body: dict[str, Any], scope: Scope
    ) -> tuple[Upstream, int, bytes, Headers]:
        """A non-streamed call: status, body and content type of the upstream's answer."""
        upstream, response = await self.open(api, call, body, scope)
        try:
            raw = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.abort(upstream, response)
            upstream.failed(self.pool.unhealthy_after)
            raise transport_error(upstream, exc) from exc
        except BaseException:
            self.abort(upstream, response)
            raise
        self.finish(upstream, response)
        return upstream, response.status, raw, _content_type(response)

    async def passthrough(
        self, claims: EpisodeClaims, path: str, method: str, scope: Scope, *, body: bytes, send: Send
    ) -> int:
        """Forward a call that samples nothing (`/v1/models`, count_tokens) and relay the answer."""
        for upstream in self.pool.candidates(claims.episode):
            try:
                async with self.pool.session.request(
                    method, upstream.url + path, data=body or None,
                    headers=_upstream_headers(scope), timeout=self.timeout,
                ) as response:  # fmt: skip
                    raw = await response.read()
            except NOT_REACHED:
                upstream.failed(self.pool.unhealthy_after)
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise transport_error(upstream, exc) from exc
            await respond(send, response.status, raw, _content_type(response))
            return response.status
        raise Unavailable("no healthy upstream", retry_after=5.0)

    def garbage(self, upstream: Upstream, exc: Exception) -> BadGateway:
        """The error for an upstream answer the gateway can't read."""
        log.warning("upstream.answer_unreadable", upstream=upstream.url, error=repr(exc))
        return BadGateway("the upstream answered an unreadable response")


def _upstream_headers(scope: Scope) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    for name in _FORWARDED_HEADERS:
        value = header(scope, name)
        if value is not None:
            headers[name.decode()] = value.decode(errors="replace")
    return headers


def _content_type(response: aiohttp.ClientResponse) -> Headers:
    return [(b"content-type", response.headers.get("content-type", "application/json").encode())]


def transport_error(upstream: Upstream, exc: Exception) -> Exception:
    """504 for a timeout, 502 for any other transport failure."""
    if isinstance(exc, TimeoutError):
        return GatewayTimeout(f"upstream {upstream.url} timed out", retry_after=5.0)
    return BadGateway(f"upstream {upstream.url} failed: {type(exc).__name__}", retry_after=2.0)

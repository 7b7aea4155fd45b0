"""One streamed call: relay its events, capture token deltas, publish the span before the last event.

The terminal event (`[DONE]`, `response.completed`, `message_stop`) is held back until the span is
acknowledged; if that fails the client gets an error event instead, so no stream completes without
its span. A client that disconnects cancels the relay, which closes the upstream connection (vLLM
aborts the request) and publishes the partial capture as an `aborted` span.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import msgspec

from harnessrl.gateway.asgi import Receive, Scope, Send, respond, span_header, wait_disconnect
from harnessrl.gateway.capture import Asked, Capture
from harnessrl.gateway.dialects import Api
from harnessrl.gateway.episode_spans import EpisodeSpans
from harnessrl.gateway.errors import ApiError
from harnessrl.gateway.forwarding import Forwarder
from harnessrl.gateway.recorder import CallRecord
from harnessrl.gateway.responses import failed_event
from harnessrl.gateway.sse import SSE_HEADERS, SseEvent, SseParser, relay_for
from harnessrl.shared.contracts import SpanStatus
from harnessrl.shared.log import get_logger

log = get_logger(__name__)

_encoder = msgspec.json.Encoder()
CLIENT_CLOSED = 499


class StreamRelay:
    """One streamed call: pumps upstream events to the client while capturing them."""

    def __init__(
        self, forwarder: Forwarder, api: Api, call: CallRecord, spans: EpisodeSpans, asked: Asked
    ) -> None:
        self.forwarder = forwarder
        self.api = api
        self.call = call
        self.spans = spans
        self.asked = asked
        self.capture = Capture()
        self.relay_events = relay_for(api, asked, self.capture)
        self.held: list[bytes] = []

    async def pump(self, response: aiohttp.ClientResponse, send: Send) -> int:
        """Relay every event, then publish the span, then send the held terminal event(s)."""
        parser = SseParser()
        try:
            async for chunk in response.content.iter_any():
                out = [self.relay(event) for event in parser.feed(chunk)]
                await self._send(send, out)
            await self._send(send, [self.relay(event) for event in parser.tail()])
        except (aiohttp.ClientError, TimeoutError) as exc:
            await self._record("error", f"upstream stream broke: {type(exc).__name__}")
            await _send_error_event(send, self.api, "the upstream stream broke")
            return 502
        try:
            await self._record("ok")
        except ApiError as error:
            await _send_error_event(send, self.api, error.message)
            return error.status
        await send({"type": "http.response.body", "body": b"".join(self.held), "more_body": False})
        return 200

    def relay(self, event: SseEvent) -> bytes:
        """Capture one event; return what the client gets now (held terminal events: nothing)."""
        encoded = self.relay_events.feed(event)
        if self.api.is_final(event.name, event.data):
            self.held.append(encoded)
            return b""
        return encoded

    async def _send(self, send: Send, parts: list[bytes]) -> None:
        body = b"".join(parts)
        if not body:
            return
        if self.call.ttft_s is None:
            self.call.ttft_s = time.perf_counter() - self.call.started_mono
            self.forwarder.metrics.ttft.labels(self.api.path).observe(self.call.ttft_s)
        await send({"type": "http.response.body", "body": body, "more_body": True})

    async def _record(self, status: SpanStatus, error: str | None = None) -> None:
        gateway = self.forwarder.gateway
        version = gateway.weights.version(self.call.run)
        await gateway.recorder.record(
            self.call, self.spans, self.capture, status=status, weight_version_end=version, error=error
        )

    async def record_abort(self, reason: str) -> None:
        """Publish the partial capture of a call cut short (failures only logged)."""
        try:
            await self._record("aborted", reason)
        except ApiError as error:
            log.error("span.abort_unrecorded", span=self.call.span_id, error=error.message)


async def relay_stream(
    forwarder: Forwarder, api: Api, call: CallRecord, spans: EpisodeSpans, *,
    body: dict[str, Any], asked: Asked, scope: Scope, receive: Receive, send: Send,
) -> int:  # fmt: skip
    """Run one streamed call end to end; returns the status for metrics (499: client left)."""
    upstream, response = await forwarder.open(api, call, body, scope)
    if response.status != 200:
        try:
            raw = await response.read()
        finally:
            forwarder.finish(upstream, response)
        content_type = response.headers.get("content-type", "application/json").encode()
        await respond(
            send, response.status, api.upstream_error(response.status, raw), [(b"content-type", content_type)]
        )
        return response.status
    relay = StreamRelay(forwarder, api, call, spans, asked)
    headers = [*SSE_HEADERS, span_header(call.span_id)]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    pump = asyncio.ensure_future(relay.pump(response, send))
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait((pump, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Not done either: the request itself was cancelled (the shutdown grace ran out).
        reason = "client disconnected" if watcher.done() else "the gateway shut down"
        watcher.cancel()
        if not pump.done():
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            forwarder.abort(upstream, response)
            await relay.record_abort(reason)
    if pump.cancelled():
        return CLIENT_CLOSED
    forwarder.finish(upstream, response)
    return pump.result()


async def _send_error_event(send: Send, api: Api, message: str) -> None:
    if api.dialect == "anthropic":
        payload = {"type": "error", "error": {"type": "api_error", "message": message}}
        frame = b"event: error\ndata: " + _encoder.encode(payload) + b"\n\n"
    elif api.kind == "responses":
        frame = failed_event(message)
    else:
        frame = b"data: " + _encoder.encode({"error": {"message": message, "type": "server_error"}})
        frame += b"\n\n"
    await send({"type": "http.response.body", "body": frame, "more_body": False})

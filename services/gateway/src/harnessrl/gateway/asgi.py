"""Small raw-ASGI pieces of the hot path: reading a bounded body, answering, SSE framing.

The proxy routes run as raw ASGI (in front of Litestar) so a call costs no more than it must: no
request/response objects, no middleware stack, bytes in and bytes out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

from harnessrl.gateway.errors import ApiError, Dialect, PayloadTooLarge

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def span_header(span_id: str) -> tuple[bytes, bytes]:
    """`x-harnessrl-span`: which span records this call (for harness-side correlation)."""
    return (b"x-harnessrl-span", span_id.encode())


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a request header (`name` in lower case)."""
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; `PayloadTooLarge` as soon as it exceeds `limit` bytes."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Send a complete response (with its length: a chunked body costs the client a parse)."""
    headers = [*(headers or JSON_HEADERS), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def respond_error(send: Send, error: ApiError, dialect: Dialect) -> None:
    """Send `error` in the client's API envelope."""
    await respond(send, error.status, error.body(dialect), error.headers())


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away (after the body was read, only disconnects arrive)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SseEvent:
    """One server-sent event: optional `event:` name and the joined `data:` payload."""

    __slots__ = ("data", "name")

    def __init__(self, name: str | None, data: bytes) -> None:
        self.name = name
        self.data = data

    def encode(self, data: bytes | None = None) -> bytes:
        """Frame the event again (with `data` replacing the payload when given)."""
        payload = self.data if data is None else data
        if self.name is None:
            return b"data: " + payload + b"\n\n"
        return b"event: " + self.name.encode() + b"\ndata: " + payload + b"\n\n"


class SseParser:
    r"""Splits an upstream byte stream into events (tolerates `\\r\\n` and arbitrary chunking)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[SseEvent]:
        """Events completed by `chunk`."""
        buffer = self._buffer + chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        *blocks, self._buffer = buffer.split(b"\n\n")
        for block in blocks:
            event = _parse_block(block)
            if event is not None:
                yield event

    def tail(self) -> Iterator[SseEvent]:
        """An unterminated last event at end of stream."""
        event = _parse_block(self._buffer) if self._buffer.strip() else None
        self._buffer = b""
        if event is not None:
            yield event


def _parse_block(block: bytes) -> SseEvent | None:
    name: str | None = None
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode(errors="replace")
    if not data and name is None:
        return None
    return SseEvent(name, b"\n".join(data))

"""Small raw-ASGI pieces of the hot path: reading a bounded body, answering, waiting for a disconnect.

The proxy routes run as raw ASGI (in front of Litestar) so a call costs no more than it must: no
request/response objects, no middleware stack, bytes in and bytes out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from harnessrl.gateway.errors import ApiError, ClientGone, Dialect, PayloadTooLarge

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]


def span_header(span_id: str) -> tuple[bytes, bytes]:
    """`x-harnessrl-span`: which span records this call (for harness-side correlation)."""
    return (b"x-harnessrl-span", span_id.encode())


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

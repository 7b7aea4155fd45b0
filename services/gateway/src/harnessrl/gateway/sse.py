"""Server-sent events of a streamed call: parsed from the upstream, captured, framed again for the client.

`SseParser` splits vLLM's byte stream into `SseEvent`s. For each one an event relay decides what
the client receives: the default relay captures the event and re-encodes it (the same API on both
sides); the Messages relay captures vLLM's chat chunks and emits the Anthropic event sequence
instead. How the whole call is pumped, held back and recorded is `stream_relay`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from harnessrl.gateway.anthropic_stream import MessageStream
from harnessrl.gateway.capture import Asked, Capture
from harnessrl.gateway.dialects import Api
from harnessrl.gateway.responses import ResponseStream, Shape, failed_event

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


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


class EventRelay:
    """Capture one event, strip the injected fields, frame it again."""

    def __init__(self, api: Api, asked: Asked, capture: Capture) -> None:
        self.api = api
        self.asked = asked
        self.capture = capture

    def feed(self, event: SseEvent) -> bytes:
        """The bytes the client gets for `event` (empty: nothing)."""
        data = self._decode(event)
        if data is None:
            return event.encode()
        keep = self.api.capture_event(event.name, data, self.asked, self.capture)
        return event.encode(_encoder.encode(data)) if keep else b""

    def _decode(self, event: SseEvent) -> dict[str, Any] | None:
        if event.data == b"[DONE]":
            return None
        try:
            data = _decoder.decode(event.data)
        except msgspec.DecodeError:
            return None
        return data if isinstance(data, dict) else None


class MessagesRelay(EventRelay):
    """Chat chunks in, Anthropic Messages events out."""

    def __init__(self, api: Api, asked: Asked, capture: Capture) -> None:
        super().__init__(api, asked, capture)
        self.stream: MessageStream | None = None

    def feed(self, event: SseEvent) -> bytes:
        """Translate one chat chunk; `[DONE]` becomes the closing events."""
        if event.data == b"[DONE]":
            return self.stream.finish() if self.stream is not None else b""
        data = self._decode(event)
        if data is None:
            return event.encode() if event.data.startswith(b"{") else b""
        if "error" in data and "choices" not in data:
            return event.encode()
        if self.stream is None:
            self.stream = MessageStream(str(data.get("model", "")))
        self.api.capture_event(event.name, data, self.asked, self.capture)
        if self.capture.prompt_ids is not None:
            self.stream.usage["input_tokens"] = len(self.capture.prompt_ids)
        return self.stream.chunk(data)


class ResponsesRelay(EventRelay):
    """Chat chunks in, Responses events out (`responses.ResponseStream`)."""

    def __init__(self, api: Api, asked: Asked, capture: Capture) -> None:
        super().__init__(api, asked, capture)
        self.stream = ResponseStream(Shape(asked.request or {}, logprobs=asked.logprobs))

    def feed(self, event: SseEvent) -> bytes:
        """Translate one chat chunk; `[DONE]` becomes the closing events; an error, `response.failed`."""
        if event.data == b"[DONE]":
            return self.stream.finish_events()
        data = self._decode(event)
        if data is None or ("error" in data and "choices" not in data):
            error = data.get("error") if data is not None else None
            message = error.get("message") if isinstance(error, dict) else None
            return failed_event(str(message or event.data.decode(errors="replace")))
        usage = data.get("usage")  # read first: the capture strips it from what it hands on
        self.api.capture_event(event.name, data, self.asked, self.capture)
        return self.stream.chunk(data, usage)


def relay_for(api: Api, asked: Asked, capture: Capture) -> EventRelay:
    """The relay of `api`'s streams."""
    relays: dict[str, type[EventRelay]] = {"messages": MessagesRelay, "responses": ResponsesRelay}
    return relays.get(api.kind, EventRelay)(api, asked, capture)

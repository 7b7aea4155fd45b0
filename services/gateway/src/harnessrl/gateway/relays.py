"""Stream relays: what the client receives for each upstream event of a streamed call.

The default relay captures an event and re-encodes it (the same API on both sides). The Messages
relay captures vLLM's chat chunks and emits the Anthropic event sequence instead.
"""

from __future__ import annotations

from typing import Any

import msgspec

from harnessrl.gateway.anthropic import MessageStream
from harnessrl.gateway.apis import Api
from harnessrl.gateway.asgi import SseEvent
from harnessrl.gateway.capture import Asked, Capture

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


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


def relay_for(api: Api, asked: Asked, capture: Capture) -> EventRelay:
    """The relay of `api`'s streams."""
    kind = MessagesRelay if api.kind == "messages" else EventRelay
    return kind(api, asked, capture)

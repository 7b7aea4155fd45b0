"""One vLLM chat completion stream as Anthropic's Messages event sequence.

`message_start`, then per content block `content_block_start`, its deltas and
`content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`. Blocks, in the
order the model produced them:
- reasoning deltas -> a `thinking` block of `thinking_delta`s, closed by a `signature_delta`;
- content deltas -> a `text` block of `text_delta`s;
- each tool call -> a `tool_use` block (id and name at its start) of `input_json_delta`s.
Token ids and logprobs are captured from the same chunks by `MessagesApi` (see `sse.MessagesRelay`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from harnessrl.gateway.anthropic import message_id, reasoning_of, signature, stop_of

_json = msgspec.json.Encoder()


class MessageStream:
    """Turns one chat completion stream into the Messages event sequence."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = ""
        self.started = False
        self.block = -1
        self.block_kind: str | None = None
        self.tool_blocks: dict[int, int] = {}
        self.stop: tuple[str | None, str | None] = (None, None)
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    def chunk(self, data: dict[str, Any]) -> bytes:
        """The Messages events for one chat chunk."""
        out: list[bytes] = []
        if not self.started:
            self.started = True
            self.id = str(data.get("id") or "")
            out.append(_event("message_start", {"type": "message_start", "message": self._message()}))
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.usage = {"input_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0)}  # fmt: skip
        for choice in data.get("choices") or []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                out += self._delta(choice)
        return b"".join(out)

    def _message(self) -> dict[str, Any]:
        return {"id": message_id(self.id), "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.usage["input_tokens"], "output_tokens": 0}}  # fmt: skip

    def _delta(self, choice: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        delta = choice.get("delta") or {}
        reasoning = reasoning_of(delta)
        if reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._block_delta(self.block, {"type": "thinking_delta", "thinking": reasoning}))
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._block_delta(self.block, {"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict):
                out += self._tool_delta(call)
        if choice.get("finish_reason"):
            self.stop = stop_of(choice)
        return out

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        function = call.get("function") or {}
        position = call.get("index", 0)
        if position not in self.tool_blocks:
            block = {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": function.get("name", ""),
                "input": {},
            }
            out += self._open(f"tool{position}", block, force=True)
            self.tool_blocks[position] = self.block
        if function.get("arguments"):
            payload = {"type": "input_json_delta", "partial_json": function["arguments"]}
            out.append(self._block_delta(self.tool_blocks[position], payload))
        return out

    @staticmethod
    def _block_delta(index: int, payload: dict[str, Any]) -> bytes:
        return _event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": payload}
        )

    def _open(self, kind: str, block: dict[str, Any], *, force: bool = False) -> list[bytes]:
        if self.block_kind == kind and not force:
            return []
        out = self._close()
        self.block += 1
        self.block_kind = kind
        start = {"type": "content_block_start", "index": self.block, "content_block": block}
        out.append(_event("content_block_start", start))
        return out

    def _close(self) -> list[bytes]:
        if self.block_kind is None:
            return []
        out: list[bytes] = []
        if self.block_kind == "thinking":
            payload = {"type": "signature_delta", "signature": signature(self.id)}
            out.append(self._block_delta(self.block, payload))
        self.block_kind = None
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.block}))
        return out

    def finish(self) -> bytes:
        """The closing events (sent once the span is stored): block stop, message_delta, stop.

        A completion with no content at all still gets one empty text block, as a non-streamed
        answer does.
        """
        opened = self._open("text", {"type": "text", "text": ""}) if self.block < 0 else []
        reason, sequence = self.stop
        stop = {"stop_reason": reason or "end_turn", "stop_sequence": sequence}
        delta = {
            "type": "message_delta",
            "delta": stop,
            "usage": {"output_tokens": self.usage["output_tokens"]},
        }
        return b"".join([*opened, *self._close(), _event("message_delta", delta),
                         _event("message_stop", {"type": "message_stop"})])  # fmt: skip


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"

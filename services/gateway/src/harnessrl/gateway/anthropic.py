"""Anthropic Messages <-> OpenAI chat: how `/v1/messages` calls are captured token by token.

vLLM's own `/v1/messages` (0.31) returns neither token ids nor logprobs, and a call whose sampled
tokens are unknown can't be trained on. So the gateway sends Messages calls to vLLM's chat
endpoint (the same chat template and sampler vLLM's Messages route uses internally), captures the
ids there, and answers in the Messages format, streamed events included.
"""

from __future__ import annotations

from typing import Any

import msgspec

_json = msgspec.json.Encoder()
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_SAMPLING = ("temperature", "top_p", "top_k", "stream")


def to_chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request equivalent to a Messages request (unknown fields pass through)."""
    known = {"messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences",
             "metadata", "thinking", "model", *_SAMPLING}  # fmt: skip
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in known}
    chat.update({k: body[k] for k in _SAMPLING if k in body})
    chat["model"] = body.get("model", "")
    chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    messages = _system_messages(body.get("system"))
    for message in body["messages"]:
        messages.extend(_chat_messages(message))
    chat["messages"] = messages
    if isinstance(body.get("tools"), list):
        chat["tools"] = [_chat_tool(t) for t in body["tools"] if isinstance(t, dict)]
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(b.get("text", "")) for b in content if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


def _system_messages(system: Any) -> list[dict[str, Any]]:
    text = _text(system)
    return [{"role": "system", "content": text}] if text else []


def _chat_messages(message: Any) -> list[dict[str, Any]]:
    if not isinstance(message, dict):
        return []
    role = message.get("role", "user")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
    results = [
        {"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": _text(b.get("content"))}
        for b in blocks
        if b.get("type") == "tool_result"
    ]
    calls = [
        {"id": str(b.get("id", "")), "type": "function",
         "function": {"name": str(b.get("name", "")), "arguments": _json.encode(b.get("input", {})).decode()}}
        for b in blocks
        if b.get("type") == "tool_use"
    ]  # fmt: skip
    text = _text(blocks)
    out: list[dict[str, Any]] = list(results)
    if text or calls or not results:
        entry: dict[str, Any] = {"role": role, "content": text}
        if calls:
            entry["tool_calls"] = calls
        out.append(entry)
    return out


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool.get("name", ""), "parameters": tool.get("input_schema", {})}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name", "")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))


def to_message(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """The Messages response equivalent to a chat completion (first choice)."""
    choices = chat.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content += [_tool_use(call) for call in message.get("tool_calls") or [] if isinstance(call, dict)]
    usage = chat.get("usage") or {}
    stop_reason, stop_sequence = stop_of(choice)
    return {
        "id": "msg_" + str(chat.get("id", "")).removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                  "output_tokens": usage.get("completion_tokens", 0)},
    }  # fmt: skip


def stop_of(choice: dict[str, Any]) -> tuple[str | None, str | None]:
    """Anthropic `stop_reason` and `stop_sequence` of a chat choice."""
    reason = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    if reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return (_STOP_REASONS.get(reason, "end_turn") if reason else None), None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    try:
        arguments = msgspec.json.decode(function.get("arguments") or "{}")
    except msgspec.DecodeError:
        arguments = {"_raw": function.get("arguments")}
    return {"type": "tool_use", "id": call.get("id", ""), "name": function.get("name", ""),
            "input": arguments}  # fmt: skip


class MessageStream:
    """Turns one chat completion stream into the Messages event sequence."""

    def __init__(self, model: str) -> None:
        self.model = model
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
            message = to_message({"id": data.get("id", ""), "choices": [{"message": {}}]}, self.model)
            message["stop_reason"] = None
            out.append(_event("message_start", {"type": "message_start", "message": message}))
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.usage = {"input_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0)}  # fmt: skip
        for choice in data.get("choices") or []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                out += self._delta(choice)
        return b"".join(out)

    def _delta(self, choice: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        delta = choice.get("delta") or {}
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            payload = {"type": "text_delta", "text": delta["content"]}
            out.append(
                _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": self.block, "delta": payload},
                )
            )
        for call in delta.get("tool_calls") or []:
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
            index = self.tool_blocks[position]
            out.append(
                _event(
                    "content_block_delta", {"type": "content_block_delta", "index": index, "delta": payload}
                )
            )
        return out

    def _open(self, kind: str, block: dict[str, Any], *, force: bool = False) -> list[bytes]:
        if self.block_kind == kind and not force:
            return []
        out = self._close()
        self.block += 1
        self.block_kind = kind
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": self.block, "content_block": block},
            )
        )
        return out

    def _close(self) -> list[bytes]:
        if self.block_kind is None:
            return []
        self.block_kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def finish(self) -> bytes:
        """The closing events (sent once the span is stored): block stop, message_delta, stop."""
        reason, sequence = self.stop
        stop = {"stop_reason": reason or "end_turn", "stop_sequence": sequence}
        usage = {"output_tokens": self.usage["output_tokens"]}
        delta = {"type": "message_delta", "delta": stop, "usage": usage}
        return b"".join([*self._close(), _event("message_delta", delta),
                         _event("message_stop", {"type": "message_stop"})])  # fmt: skip


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"

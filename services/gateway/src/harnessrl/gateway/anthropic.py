"""Anthropic Messages <-> OpenAI chat: how `/v1/messages` calls are captured token by token.

vLLM's own `/v1/messages` (0.31) returns neither token ids nor logprobs, and a call whose sampled
tokens are unknown can't be trained on. So the gateway sends Messages calls to vLLM's chat
endpoint and converts them the way vLLM's Messages route does internally (the same chat template
and sampler), captures the ids there, and answers in the Messages format (streamed events in
`anthropic_stream`).

What maps to what, beyond text and tools:
- `thinking` blocks in the history become the assistant message's `reasoning`; the model's
  reasoning (vLLM's reasoning parser) comes back as a `thinking` block. `thinking.type` `enabled`
  sets `thinking_token_budget`, `disabled` sets `reasoning_effort: none`; `output_config.effort`
  sets `reasoning_effort`. `thinking.display` is ignored, as vLLM's route does: the reasoning is
  sampled and captured either way, and the client gets it.
- System text blocks (top level or inline `system` messages, as Claude Code sends) are joined; the
  `x-anthropic-billing-header` line Claude Code puts first is left out (as vLLM does), so the
  prompt doesn't change with the client's version.
- `cache_control`, `metadata` and `context_management` steer Anthropic's servers only (prompt
  caching, billing, server-side history edits) and are not forwarded.
- Image blocks are refused (400): a span carries token ids, not pixels, so a call with an image
  could never be trained faithfully. So are block types the gateway doesn't know.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from harnessrl.gateway.errors import BadRequest, error_for_status

_json = msgspec.json.Encoder()
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_SAMPLING = ("temperature", "top_p", "top_k", "stream")
# Anthropic-only request fields: converted below, or steering Anthropic's servers only.
_MESSAGES_FIELDS = frozenset({"messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences",
                              "metadata", "thinking", "model", "output_config", "context_management",
                              *_SAMPLING})  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"
# Blocks that carry no content of their own: `redacted_thinking` is opaque (encrypted by Anthropic).
_SKIPPED_BLOCKS = frozenset({"redacted_thinking"})
_CONTENT_BLOCKS = frozenset({"text", "tool_use", "tool_result", "thinking", *_SKIPPED_BLOCKS})


def to_chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request equivalent to a Messages request (unknown fields pass through).

    Raises `BadRequest` (answered in Anthropic's envelope) for content it can't capture.
    """
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _MESSAGES_FIELDS}
    chat.update({k: body[k] for k in _SAMPLING if k in body})
    chat["model"] = body.get("model", "")
    if "max_tokens" in body:  # required by `/v1/messages`, absent from `count_tokens`
        chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    messages = _system_messages(body.get("system"))
    for message in body["messages"]:
        messages.extend(_chat_messages(message))
    chat["messages"] = messages
    if isinstance(body.get("tools"), list):
        chat["tools"] = [_chat_tool(t) for t in body["tools"] if isinstance(t, dict)]
    _tool_choice(body.get("tool_choice"), chat)
    _reasoning(body, chat)
    return chat


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _text(content: Any) -> str:
    return "".join(str(b.get("text", "")) for b in _blocks(content) if b.get("type") == "text")


def _system_text(content: Any) -> str:
    """System text without Claude Code's billing header line."""
    texts = [b for b in _blocks(content) if b.get("type") == "text"]
    return "".join(
        str(b.get("text", "")) for b in texts if not str(b.get("text", "")).startswith(_BILLING_HEADER)
    )


def _system_messages(system: Any) -> list[dict[str, Any]]:
    text = _system_text(system)
    return [{"role": "system", "content": text}] if text else []


def _chat_messages(message: Any) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: tool results first, then the turn itself."""
    if not isinstance(message, dict):
        return []
    role = message.get("role", "user")
    if role == "system":
        return _system_messages(message.get("content"))
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = _blocks(content)
    _refuse_unknown(blocks)
    out: list[dict[str, Any]] = [_tool_message(b) for b in blocks if b.get("type") == "tool_result"]
    calls = [_tool_call(b) for b in blocks if b.get("type") == "tool_use"]
    reasoning = "".join(str(b.get("thinking", "")) for b in blocks if b.get("type") == "thinking")
    text = _text(blocks)
    if text or calls or reasoning or not out:
        entry: dict[str, Any] = {"role": role, "content": text}
        if calls:
            entry["tool_calls"] = calls
        if reasoning:
            entry["reasoning"] = reasoning
        out.append(entry)
    return out


def _refuse_unknown(blocks: list[dict[str, Any]]) -> None:
    for block in blocks:
        kind = block.get("type")
        if kind == "image":
            raise BadRequest("image blocks are not supported: a span records token ids, not pixels")
        if kind not in _CONTENT_BLOCKS:
            raise BadRequest(f"content block type {kind!r} is not supported by this gateway")
        if kind == "tool_result":
            _refuse_unknown([b for b in _blocks(block.get("content")) if b.get("type") != "text"])


def _tool_message(block: dict[str, Any]) -> dict[str, Any]:
    texts = [str(b.get("text", "")) for b in _blocks(block.get("content")) if b.get("type") == "text"]
    return {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": "\n".join(texts)}


def _tool_call(block: dict[str, Any]) -> dict[str, Any]:
    # Spelled as vLLM's Messages route (and hermes-style models) write JSON: `{"a": 1}`.
    arguments = json.dumps(block.get("input") or {})
    function = {"name": str(block.get("name", "")), "arguments": arguments}
    return {"id": str(block.get("id", "")), "type": "function", "function": function}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's function tool, its keys in OpenAI's order (templates render the JSON as given)."""
    function: dict[str, Any] = {"name": tool.get("name", "")}
    if tool.get("description"):
        function["description"] = tool["description"]
    function["parameters"] = tool.get("input_schema", {})
    return {"type": "function", "function": function}


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if not isinstance(choice, dict):
        return
    kind = choice.get("type")
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
    elif kind in ("auto", "any", "none"):
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _reasoning(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """`thinking` and `output_config` as vLLM's chat parameters (as vLLM's Messages route maps them)."""
    config = body.get("output_config")
    config = config if isinstance(config, dict) else {}
    if isinstance(config.get("effort"), str):
        chat["reasoning_effort"] = config["effort"]
    schema = config.get("format")
    if isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": schema["schema"]}}  # fmt: skip
    thinking = body.get("thinking")
    if not isinstance(thinking, dict):
        return
    if thinking.get("type") == "enabled" and isinstance(thinking.get("budget_tokens"), int):
        chat["thinking_token_budget"] = thinking["budget_tokens"]
    elif thinking.get("type") == "disabled":
        chat["reasoning_effort"] = "none"


def to_message(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """The Messages response equivalent to a chat completion (first choice)."""
    choices = chat.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": signature(chat.get("id"))})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content += [_tool_use(call) for call in message.get("tool_calls") or [] if isinstance(call, dict)]
    usage = chat.get("usage") or {}
    stop_reason, stop_sequence = stop_of(choice)
    return {
        "id": message_id(chat.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content or [{"type": "text", "text": ""}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                  "output_tokens": usage.get("completion_tokens", 0)},
    }  # fmt: skip


def message_id(chat_id: Any) -> str:
    """The Messages id of a chat completion id."""
    return "msg_" + str(chat_id or "").removeprefix("chatcmpl-")


def signature(chat_id: Any) -> str:
    """A thinking block's `signature`: opaque to clients; here it only names the call it came from."""
    return "sig_" + str(chat_id or "").removeprefix("chatcmpl-")


def reasoning_of(message: dict[str, Any]) -> str:
    """The reasoning text of a chat message or delta (vLLM 0.31 `reasoning`, older `reasoning_content`)."""
    value = message.get("reasoning") or message.get("reasoning_content")
    return value if isinstance(value, str) else ""


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


def error_body(raw: bytes, status: int) -> bytes:
    """An upstream (OpenAI-shaped) error body in Anthropic's envelope, its message kept."""
    try:
        decoded = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        decoded = None
    error = decoded.get("error") if isinstance(decoded, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    text = str(message) if message else raw.decode(errors="replace")[:1000]
    return error_for_status(status, text).body("anthropic")

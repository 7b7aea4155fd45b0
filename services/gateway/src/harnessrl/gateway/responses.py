"""OpenAI Responses <-> chat: how `/v1/responses` calls are captured token by token, tool calls too.

vLLM's own `/v1/responses` (0.31) attaches logprobs to `output_text` parts only: a turn that is only
function calls (Codex CLI's whole work) or reasoning comes back with token ids but no logprobs, and
can't be trained on. So the gateway sends Responses calls to vLLM's chat endpoint, rendering the
input items into chat messages exactly as vLLM's Responses route does internally (same template,
same tool parser, so the same prompt ids), captures every sampled token with its logprob there,
and answers in the Responses format, streamed events included.

The gateway is stateless: `previous_response_id` and encrypted reasoning can't be honoured and are
refused; hosted tools (web search, file search, ...) have nothing to run them and are left out of
the prompt, as vLLM's own route does, and counted.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from harnessrl.gateway.errors import BadRequest
from harnessrl.shared.log import get_logger

log = get_logger(__name__)
_json = msgspec.json.Encoder()
# vLLM's name for a function inside a `namespace` tool (`tool_parsers.utils.flat_namespace_tool_name`).
NAMESPACE_SEPARATOR = "__"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
# Responses fields with no chat counterpart (or translated below): not sent on.
_KNOWN = frozenset(
    {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "text",
        "reasoning",
        "store",
        "include",
        "prompt_cache_key",
        "client_metadata",
        "metadata",
        "truncation",
        "service_tier",
        "user",
        "safety_identifier",
        "background",
        "previous_response_id",
        "enable_response_messages",
        "stream_options",
        "prompt",
        "max_tool_calls",
    }
)


def to_chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request equivalent to a Responses request (unknown fields pass through)."""
    if body.get("previous_response_id"):
        raise BadRequest("`previous_response_id` is not supported: send the whole conversation as `input`")
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _KNOWN}
    chat["model"] = body.get("model", "")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("`instructions` must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += chat_messages(body["input"])
    chat["messages"] = messages
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise BadRequest("`max_output_tokens` must be an integer")
        chat["max_tokens"] = limit
    tools, left_out = chat_tools(body.get("tools"))
    if left_out:
        log.info("responses.hosted_tools_left_out", count=left_out)
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if isinstance(body.get("parallel_tool_calls"), bool):
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def chat_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages, merged the way vLLM's Responses route merges them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise BadRequest("every `input` item must be an object")
        message = _message_of(
            item, messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        )
        if message is not None:
            messages.append(message)
    return messages


def _message_of(item: dict[str, Any], assistant: dict[str, Any] | None) -> dict[str, Any] | None:
    """A new chat message for `item`, or None when it was merged into the previous `assistant` one."""
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {
            "id": str(item.get("call_id", "")),
            "type": "function",
            "function": {"name": _flat_name(item), "arguments": str(item.get("arguments", ""))},
        }
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        return _merge(assistant, "reasoning", _reasoning_text(item))
    if kind == "function_call_output":
        return {
            "role": "tool",
            "tool_call_id": str(item.get("call_id", "")),
            "content": _text(item.get("output")),
        }
    if kind == "message":
        if not isinstance(item.get("role"), str):
            raise BadRequest("a message item needs a string `role`")
        if item["role"] == "assistant":
            return _merge(assistant, "content", _text(item.get("content")))
        return {"role": item["role"], "content": _content(item.get("content"))}
    raise BadRequest(f"unsupported `input` item type: {kind}")


def _merge(assistant: dict[str, Any] | None, field: str, value: str) -> dict[str, Any] | None:
    if assistant is not None and assistant.get(field) is None:
        assistant[field] = value
        return None
    return {"role": "assistant", field: value}


def _flat_name(item: dict[str, Any]) -> str:
    name = str(item.get("name", ""))
    namespace = item.get("namespace")
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def _reasoning_text(item: dict[str, Any]) -> str:
    if item.get("encrypted_content"):
        raise BadRequest("encrypted reasoning content is not supported: send reasoning items as text")
    for field in ("content", "summary"):
        parts = item.get(field)
        if isinstance(parts, list) and parts and isinstance(parts[0], dict):
            return str(parts[0].get("text", ""))
    return ""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(
        str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") in _TEXT_PARTS
    )


def _content(content: Any) -> str | list[dict[str, Any]]:
    """A user, system or developer message's content as chat content (text and image parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest("a message's `content` must be a string or an array of parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", ""))})  # type: ignore[union-attr]
        elif kind == "input_image" and isinstance(part.get("image_url"), str):  # type: ignore[union-attr]
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})  # type: ignore[index]
        else:
            raise BadRequest(f"unsupported content part type: {kind}")
    return parts


def chat_tools(tools: Any) -> tuple[list[dict[str, Any]], int]:
    """Function tools (namespaced ones flattened as vLLM does), and how many hosted tools were left out."""
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("`tools` must be an array")
    out: list[dict[str, Any]] = []
    dropped = 0
    for tool in tools or []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise BadRequest("every tool must be an object with a string `type`")
        if kind == "function":
            out.append(_chat_function(tool, str(tool.get("name", ""))))
        elif kind == "namespace":
            prefix = f"{tool.get('name', '')}{NAMESPACE_SEPARATOR}"
            out += [_chat_function(t, prefix + str(t.get("name", ""))) for t in _members(tool)]
        else:  # a hosted tool (web search, file search, ...): nothing here can run it
            dropped += 1
    return out, dropped


def hosted_tools(tools: Any) -> int:
    """How many hosted tools (web search, ...) a request declares: nothing here can run them."""
    if not isinstance(tools, list):
        return 0
    return sum(isinstance(t, dict) and t.get("type") not in ("function", "namespace") for t in tools)


def _members(namespace: dict[str, Any]) -> list[dict[str, Any]]:
    """The function tools of a `namespace` tool."""
    tools = namespace.get("tools")
    if not isinstance(tools, list):
        return []
    return [t for t in tools if isinstance(t, dict) and t.get("type") == "function"]


def _chat_function(tool: dict[str, Any], name: str) -> dict[str, Any]:
    """A chat function tool, its fields in the order vLLM renders them (`FunctionDefinition`)."""
    function: dict[str, Any] = {"name": name}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = tool.get("parameters")
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": str(choice.get("name", ""))}}
    if choice in ("auto", "none", "required"):
        return choice
    raise BadRequest(f"unsupported `tool_choice`: {choice!r}")


def _response_format(text: Any) -> dict[str, Any] | None:
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(form, dict) or form.get("type") in (None, "text"):
        return None
    if form["type"] == "json_object":
        return {"type": "json_object"}
    if form["type"] == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequest(f"unsupported `text.format` type: {form['type']}")


class Shape:
    """What a Responses answer echoes from its request, and how it names items and tools."""

    def __init__(self, request: dict[str, Any], *, logprobs: bool) -> None:
        """`request`: the client's Responses request (only the fields echoed are read)."""
        keep = (
            "instructions",
            "metadata",
            "parallel_tool_calls",
            "temperature",
            "top_p",
            "max_output_tokens",
            "tool_choice",
            "tools",
            "text",
            "reasoning",
            "store",
            "truncation",
        )
        tools = request.get("tools")
        tools = tools if isinstance(tools, list) else []
        self.echo = {k: request.get(k) for k in keep}
        self.echo["tools"] = tools
        self.echo["tool_choice"] = request.get("tool_choice") or "auto"
        self.echo["parallel_tool_calls"] = request.get("parallel_tool_calls", True)
        self.logprobs = logprobs
        self.namespaced = {
            f"{t.get('name')}{NAMESPACE_SEPARATOR}{m.get('name')}": (str(t.get("name")), str(m.get("name")))
            for t in tools
            if isinstance(t, dict) and t.get("type") == "namespace"
            for m in _members(t)
        }
        self.created = int(time.time())

    def response(
        self,
        rid: str,
        model: str,
        output: list[dict[str, Any]],
        finish: str | None,
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The `response` object (status from the chat finish reason; None: still in progress)."""
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": rid,
            "object": "response",
            "created_at": self.created,
            "model": model,
            "status": status,
            "error": None,
            "incomplete_details": details,
            "output": output,
            "usage": usage,
            "previous_response_id": None,
            **self.echo,
        }

    def function_call(self, item_id: str, call: dict[str, Any], arguments: str) -> dict[str, Any]:
        """A `function_call` item of a chat tool call (namespaced names split again)."""
        flat = str(_dict(call.get("function")).get("name", ""))
        namespace, name = self.namespaced.get(flat, (None, flat))
        item = {
            "type": "function_call",
            "id": item_id,
            "call_id": str(call.get("id") or item_id),
            "name": name,
            "arguments": arguments,
            "status": "completed",
        }
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def output_text(self, text: str, logprobs: list[Any]) -> dict[str, Any]:
        """An `output_text` part (with the token logprobs when the client included them)."""
        return {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": logprobs if self.logprobs else None,
        }


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def usage_of(chat_usage: Any) -> dict[str, Any]:
    """Responses usage from a chat usage object."""
    usage = chat_usage if isinstance(chat_usage, dict) else {}
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _reasoning_of(message: dict[str, Any]) -> str | None:
    value = message.get("reasoning") or message.get("reasoning_content")
    return value if isinstance(value, str) and value else None


def to_response(chat: dict[str, Any], shape: Shape) -> dict[str, Any]:
    """The Responses object equivalent to a chat completion (first choice)."""
    choices = chat.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    base = str(chat.get("id", "")).removeprefix("chatcmpl-")
    output: list[dict[str, Any]] = []
    reasoning = _reasoning_of(message)
    if reasoning is not None:
        output.append(_reasoning_item(f"rs_{base}", reasoning))
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        part = shape.output_text(message["content"], logprobs)
        output.append(_message_item(f"msg_{base}", [part], "completed"))
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        output.append(shape.function_call(f"fc_{base}_{i}", call, str(function.get("arguments", ""))))
    usage = usage_of(chat.get("usage"))
    return shape.response(
        f"resp_{base}", str(chat.get("model", "")), output, choice.get("finish_reason") or "stop", usage
    )


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _message_item(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


class _Item:
    """One output item being streamed: its kind, index, id, accumulated text and logprobs."""

    __slots__ = ("call", "id", "index", "kind", "logprobs", "text")

    def __init__(self, kind: str, index: int, item_id: str, call: dict[str, Any] | None = None) -> None:
        self.kind, self.index, self.id, self.call = kind, index, item_id, call
        self.text: list[str] = []
        self.logprobs: list[Any] = []


class ResponseStream:
    """Turns one chat completion stream into the Responses event sequence."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.rid = ""
        self.model = ""
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.current: _Item | None = None
        self.tool_items: dict[int, _Item] = {}
        self.finish: str | None = None
        self.usage = usage_of(None)

    def chunk(self, data: dict[str, Any], usage: Any) -> bytes:
        """The events of one chat chunk (`usage` read before the capture stripped it)."""
        out: list[bytes] = []
        if not self.rid:
            self.rid = "resp_" + str(data.get("id", "")).removeprefix("chatcmpl-")
            self.model = str(data.get("model", ""))
            response = self.shape.response(self.rid, self.model, [], None, None)
            out += [
                self._event("response.created", response=response),
                self._event("response.in_progress", response=response),
            ]
        if isinstance(usage, dict):
            self.usage = usage_of(usage)
        for choice in data.get("choices") or []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                out += self._delta(choice)
        return b"".join(out)

    def _delta(self, choice: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        delta = _dict(choice.get("delta"))
        logprobs = _dict(choice.get("logprobs")).get("content") or [] if self.shape.logprobs else []
        reasoning = _reasoning_of(delta)
        if reasoning is not None:
            item = self._open("reasoning", out)
            item.text.append(reasoning)
            out.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=item.id,
                    output_index=item.index,
                    content_index=0,
                    delta=reasoning,
                )
            )
        if delta.get("content"):
            item = self._open("message", out)
            item.text.append(delta["content"])
            item.logprobs += logprobs
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item.id,
                    output_index=item.index,
                    content_index=0,
                    delta=delta["content"],
                    logprobs=logprobs,
                )
            )
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict):
                out += self._tool_delta(call)
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        return out

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        position = call.get("index", 0)
        item = self.tool_items.get(position)
        if item is None:
            item = self.tool_items[position] = self._open("function_call", out, call)
        arguments = _dict(call.get("function")).get("arguments")
        if arguments:
            item.text.append(arguments)
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.index,
                    delta=arguments,
                )
            )
        return out

    def _open(self, kind: str, out: list[bytes], call: dict[str, Any] | None = None) -> _Item:
        if self.current is not None and self.current.kind == kind and call is None:
            return self.current
        out += self._close()
        index = len(self.items)
        item_id = f"{_ID_PREFIX[kind]}_{self.rid.removeprefix('resp_')}_{index}"
        item = self.current = _Item(kind, index, item_id, call)
        self.items.append({})  # its place, filled when it is done
        added = self._done_item(item, status="in_progress")
        out.append(self._event("response.output_item.added", output_index=index, item=added))
        if kind == "message":
            part = self.shape.output_text("", [])
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        return item

    def _done_item(self, item: _Item, status: str = "completed") -> dict[str, Any]:
        text = "".join(item.text)
        if item.kind == "reasoning":
            return {**_reasoning_item(item.id, text), "status": status}
        if item.kind == "message":
            parts = [self.shape.output_text(text, item.logprobs)] if status == "completed" else []
            return _message_item(item.id, parts, status)
        return {**self.shape.function_call(item.id, item.call or {}, text), "status": status}

    def _close(self) -> list[bytes]:
        item, self.current = self.current, None
        if item is None:
            return []
        done = self._done_item(item)
        self.items[item.index] = done
        text = "".join(item.text)
        where = {"item_id": item.id, "output_index": item.index}
        out: list[bytes] = []
        if item.kind == "reasoning":
            out.append(self._event("response.reasoning_text.done", **where, content_index=0, text=text))
        elif item.kind == "message":
            part = done["content"][0]
            out += [
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=text,
                    logprobs=part["logprobs"] or [],
                ),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            out.append(self._event("response.function_call_arguments.done", **where, arguments=text))
        out.append(self._event("response.output_item.done", output_index=item.index, item=done))
        return out

    def finish_events(self) -> bytes:
        """The closing events, sent once the span is stored.

        The open item's done events, then the terminal `response.completed` (`response.incomplete`
        when cut at the token limit).
        """
        out = self._close()
        response = self.shape.response(self.rid, self.model, self.items, self.finish or "stop", self.usage)
        name = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self._event(name, response=response))
        return b"".join(out)

    def _event(self, name: str, **fields: Any) -> bytes:
        payload = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + name.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


def failed_event(message: str) -> bytes:
    """A terminal `response.failed` event: the stream broke or its span could not be stored."""
    response = {
        "id": "resp_failed",
        "object": "response",
        "status": "failed",
        "output": [],
        "error": {"code": "server_error", "message": message},
    }
    payload = {"type": "response.failed", "response": response}
    return b"event: response.failed\ndata: " + _json.encode(payload) + b"\n\n"

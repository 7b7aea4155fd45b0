"""A canned OpenAI-compatible upstream for benchmarks and tests (not a model: it samples nothing).

It answers like vLLM with `return_token_ids` and `logprobs`: synthetic, deterministic token ids
(the UTF-8 bytes of the rendered conversation and of the reply, so a growing conversation has
growing prompts exactly as with a real tokenizer) and logprobs. A `Script` can choose each reply
(the mini-swe-agent test scripts tool calls that way). `fixed=True` answers every POST with one
precomputed chat completion without reading the request, so the benchmark measures the gateway.
Written on asyncio + httptools to stay far faster than the proxy it is measured against.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httptools
import msgspec

Reply = dict[str, Any]
Script = Callable[[str, dict[str, Any]], Reply]
"""Chooses the reply: `{"content", "tool_calls"?, "finish_reason"?}`, `{"status": 4xx/5xx}` or
`{"raw": bytes}` (a 200 with that body, e.g. garbage)."""

_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()
_DEFAULT_REPLY: Reply = {"content": "Hello from the canned upstream.", "finish_reason": "stop"}


def render_prompt(body: dict[str, Any]) -> str:
    """The conversation as one string (a stand-in for a chat template)."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for message in body["messages"]:
            if isinstance(message, dict):
                content = message.get("content")
                text = content if isinstance(content, str) else _json.encode(content).decode()
                calls = message.get("tool_calls")
                tools = _json.encode(calls).decode() if calls else ""
                parts.append(f"<{message.get('role')}>{text}{tools}</>")
        return "".join(parts) + "<assistant>"
    value = body.get("prompt", body.get("input", ""))
    return value if isinstance(value, str) else _json.encode(value).decode()


def reply_text(reply: Reply) -> str:
    """What the reply contributes to the next prompt (content plus rendered tool calls)."""
    calls = reply.get("tool_calls")
    return str(reply.get("content") or "") + (_json.encode(calls).decode() if calls else "")


def _logprob(token: int) -> dict[str, Any]:
    return {"token": chr(token), "logprob": -0.5, "bytes": [token], "top_logprobs": []}


def chat_response(body: dict[str, Any], reply: Reply) -> bytes:
    """A vLLM-shaped chat completion with ids and logprobs."""
    prompt = list(render_prompt(body).encode())
    tokens = list(reply_text(reply).encode())
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    logprobs = {"content": [_logprob(t) for t in tokens]}
    return _json.encode({
        "id": "chatcmpl-canned", "object": "chat.completion", "created": 0, "model": "canned",
        "choices": [{
            "index": 0, "message": message, "logprobs": logprobs, "token_ids": tokens,
            "finish_reason": reply.get("finish_reason", "stop"),
        }],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                  "total_tokens": len(prompt) + len(tokens)},
        "prompt_token_ids": prompt,
    })  # fmt: skip


def chat_stream(body: dict[str, Any], reply: Reply) -> list[bytes]:
    """The same completion as SSE events, one token per chunk, then usage and `[DONE]`."""
    prompt = list(render_prompt(body).encode())
    tokens = list(reply_text(reply).encode())
    base = {"id": "chatcmpl-canned", "object": "chat.completion.chunk", "created": 0,
            "model": "canned"}  # fmt: skip
    first = {**base, "prompt_token_ids": prompt,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}]}  # fmt: skip
    events = [first]
    for position, token in enumerate(tokens):
        last = position == len(tokens) - 1
        delta: dict[str, Any] = {"content": chr(token)}
        if last and reply.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(reply["tool_calls"])]
        events.append({**base, "choices": [{
            "index": 0, "delta": delta, "token_ids": [token],
            "logprobs": {"content": [_logprob(token)]},
            "finish_reason": reply.get("finish_reason", "stop") if last else None,
        }]})  # fmt: skip
    events.append(
        {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt) + len(tokens),
            },
        }
    )
    return [b"data: " + _json.encode(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


class CannedUpstream:
    """The server: `await start()`, then `url`; `requests` counts the calls it answered."""

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        event_delay_s: float = 0.0,
        script: Script | None = None,
        fixed: bool = False,
        idle_close_s: float = 0.0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.delay_s = delay_s  # before each POST is answered (a sampling call's latency)
        # > 0: a request arriving on a connection idle longer than this is dropped unanswered, as
        # when a server's keep-alive timer closes the connection just as the request comes in.
        self.idle_close_s = idle_close_s
        self.dropped = 0
        self.event_delay_s = event_delay_s
        self.script = script
        self.fixed = fixed
        self.host = host
        self.port = port
        self.requests = 0  # calls answered (`/tokenize`, which it lacks, is counted in renders_asked)
        self.renders_asked = 0
        self.aborted = 0
        self.active = 0
        self.max_active = 0
        self.bodies: list[dict[str, Any]] = []
        self._fixed_reply = _http(200, chat_response({"messages": []}, _DEFAULT_REPLY))
        self.connections: set[asyncio.BaseTransport] = set()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        """Base URL (no `/v1`)."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Listen (port 0 picks a free port)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and drop connections."""
        if self._server is not None:
            self._server.close()
            for transport in list(self.connections):
                transport.close()
            await self._server.wait_closed()

    def answer(self, method: str, path: str, body: bytes) -> bytes | list[bytes]:  # noqa: PLR0911
        """A whole HTTP response, or the frames of a chunked SSE response."""
        if path == "/tokenize":  # not vLLM: the gateway's token-in mode falls back to plain calls
            self.renders_asked += 1
            return _http(404, _error_body(path, "Not Found"))
        self.requests += 1
        if method == "GET":
            if path == "/health":
                return _http(200, b"")
            return _http(200, _json.encode({"object": "list", "data": [{"id": "canned"}]}))
        if self.fixed:
            return self._fixed_reply
        try:
            request = _decode.decode(body)
        except (msgspec.DecodeError, RecursionError):  # vLLM answers 400 to a too deeply nested body too
            return _http(400, _error_body(path, "bad json"))
        if not isinstance(request, dict):
            return _http(400, _error_body(path, "the body must be a JSON object"))
        self.bodies.append(request)
        reply = self.script(path, request) if self.script else _DEFAULT_REPLY
        if "raw" in reply:
            return _http(200, reply["raw"])
        if reply.get("status", 200) != 200:
            return _http(int(reply["status"]), _error_body(path, str(reply.get("content", ""))))
        if request.get("stream"):
            return chat_stream(request, reply)
        return _http(200, chat_response(request, reply))


def _error_body(path: str, message: str) -> bytes:
    """The error envelope of vLLM: Anthropic's on its `/v1/messages` routes, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        return _json.encode({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
    return _json.encode({"error": {"message": message, "type": "BadRequestError"}})


def _http(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = b"OK" if status == 200 else b"Error"
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        % (status, reason, content_type, len(body))
    ) + body


_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class _Connection(asyncio.Protocol):
    """One client connection: parse requests, answer them in order."""

    def __init__(self, server: CannedUpstream) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.pending: asyncio.Future[None] | None = None
        self.idle_since = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.server.connections.discard(self.transport)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        idle_close_s = self.server.idle_close_s
        if idle_close_s and self.transport and time.monotonic() - self.idle_since > idle_close_s:
            self.server.dropped += 1
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        path = self.url.split(b"?")[0].decode()
        body = b"".join(self.body)
        self.url, self.body = b"", []
        answer = self.server.answer(method, path, body)
        delay_s = self.server.delay_s if method == "POST" else 0.0  # health checks answer at once
        if isinstance(answer, bytes) and not delay_s and self.pending is None:
            self._write(answer)
            return
        previous = self.pending
        self.pending = asyncio.ensure_future(self._deliver(previous, answer, delay_s))

    async def _deliver(
        self, previous: asyncio.Future[None] | None, answer: bytes | list[bytes], delay_s: float
    ) -> None:
        if previous is not None:
            await previous
        server = self.server
        server.active += 1
        server.max_active = max(server.max_active, server.active)
        try:
            await self._answer(answer, delay_s)
        finally:
            server.active -= 1

    async def _answer(self, answer: bytes | list[bytes], delay_s: float) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        if isinstance(answer, bytes):
            self._write(answer)
            return
        self._write(_SSE_HEAD)
        for frame in answer:
            if self.transport is None:
                self.server.aborted += 1
                return
            self._write(b"%x\r\n%s\r\n" % (len(frame), frame))
            if self.server.event_delay_s:
                await asyncio.sleep(self.server.event_delay_s)
        self._write(b"0\r\n\r\n")

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.idle_since = time.monotonic()


def main() -> None:
    """`python -m harnessrl.testkit.canned_upstream --port P [--delay S] [--fixed]`."""
    import argparse

    import uvloop

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each POST is answered")
    parser.add_argument("--fixed", action="store_true", help="one precomputed answer to every POST")
    args = parser.parse_args()

    async def serve() -> None:
        upstream = CannedUpstream(delay_s=args.delay, fixed=args.fixed, port=args.port)
        await upstream.start()
        await asyncio.Event().wait()

    uvloop.run(serve())


if __name__ == "__main__":
    main()

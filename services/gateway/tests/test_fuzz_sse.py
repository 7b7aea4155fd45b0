"""The SSE capture under random re-chunkings: the client's bytes and the span never depend on chunking.

Recorded upstream streams (the canned upstream's chat streams, with and without tool calls, as
vLLM sends them; a vLLM completions stream; each also with CRLF line ends) are split at random
byte positions (down to one byte per read, as TCP may deliver them) and pumped through the
gateway's own parser and relays (`SseParser`, `StreamRelay.relay`, the API's capture) for every
API: chat, completions, responses (chat chunks in, Responses events out) and messages (chat chunks
in, Anthropic events out). What the client receives must be byte-identical to the stream read in
one piece, and the span built from the capture identical too.
"""

from __future__ import annotations

import re
from typing import Any, cast

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.gateway.capture import Asked
from harnessrl.gateway.dialects import API_BY_PATH, Api
from harnessrl.gateway.recorder import CallRecord, _draft
from harnessrl.gateway.sse import SseParser
from harnessrl.gateway.stream_relay import StreamRelay
from harnessrl.shared.contracts import Span
from harnessrl.testkit.canned_upstream import chat_stream

CHUNKINGS = 3000
_json = msgspec.json.Encoder()

CHAT_REQUEST: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hi, then list the files."}]}
TOOL_REPLY = {
    "content": "Let me look. é ✓",
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}
    ],
    "finish_reason": "tool_calls",
}


def _completions_stream() -> bytes:
    """A vLLM `/v1/completions` stream with `return_token_ids` and `logprobs=0`."""
    text = "Hello, world"
    base = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny"}
    events: list[dict[str, Any]] = []
    for position, char in enumerate(text):
        choice: dict[str, Any] = {
            "index": 0,
            "text": char,
            "token_ids": [ord(char)],
            "logprobs": {
                "tokens": [char],
                "token_logprobs": [-0.25],
                "top_logprobs": [None],
                "text_offset": [position],
            },
            "finish_reason": "stop" if position == len(text) - 1 else None,
        }
        if position == 0:
            choice["prompt_token_ids"] = [1, 2, 3]
        events.append({**base, "choices": [choice]})
    events.append({**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(text)}})
    return b"".join(b"data: " + _json.encode(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _chat(reply: dict[str, Any]) -> bytes:
    return b"".join(chat_stream(CHAT_REQUEST, reply))


UPSTREAM_STREAMS = {
    "chat": _chat({"content": "Hello from the canned upstream.", "finish_reason": "stop"}),
    "chat-tools": _chat(TOOL_REPLY),
    "completions": _completions_stream(),
}
UPSTREAM_STREAMS |= {
    f"{name}-crlf": raw.replace(b"\n", b"\r\n") for name, raw in list(UPSTREAM_STREAMS.items())
}
REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {**CHAT_REQUEST, "stream": True},
    "/v1/completions": {"prompt": "Say hi", "stream": True},
    "/v1/responses": {"input": "Say hi, then list the files.", "stream": True},
    "/v1/messages": {**CHAT_REQUEST, "max_tokens": 32, "stream": True},
}
CASES = [
    (path, name)
    for path in REQUESTS
    for name in UPSTREAM_STREAMS
    if name.startswith("completions") == (path == "/v1/completions")
]
_CREATED = re.compile(rb'"created_at":\d+')
_CALL = CallRecord(run="fuzz", episode="ep-sse", api="chat", span_id="span-sse")


def relay(api: Api, asked: Asked, chunks: list[bytes]) -> tuple[bytes, Span, list[int] | None]:
    """What the client gets, the span and the prompt ids, pumped as `StreamRelay.pump` does."""
    stream = StreamRelay(cast(Any, None), api, _CALL, cast(Any, None), asked)
    parser, out = SseParser(), []
    for chunk in chunks:
        out += [stream.relay(event) for event in parser.feed(chunk)]
    out += [stream.relay(event) for event in parser.tail()]
    client = _CREATED.sub(b'"created_at":0', b"".join(out) + b"".join(stream.held))
    span = _draft(_CALL, stream.capture, status="ok", weight_version_end=0, error=None)
    return client, msgspec.structs.replace(span, latency_s=0.0), stream.capture.prompt_ids


def split(raw: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(raw) + 1) for cut in cuts})
    return [raw[start:end] for start, end in zip([0, *points], [*points, len(raw)], strict=True)]


def asked_for(api: Api, path: str) -> Asked:
    return api.prepare(msgspec.json.decode(_json.encode(REQUESTS[path])))


def test_each_recorded_stream_relays_to_a_complete_answer() -> None:
    for path, name in CASES:
        api = API_BY_PATH[path]
        client, span, prompt = relay(api, asked_for(api, path), [UPSTREAM_STREAMS[name]])
        terminal = b"event: message_stop" if path == "/v1/messages" else b"[DONE]"
        if path == "/v1/responses":
            terminal = b"response.completed"
        assert terminal in client, (path, name, client[-300:])
        assert span.completions and span.completions[0].token_ids, (path, name)
        assert len(span.completions[0].logprobs) == len(span.completions[0].token_ids), (path, name)
        assert prompt, (path, name)


@settings(
    deadline=None,
    database=None,
    derandomize=True,
    max_examples=CHUNKINGS,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    case=st.sampled_from(CASES),
    cuts=st.one_of(
        st.lists(st.integers(0, 10**6), max_size=40),
        st.just(list(range(1, 5000))),  # one byte per read
        st.integers(1, 9).map(lambda step: list(range(step, 5000, step))),
    ),
)
def test_any_chunking_gives_the_same_bytes_and_span(case: tuple[str, str], cuts: list[int]) -> None:
    path, name = case
    api, raw = API_BY_PATH[path], UPSTREAM_STREAMS[name]
    whole = relay(api, asked_for(api, path), [raw])
    chunks = split(raw, cuts)
    assert b"".join(chunks) == raw
    assert relay(api, asked_for(api, path), chunks) == whole

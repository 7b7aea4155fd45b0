"""Hypothesis fuzzing of every gateway endpoint: 10,000 generated requests, no 5xx, no crash.

The gateway runs in-process (Litestar's test client driving the real ASGI app, a real NatsBus on the
session's nats-server) in front of a canned upstream that is up, so no 5xx is legitimate here. The
upstream refuses what vLLM would refuse (a non-numeric `temperature`, ...) with an OpenAI-shaped
400, so refusals relayed from it are checked too. Every refusal must be in the route's own
envelope (OpenAI, or Anthropic for `/v1/messages*`), every accepted LLM call must name its span,
and each episode's stream must hold exactly the spans of its accepted calls, once each. `REQUESTS`
is what each test sends; they add up to `TOTAL_REQUESTS` (>= 10,000) and all run in `make test`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from harnessrl.gateway.asgi_app import create_app
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.keys import sign_episode_key
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.canned_upstream import Reply
from harnessrl.testkit.gateway import (
    TEST_ADMIN_TOKEN,
    TEST_KEY_SECRET,
    KeyedEpisode,
    settings_for,
    threaded_canned_upstream,
)

REQUESTS = {
    "/v1/chat/completions": 2000,
    "/v1/completions": 1500,
    "/v1/responses": 1500,
    "/v1/messages": 2000,
    "passthrough": 1000,
    "artifact": 500,
    "operations": 750,
    "admin": 750,
}
TOTAL_REQUESTS = sum(REQUESTS.values())
assert TOTAL_REQUESTS >= 10_000
LLM_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]
MAX_BODY = 64 * 1024
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def fuzz(examples: int) -> settings:
    """The fuzz settings, `examples` requests."""
    return settings(FUZZ, max_examples=examples)


logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
_SAMPLING_NUMBERS = ("temperature", "top_p", "top_k", "n", "presence_penalty", "frequency_penalty")

# --- request shapes --------------------------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
text = st.text(max_size=30)
role = st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "developer"]), json_value)
tool_call = st.fixed_dictionaries(
    {
        "id": text,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": text, "arguments": st.one_of(text, json_value)}),
    },
)
chat_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(text, json_value)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": json_value}),
    json_value,
)
chat_message = st.fixed_dictionaries(
    {"role": role, "content": st.one_of(text, st.lists(chat_part, max_size=3), json_value)},
    optional={
        "tool_calls": st.one_of(st.lists(tool_call, max_size=2), json_value),
        "tool_call_id": st.one_of(text, json_value),
        "name": json_value,
    },
)
anthropic_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(text, json_value)}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.one_of(text, json_value),
            "name": st.one_of(text, json_value),
            "input": json_value,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": st.one_of(text, json_value),
            "content": st.one_of(text, st.lists(json_value, max_size=2), json_value),
        },
        optional={"is_error": json_value},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "thinking", "document"])}, optional={"x": json_value}
    ),
    json_value,
)
anthropic_message = st.fixed_dictionaries(
    {"role": role, "content": st.one_of(text, st.lists(anthropic_block, max_size=3), json_value)}
)
anthropic_tool = st.one_of(
    st.fixed_dictionaries(
        {"name": st.one_of(text, json_value)},
        optional={"description": json_value, "input_schema": json_value},
    ),
    json_value,
)
responses_item = st.one_of(
    st.fixed_dictionaries(
        {"role": role, "content": st.one_of(text, st.lists(json_value, max_size=3))},
        optional={"type": st.sampled_from(["message", "function_call_output"])},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": json_value, "output": json_value}
    ),
    json_value,
)
common_fields = {
    "model": st.one_of(text, json_value),
    "stream": st.one_of(st.booleans(), json_value),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_value}), json_value),
    "temperature": st.one_of(st.floats(0, 2), json_value),
    "top_p": json_value,
    "n": st.one_of(st.integers(-2, 3), json_value),
    "max_tokens": st.one_of(st.integers(-5, 100), json_value),
    "seed": json_value,
    "stop": json_value,
}
api_fields: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/v1/chat/completions": {
        "messages": st.one_of(st.lists(chat_message, max_size=3), json_value),
        "logprobs": json_value,
        "top_logprobs": json_value,
        "return_token_ids": json_value,
        "tools": json_value,
        "tool_choice": json_value,
        "response_format": json_value,
    },
    "/v1/completions": {
        "prompt": st.one_of(
            text, st.lists(st.integers(-10, 2**40), max_size=5), st.lists(text, max_size=3), json_value
        ),
        "logprobs": json_value,
        "echo": json_value,
        "return_token_ids": json_value,
        "suffix": json_value,
    },
    "/v1/responses": {
        "input": st.one_of(text, st.lists(responses_item, max_size=3), json_value),
        "instructions": json_value,
        "include": st.one_of(st.lists(text, max_size=2), json_value),
        "enable_response_messages": json_value,
        "max_output_tokens": json_value,
        "tools": json_value,
        "previous_response_id": json_value,
        "reasoning": json_value,
    },
    "/v1/messages": {
        "messages": st.one_of(st.lists(anthropic_message, max_size=3), json_value),
        "system": st.one_of(text, st.lists(anthropic_block, max_size=2), json_value),
        "tools": st.one_of(st.lists(anthropic_tool, max_size=2), json_value),
        "tool_choice": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "none", "tool"])}, optional={"name": json_value}
            ),
            json_value,
        ),
        "stop_sequences": json_value,
        "metadata": json_value,
        "thinking": json_value,
        "top_k": json_value,
    },
}


REQUIRED = {
    "/v1/chat/completions": ("messages",),
    "/v1/completions": ("prompt",),
    "/v1/responses": ("input",),
    "/v1/messages": ("messages", "max_tokens"),
}


def api_body(path: str) -> st.SearchStrategy[Any]:
    """Bodies shaped like `path`'s requests (each field sometimes junk), plus unknown fields."""
    fields = {**common_fields, **api_fields[path]}
    required = {name: fields[name] for name in REQUIRED[path]}
    optional = {name: value for name, value in fields.items() if name not in required}
    extra = st.dictionaries(st.text(max_size=12), json_value, max_size=2)
    complete = st.tuples(st.fixed_dictionaries(required, optional=optional), extra)
    partial = st.tuples(st.fixed_dictionaries({}, optional=fields), extra)
    shaped = st.one_of(complete, complete, partial).map(lambda parts: {**parts[1], **parts[0]})
    return st.one_of(shaped, shaped, shaped, json_value)


def nested(depth: int) -> bytes:
    """A body nested `depth` arrays deep inside a valid-looking request."""
    return (
        b'{"messages": [], "prompt": "x", "input": "x", "max_tokens": 1, "x": '
        + b"[" * depth
        + b"]" * depth
        + b"}"
    )


def raw_bodies(path: str) -> st.SearchStrategy[bytes]:
    """Encoded shaped bodies, random bytes, broken JSON and deep nesting."""
    encoded = api_body(path).map(msgspec.json.encode)
    return st.one_of(
        encoded,
        encoded,
        encoded,
        encoded,
        st.binary(max_size=64),
        encoded.flatmap(lambda raw: st.integers(0, max(len(raw) - 1, 0)).map(lambda cut: raw[:cut])),
        st.integers(1, 5000).map(nested),
        st.just(b"\xff\xfe{}"),
        st.just(b'{"messages": [], "x": "\\ud800"}'),
    )


# --- the gateway under test ------------------------------------------------------------------------


def vllm_like(path: str, request: dict[str, Any]) -> Reply:
    """The canned reply, or the 400 vLLM answers for a sampling parameter that is not a number."""
    for name in _SAMPLING_NUMBERS:
        value = request.get(name)
        if (
            name in request
            and value is not None
            and (not isinstance(value, int | float) or isinstance(value, bool))
        ):
            return {"status": 400, "content": f"`{name}` must be a number"}
    return {"content": "Hello from the canned upstream.", "finish_reason": "stop"}


@pytest.fixture(scope="module")
def client(nats_server: NatsServer) -> Iterator[TestClient[Any]]:
    with threaded_canned_upstream(script=vllm_like) as upstream:
        settings_ = settings_for([upstream.url], max_body_bytes=MAX_BODY, max_artifact_bytes=MAX_BODY)
        app = create_app(settings_, NatsBus(nats_server.url), owns_bus=True)
        with TestClient(app, raise_server_exceptions=True) as test_client:
            yield test_client


Say = Callable[[str], None]


class Tally:
    """Statuses seen and spans named by one test's requests; prints requests/s at the end."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.statuses: Counter[int] = Counter()
        self.span_ids: list[str] = []
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    def report(self, say: Say) -> None:
        elapsed, cpu = time.perf_counter() - self.started, time.process_time() - self.cpu_started
        say(
            f"fuzz {self.name}: {self.sent} requests in {elapsed:.1f}s ({self.sent / elapsed:.0f}/s; "
            f"{cpu:.1f}s of CPU, {self.sent / cpu:.0f}/CPU-s), statuses {dict(sorted(self.statuses.items()))}"
        )


def auth_for(kind: str, episode: KeyedEpisode) -> tuple[dict[str, str], str]:
    """Headers and path prefix presenting `episode`'s key as `kind` (or a bad key)."""
    bad = {
        "junk": "hrl_junk.junk",
        "expired": sign_episode_key(TEST_KEY_SECRET.encode(), episode.run, episode.episode, -1),
        "other-secret": sign_episode_key(b"not-the-secret", episode.run, episode.episode, 600),
        "tampered": episode.key[:-2] + ("AA" if not episode.key.endswith("AA") else "BB"),
    }
    if kind == "bearer":
        return {"authorization": f"Bearer {episode.key}"}, ""
    if kind == "x-api-key":
        return {"x-api-key": episode.key}, ""
    if kind == "path":
        return {}, f"/e/{episode.key}"
    if kind == "none":
        return {}, ""
    return {"authorization": f"Bearer {bad[kind]}"}, ""


auth_kinds = st.sampled_from(
    ["bearer", "bearer", "x-api-key", "path", "none", "junk", "expired", "other-secret", "tampered"]
)


def check_envelope(response: Any, dialect: str) -> None:
    """A non-streamed answer: JSON; a refusal in `dialect`'s error envelope; never a 5xx."""
    assert response.status_code < 500, (response.status_code, response.text)
    if response.request.method == "HEAD" or response.status_code in (204, 304):
        return
    if response.status_code == 200 and response.headers.get("content-type", "").startswith(
        "text/event-stream"
    ):
        return  # relayed as the upstream streamed it (the canned upstream streams any `stream: true`)
    if response.status_code < 400:
        if response.headers.get("content-type", "").startswith("application/json"):
            response.json()
        return
    payload = response.json()
    if dialect == "anthropic":
        assert payload["type"] == "error", payload
        assert isinstance(payload["error"]["type"], str) and isinstance(payload["error"]["message"], str), (
            payload
        )
    else:
        assert isinstance(payload["error"]["type"], str) and isinstance(payload["error"]["message"], str), (
            payload
        )


def check_stream(response: Any, path: str) -> None:
    """A streamed answer runs to its terminal event with no error event."""
    body = response.text
    assert "error" not in [
        line.removeprefix("event: ") for line in body.splitlines() if line.startswith("event:")
    ]
    assert not re.search(r'"error":\s*\{', body), body[-500:]
    terminal = {"/v1/messages": "event: message_stop", "/v1/responses": "event: response.completed"}
    assert terminal.get(path, "data: [DONE]") in body, body[-500:]


def _stream_flipped(raw: bytes) -> bytes:
    """`raw` with `stream` negated when it is a JSON object (else unchanged)."""
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return raw
    if not isinstance(body, dict):
        return raw
    return msgspec.json.encode({**body, "stream": body.get("stream") is not True})


async def _stored_span_ids(url: str, episode: KeyedEpisode) -> list[str]:
    bus = NatsBus(url)
    await bus.connect()
    try:
        return [span.span_id for span in await episode.spans(bus)]
    finally:
        await bus.close()


def check_spans(nats_server: NatsServer, episode: KeyedEpisode, named: list[str]) -> None:
    """The episode's stream holds each accepted call's span exactly once, and nothing else."""
    stored = asyncio.run(_stored_span_ids(nats_server.url, episode))
    duplicates = [span for span, count in Counter(stored).items() if count > 1]
    assert not duplicates, duplicates
    assert sorted(stored) == sorted(named), (len(stored), len(named))


# --- the tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", LLM_PATHS)
def test_llm_routes_answer_every_generated_request(
    client: TestClient[Any], nats_server: NatsServer, path: str, say: Say
) -> None:
    tally, episode = Tally(path), KeyedEpisode(run="fuzz")
    dialect = "anthropic" if path == "/v1/messages" else "openai"

    def one_request(raw: bytes, auth: str, content_type: str) -> None:
        headers, prefix = auth_for(auth, episode)
        headers["content-type"] = content_type
        response = client.post(prefix + path, content=raw, headers=headers)
        tally.statuses[response.status_code] += 1
        span = response.headers.get("x-harnessrl-span")
        if response.status_code == 200:
            assert span, response.headers
            tally.span_ids.append(span)
        else:
            assert span is None, (response.status_code, span)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            assert response.status_code == 200
            check_stream(response, path)
        else:
            check_envelope(response, dialect)

    @fuzz(REQUESTS[path] // 2)
    @given(
        raw=raw_bodies(path),
        auth=auth_kinds,
        content_type=st.sampled_from(["application/json", "text/plain"]),
    )
    def two_requests(raw: bytes, auth: str, content_type: str) -> None:
        """The body as drawn, then (generation is the slow part) its twin: valid key, `stream` flipped."""
        one_request(raw, auth, content_type)
        one_request(_stream_flipped(raw), "bearer", "application/json")

    two_requests()
    tally.report(say)
    assert tally.sent >= REQUESTS[path]
    assert tally.statuses[200] > 0 and tally.statuses[400] > 0 and tally.statuses[401] > 0
    check_spans(nats_server, episode, tally.span_ids)


def test_passthrough_routes_never_5xx_and_leave_no_span(
    client: TestClient[Any], nats_server: NatsServer, say: Say
) -> None:
    tally, episode = Tally("passthrough"), KeyedEpisode(run="fuzz")

    @fuzz(REQUESTS["passthrough"])
    @given(
        route=st.sampled_from(["/v1/models", "/v1/messages/count_tokens"]),
        method=st.sampled_from(["GET", "POST", "POST", "PUT", "DELETE"]),
        raw=raw_bodies("/v1/messages"),
        auth=auth_kinds,
    )
    def one_request(route: str, method: str, raw: bytes, auth: str) -> None:
        headers, prefix = auth_for(auth, episode)
        response = client.request(method, prefix + route, content=raw, headers=headers)
        tally.statuses[response.status_code] += 1
        assert "x-harnessrl-span" not in response.headers
        check_envelope(response, "anthropic" if route.startswith("/v1/messages") else "openai")

    one_request()
    tally.report(say)
    assert tally.sent >= REQUESTS["passthrough"] and tally.statuses[200] > 0
    check_spans(nats_server, episode, [])


def test_artifact_upload_never_5xx(client: TestClient[Any], say: Say) -> None:
    tally, episode = Tally("artifact"), KeyedEpisode(run="fuzz")

    @fuzz(REQUESTS["artifact"])
    @given(
        method=st.sampled_from(["PUT", "PUT", "PUT", "POST", "GET"]),
        kind=st.one_of(
            st.sampled_from(["patch", "answer", "file"]), st.text(max_size=10).filter(str.isprintable)
        ),
        data=st.one_of(st.binary(max_size=2048), st.just(b"x" * (MAX_BODY + 1))),
        auth=auth_kinds,
        declared=st.sampled_from([None, "0", "abc", "-1", str(10**12)]),
    )
    def one_request(method: str, kind: str, data: bytes, auth: str, declared: str | None) -> None:
        auth_headers, prefix = auth_for(auth, episode)
        headers: dict[str, str | bytes] = {**auth_headers, "x-artifact-kind": kind.encode()}
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
            headers["content-length"] = declared
            data = b""
        response = client.request(method, prefix + "/harnessrl/v1/artifact", content=data, headers=headers)
        tally.statuses[response.status_code] += 1
        check_envelope(response, "openai")
        if response.status_code == 200:
            assert response.json()["size"] == len(data)

    one_request()
    tally.report(say)
    assert tally.sent >= REQUESTS["artifact"] and tally.statuses[200] > 0 and tally.statuses[413] > 0


unknown_path = st.one_of(
    st.sampled_from(
        [
            "/",
            "/v1",
            "/v1/",
            "/v1/chat",
            "/e/",
            "/e/x",
            "/e//v1/chat/completions",
            "/harnessrl/",
            "/admin",
            "/healthz/x",
            "/v2/chat/completions",
            "/v1/messages/",
            "/v1//messages",
        ]
    ),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/_.-%", max_size=30).map(lambda p: "/" + p),
)


def test_operations_and_unknown_routes_never_5xx(client: TestClient[Any], say: Say) -> None:
    tally = Tally("operations")

    @fuzz(REQUESTS["operations"])
    @given(
        path=st.one_of(st.sampled_from(["/healthz", "/readyz", "/metrics"]), unknown_path),
        method=st.sampled_from(METHODS),
        query=st.text(max_size=12).filter(str.isprintable),
        raw=st.binary(max_size=64),
    )
    def one_request(path: str, method: str, query: str, raw: bytes) -> None:
        response = client.request(method, path, params={"q": query} if query else None, content=raw)
        tally.statuses[response.status_code] += 1
        dialect = "anthropic" if "/v1/messages" in path else "openai"
        check_envelope(response, dialect)
        if path in ("/healthz", "/readyz", "/metrics") and method == "GET":
            assert response.status_code == 200, response.text

    one_request()
    tally.report(say)
    assert tally.sent >= REQUESTS["operations"]
    assert tally.statuses[200] > 0 and tally.statuses[404] > 0 and tally.statuses[405] > 0


@pytest.fixture(scope="module")
def admin_client(nats_server: NatsServer) -> Iterator[TestClient[Any]]:
    """A gateway of its own: fuzzed registrations and pauses must not touch the LLM routes' pool."""
    with threaded_canned_upstream() as upstream:
        app = create_app(settings_for([upstream.url]), NatsBus(nats_server.url), owns_bus=True)
        with TestClient(app, raise_server_exceptions=True) as test_client:
            yield test_client


registration = st.fixed_dictionaries(
    {
        "url": st.one_of(
            st.sampled_from(
                [
                    "http://127.0.0.1:9",
                    "https://vllm.example:8000",
                    "",
                    "ftp://x",
                    "not a url",
                    "http://[::1",
                    "http://x:99999",
                ]
            ),
            text,
            json_value,
        )
    },
    optional={
        "model": st.one_of(text, json_value),
        "weight_version": st.one_of(st.integers(-5, 2**40), json_value),
        "active": st.one_of(st.booleans(), json_value),
        "extra": json_value,
    },
)


def test_admin_routes_never_5xx(admin_client: TestClient[Any], say: Say) -> None:
    tally = Tally("admin")

    @fuzz(REQUESTS["admin"])
    @given(
        route=st.sampled_from(
            ["/admin/pause", "/admin/resume", "/admin/upstreams", "/admin/status", "/admin/x"]
        ),
        method=st.sampled_from(["POST", "POST", "GET", "PUT", "DELETE"]),
        token=st.sampled_from(
            [f"Bearer {TEST_ADMIN_TOKEN}"] * 3
            + [
                "",
                "Bearer",
                "Bearer wrong",
                f"Basic {TEST_ADMIN_TOKEN}",
                f"Bearer {KeyedEpisode().key}",
                f"bearer  {TEST_ADMIN_TOKEN} ",
            ]
        ),
        drain=st.one_of(st.none(), st.sampled_from(["0", "0.01", "-1", "nan", "inf", "abc", "1e400", ""])),
        raw=st.one_of(
            registration.map(msgspec.json.encode), st.binary(max_size=32), st.integers(1, 3000).map(nested)
        ),
    )
    def one_request(route: str, method: str, token: str, drain: str | None, raw: bytes) -> None:
        headers = {"content-type": "application/json", **({"authorization": token} if token else {})}
        params = {"drain_s": drain} if drain is not None else None
        response = admin_client.request(method, route, params=params, content=raw, headers=headers)
        tally.statuses[response.status_code] += 1
        check_envelope(response, "openai")
        if response.status_code < 400 and route != "/admin/status":
            assert (
                token.rsplit(maxsplit=1)[-1] == TEST_ADMIN_TOKEN
                and token.split(maxsplit=1)[0].lower() == "bearer"
            )
        if response.status_code == 200 and route == "/admin/pause":
            assert admin_client.post("/admin/resume", headers=headers).status_code == 200

    one_request()
    tally.report(say)
    assert tally.sent >= REQUESTS["admin"]
    assert tally.statuses[200] > 0 and tally.statuses[401] > 0 and tally.statuses[400] > 0

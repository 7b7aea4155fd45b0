"""Hypothesis fuzzing of every endpoint: >= 1,000 generated requests each, no 5xx, no crash.

The gateway runs in-process (Litestar's test client, real NatsBus) in front of a canned upstream
that is up, so no 5xx is legitimate here; every answer must be JSON in the endpoint's envelope.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from harnessrl.gateway.asgi_app import create_app
from harnessrl.shared.bus import NatsBus
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.gateway import KeyedEpisode, settings_for, threaded_canned_upstream

EXAMPLES = 1000
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False),
    st.text(max_size=20),
)  # fmt: skip
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": json_value}
)
known_fields = {
    "messages": st.one_of(st.lists(message, max_size=3), json_value),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(0, 1000), max_size=5), json_value),
    "input": st.one_of(st.text(max_size=30), json_value),
    "max_tokens": st.one_of(st.integers(-5, 100), json_value),
    "model": st.one_of(st.text(max_size=10), json_value),
    "stream": st.one_of(st.booleans(), json_value),
    "stream_options": json_value,
    "logprobs": json_value,
    "top_logprobs": json_value,
    "return_token_ids": json_value,
    "include": json_value,
    "enable_response_messages": json_value,
    "temperature": json_value,
    "tools": json_value,
    "n": json_value,
}
body = st.one_of(
    st.fixed_dictionaries({}, optional=known_fields).flatmap(
        lambda d: st.dictionaries(st.text(max_size=12), json_value, max_size=3).map(
            lambda extra: {**extra, **d}
        )
    ),
    json_value,
)
raw_body = st.one_of(body.map(msgspec.json.encode), st.binary(max_size=64))


@pytest.fixture(scope="module")
def client(nats_server: NatsServer) -> Iterator[TestClient[Any]]:
    with threaded_canned_upstream() as upstream:
        app = create_app(settings_for([upstream.url]), NatsBus(nats_server.url), owns_bus=True)
        with TestClient(app, raise_server_exceptions=True) as test_client:
            yield test_client


@pytest.fixture(scope="module")
def key() -> str:
    return KeyedEpisode(run="fuzz").key


def _check(response: Any, path: str) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.status_code == 200
        return
    payload = response.json()
    if response.status_code >= 400:
        if path == "/v1/messages":
            assert payload["type"] == "error" and payload["error"]["type"], payload
        else:
            assert payload["error"]["type"], payload


@pytest.mark.parametrize("path", PATHS)
def test_generated_requests_never_5xx(client: TestClient[Any], key: str, path: str) -> None:
    statuses: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )  # fmt: skip
    @given(raw=raw_body, auth=st.sampled_from(["bearer", "x-api-key", "path", "none", "junk"]))
    def one_request(raw: bytes, auth: str) -> None:
        headers = {"content-type": "application/json"}
        url = path
        if auth == "bearer":
            headers["authorization"] = f"Bearer {key}"
        elif auth == "x-api-key":
            headers["x-api-key"] = key
        elif auth == "path":
            url = f"/e/{key}{path}"
        elif auth == "junk":
            headers["authorization"] = "Bearer hrl_junk.junk"
        response = client.post(url, content=raw, headers=headers)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        _check(response, path)

    one_request()
    assert sum(statuses.values()) >= EXAMPLES
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0 and statuses.get(401, 0) > 0

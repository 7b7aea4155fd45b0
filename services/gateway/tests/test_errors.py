"""Every bad input gets its status and its API's error envelope, and leaves no span."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus
from harnessrl.shared.contracts import AgentExited, EpisodeCompleted
from harnessrl.shared.keys import sign_episode_key
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def gateway(canned_gateway: RunningGateway) -> RunningGateway:
    return canned_gateway


@pytest.fixture
def bus(module_bus: Bus) -> Bus:
    return module_bus


async def _post(
    url: str, *, key: str | None, body: Any = None, raw: bytes | None = None,
    headers: dict[str, str] | None = None, method: str = "POST",
) -> tuple[int, dict[str, Any], dict[str, str]]:  # fmt: skip
    all_headers = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        all_headers["authorization"] = f"Bearer {key}"
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, url, json=body if raw is None else None, data=raw, headers=all_headers
        ) as response,
    ):
        return response.status, await response.json(content_type=None), dict(response.headers)


def _openai_error(payload: dict[str, Any], kind: str) -> None:
    assert set(payload) == {"error"}
    assert payload["error"]["type"] == kind
    assert isinstance(payload["error"]["message"], str)


def _anthropic_error(payload: dict[str, Any], kind: str) -> None:
    assert payload["type"] == "error"
    assert payload["error"]["type"] == kind


@pytest.mark.parametrize(
    ("key", "status", "kind"),
    [
        (None, 401, "authentication_error"),
        ("sk-not-an-episode-key", 401, "authentication_error"),
        (sign_episode_key(b"other-secret", "run1", "ep-x", 60), 401, "authentication_error"),
        (sign_episode_key(b"test-secret", "run1", "ep-x", -1), 401, "authentication_error"),
    ],
    ids=["no-key", "not-an-episode-key", "other-secret", "expired"],  # keys hold the time: ids must not
)
async def test_bad_keys_are_401(gateway: RunningGateway, key: str | None, status: int, kind: str) -> None:
    code, payload, _ = await _post(gateway.url + "/v1/chat/completions", key=key, body=CHAT)
    assert code == status
    _openai_error(payload, kind)
    code, payload, _ = await _post(gateway.url + "/v1/messages", key=key, body=ANTHROPIC)
    assert code == status
    _anthropic_error(payload, kind)


async def test_key_in_path_and_x_api_key_work(
    gateway: RunningGateway, episode: KeyedEpisode, bus: Bus
) -> None:
    url = f"{gateway.url}/e/{episode.key}/v1/chat/completions"
    code, payload, _ = await _post(url, key=None, body=CHAT)
    assert code == 200, payload
    headers = {"x-api-key": episode.key, "anthropic-version": "2023-06-01"}
    code, payload, _ = await _post(gateway.url + "/v1/chat/completions", key=None, body=CHAT, headers=headers)
    assert code == 200, payload
    assert len(await episode.spans(bus)) == 2


@pytest.mark.parametrize(
    ("path", "raw", "envelope"),
    [
        ("/v1/chat/completions", b"{not json", "openai"),
        ("/v1/chat/completions", b"[1, 2]", "openai"),
        ("/v1/chat/completions", b'{"messages": "hi"}', "openai"),
        ("/v1/chat/completions", b'{"messages": [], "stream": "yes"}', "openai"),
        ("/v1/completions", b'{"prompt": 3}', "openai"),
        ("/v1/responses", b'{"model": "m"}', "openai"),
        ("/v1/messages", b'{"messages": []}', "anthropic"),
        ("/v1/messages", b"\xff\xfe", "anthropic"),
    ],
)
async def test_malformed_bodies_are_400(
    gateway: RunningGateway, episode: KeyedEpisode, bus: Bus, path: str, raw: bytes, envelope: str
) -> None:
    code, payload, _ = await _post(gateway.url + path, key=episode.key, raw=raw)
    assert code == 400
    check = _anthropic_error if envelope == "anthropic" else _openai_error
    check(payload, "invalid_request_error")
    assert await episode.spans(bus) == []


async def test_oversized_body_is_413(gateway: RunningGateway, episode: KeyedEpisode, bus: Bus) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 5000}]}
    code, payload, _ = await _post(gateway.url + "/v1/chat/completions", key=episode.key, body=body)
    assert code == 413
    _openai_error(payload, "invalid_request_error")
    code, payload, _ = await _post(
        gateway.url + "/v1/messages", key=episode.key, body={**body, "max_tokens": 3}
    )
    assert code == 413
    _anthropic_error(payload, "request_too_large")
    assert await episode.spans(bus) == []


async def test_unknown_routes_and_methods(gateway: RunningGateway, episode: KeyedEpisode) -> None:
    code, payload, _ = await _post(gateway.url + "/v1/embeddings", key=episode.key, body={})
    assert code == 404
    _openai_error(payload, "not_found_error")
    code, payload, _ = await _post(gateway.url + "/nowhere", key=episode.key, body={})
    assert code == 404
    _openai_error(payload, "not_found_error")
    code, payload, _ = await _post(gateway.url + "/v1/chat/completions", key=episode.key, method="GET")
    assert code == 405
    _openai_error(payload, "invalid_request_error")


async def _wait_closed(gateway: RunningGateway, episode: KeyedEpisode) -> None:
    for _ in range(200):
        if gateway.gateway.episodes.is_closed(episode.run, episode.episode):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the gateway never saw the episode close")


@pytest.mark.parametrize("event", ["agent_exited", "completed"])
async def test_closed_episode_is_403(
    gateway: RunningGateway, episode: KeyedEpisode, bus: Bus, event: str
) -> None:
    code, _, _ = await _post(gateway.url + "/v1/chat/completions", key=episode.key, body=CHAT)
    assert code == 200
    common = {"run": episode.run, "episode": episode.episode, "task": "t", "group": "g"}
    message = AgentExited(**common) if event == "agent_exited" else EpisodeCompleted(**common, reward=1.0)
    subject = subjects.episode_event(episode.run, episode.episode, event)
    await bus.publish(subject, message, msg_id=f"{episode.episode}:{event}")
    await _wait_closed(gateway, episode)
    code, payload, _ = await _post(gateway.url + "/v1/chat/completions", key=episode.key, body=CHAT)
    assert code == 403
    _openai_error(payload, "permission_error")
    code, payload, _ = await _post(gateway.url + "/v1/messages", key=episode.key, body=ANTHROPIC)
    assert code == 403
    _anthropic_error(payload, "permission_error")
    assert len(await episode.spans(bus)) == 1


async def test_upstream_down_is_503_with_retry_after(bus: Bus, episode: KeyedEpisode) -> None:
    upstream = CannedUpstream()
    await upstream.start()
    url = upstream.url
    await upstream.stop()
    async with serve_gateway(settings_for([url], unhealthy_after_failures=1), bus) as running:
        code, payload, headers = await _post(running.url + "/v1/chat/completions", key=episode.key, body=CHAT)
        assert code == 503
        assert int(headers["Retry-After"]) >= 1
        _openai_error(payload, "server_error")
        # The replica left the ring after the failure: the gateway is no longer ready.
        async with aiohttp.ClientSession() as session, session.get(running.url + "/readyz") as r:
            assert r.status == 503
    assert await episode.spans(bus) == []


@pytest.mark.parametrize("status", [400, 500])
async def test_upstream_errors_pass_through_without_a_span(
    bus: Bus, episode: KeyedEpisode, status: int
) -> None:
    upstream = CannedUpstream(script=lambda path, body: {"status": status, "content": "nope"})
    await upstream.start()
    try:
        async with serve_gateway(settings_for([upstream.url]), bus) as running:
            for stream in (False, True):
                code, payload, _ = await _post(
                    running.url + "/v1/chat/completions", key=episode.key,
                    body={**CHAT, "stream": stream},
                )  # fmt: skip
                assert code == status
                assert payload["error"]["message"] == "nope"
    finally:
        await upstream.stop()
    assert await episode.spans(bus) == []


async def test_slow_upstream_is_504_and_garbage_is_502(bus: Bus, episode: KeyedEpisode) -> None:
    slow = CannedUpstream(delay_s=2.0)
    garbage = CannedUpstream(script=lambda path, body: {"raw": b"<html>not json</html>"})
    await slow.start()
    await garbage.start()
    try:
        async with serve_gateway(settings_for([slow.url], read_timeout_s=0.3), bus) as running:
            code, payload, headers = await _post(
                running.url + "/v1/messages", key=episode.key, body=ANTHROPIC
            )
            assert code == 504
            assert "Retry-After" in headers
            _anthropic_error(payload, "api_error")
        async with serve_gateway(settings_for([garbage.url]), bus) as running:
            code, payload, _ = await _post(running.url + "/v1/chat/completions", key=episode.key, body=CHAT)
            assert code == 502
            _openai_error(payload, "server_error")
    finally:
        await slow.stop()
        await garbage.stop()
    assert await episode.spans(bus) == []


async def test_in_flight_calls_per_replica_are_bounded(bus: Bus, episode: KeyedEpisode) -> None:
    upstream = CannedUpstream(delay_s=0.1)
    await upstream.start()
    try:
        settings = settings_for([upstream.url], max_in_flight_per_upstream=2)
        async with serve_gateway(settings, bus) as running:
            url = running.url + "/v1/chat/completions"
            results = await asyncio.gather(*(_post(url, key=episode.key, body=CHAT) for _ in range(6)))
    finally:
        await upstream.stop()
    assert [code for code, _, _ in results] == [200] * 6
    assert upstream.max_active == 2
    assert len(await episode.spans(bus)) == 6


async def test_a_gateway_bug_answers_500_in_the_envelope(
    gateway: RunningGateway, episode: KeyedEpisode, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_: Any, **__: Any) -> None:
        raise ZeroDivisionError

    monkeypatch.setattr(gateway.app.proxy.forwarder, "call", broken)
    code, payload, _ = await _post(gateway.url + "/v1/chat/completions", key=episode.key, body=CHAT)
    assert code == 500
    _openai_error(payload, "server_error")
    assert "ZeroDivisionError" in payload["error"]["message"]
    code, payload, _ = await _post(gateway.url + "/v1/messages", key=episode.key, body=ANTHROPIC)
    assert code == 500
    _anthropic_error(payload, "api_error")

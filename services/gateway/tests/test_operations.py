"""Operations: admin routes, pause, weight versions, replicas and routing, metrics, artifacts, restarts."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from harnessrl.gateway.episodes import EpisodeCache
from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus, ConsumerSpec, Delivery
from harnessrl.shared.contracts import (
    CLIENT_MAX_CHARS,
    AgentExited,
    EpisodeScheduled,
    ServiceMetrics,
    UpstreamRegistration,
    WeightVersion,
    harness_of,
)
from harnessrl.shared.ids import new_id
from harnessrl.shared.net import free_port
from harnessrl.shared.subjects import ARTIFACTS_BUCKET
from harnessrl.shared.tokens import reconstruct_prompts
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import (
    TEST_ADMIN_TOKEN,
    TEST_KEY_SECRET,
    KeyedEpisode,
    serve_gateway,
    settings_for,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
ADMIN_HEADERS = {"authorization": f"Bearer {TEST_ADMIN_TOKEN}"}


async def _request(
    method: str, url: str, *, key: str | None = None, json: Any = None, data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, dict[str, str]]:  # fmt: skip
    all_headers = dict(headers or {})
    if key:
        all_headers["authorization"] = f"Bearer {key}"
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, json=json, data=data, headers=all_headers) as response,
    ):
        text = await response.text()
        body: Any = text
        if response.content_type == "application/json":
            body = await response.json()
        return response.status, body, dict(response.headers)


async def _eventually(check: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    for _ in range(250):
        result = check()
        if result if isinstance(result, bool) else await result:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_admin_routes_need_the_admin_token(canned: CannedUpstream, bus: Bus) -> None:
    episode = KeyedEpisode()
    async with serve_gateway(settings_for([canned.url]), bus) as gateway:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {episode.key}"}):
            status, body, _ = await _request("GET", gateway.url + "/admin/status", headers=headers)
            assert status == 401
            assert body["error"]["type"] == "authentication_error"
        status, body, _ = await _request("GET", gateway.url + "/admin/status", headers=ADMIN_HEADERS)
        assert status == 200
        assert body["upstreams"][0]["url"] == canned.url
        for path in ("/healthz", "/readyz"):
            status, _, _ = await _request("GET", gateway.url + path)
            assert status == 200


@pytest.mark.parametrize("url", ["not a url", "ftp://replica:8000", "http://", "http://replica:notaport"])
async def test_an_upstream_registration_with_a_bad_url_is_refused(
    canned: CannedUpstream, bus: Bus, url: str
) -> None:
    async with serve_gateway(settings_for([canned.url]), bus) as gateway:
        status, body, _ = await _request(
            "POST", gateway.url + "/admin/upstreams", headers=ADMIN_HEADERS, json={"url": url}
        )
        assert status == 400, body
        assert "http(s)://host:port" in json.dumps(body)
        assert list(gateway.gateway.pool.upstreams) == [canned.url]


async def test_an_admin_body_nested_too_deeply_is_a_400(canned: CannedUpstream, bus: Bus) -> None:
    async with serve_gateway(settings_for([canned.url]), bus) as gateway:
        status, body, _ = await _request(
            "POST", gateway.url + "/admin/upstreams", headers=ADMIN_HEADERS, data=b"[" * 5000 + b"]" * 5000
        )
    assert status == 400, body
    assert body["error"]["message"] == "request body is nested too deeply"


async def test_pause_holds_new_calls_until_resume_or_timeout(canned: CannedUpstream, bus: Bus) -> None:
    episode = KeyedEpisode()
    async with serve_gateway(settings_for([canned.url], pause_wait_s=1.5), bus) as gateway:
        status, body, _ = await _request(
            "POST", gateway.url + "/admin/pause?drain_s=1", headers=ADMIN_HEADERS
        )
        assert (status, body["paused"], body["drained"]) == (200, True, True)
        held = asyncio.ensure_future(
            _request("POST", gateway.url + "/v1/chat/completions", key=episode.key, json=CHAT)
        )
        await asyncio.sleep(0.3)
        assert not held.done()
        assert canned.requests == 0
        await _request("POST", gateway.url + "/admin/resume", headers=ADMIN_HEADERS)
        status, _, _ = await held
        assert status == 200
        await _request("POST", gateway.url + "/admin/pause", headers=ADMIN_HEADERS)
        status, body, headers = await _request(
            "POST", gateway.url + "/v1/chat/completions", key=episode.key, json=CHAT
        )
        assert status == 503
        assert int(headers["Retry-After"]) >= 1
        assert body["error"]["type"] == "server_error"
    assert len(await episode.spans(bus)) == 1


async def test_spans_carry_the_weight_version(canned: CannedUpstream, bus: Bus) -> None:
    episode = KeyedEpisode(run=new_id("wrun"))
    async with serve_gateway(settings_for([canned.url]), bus) as gateway:
        await _request("POST", gateway.url + "/v1/chat/completions", key=episode.key, json=CHAT)
        message = WeightVersion(run=episode.run, version=3, step=30)
        await bus.publish(subjects.weights(episode.run), message, msg_id=f"{episode.run}:3")
        await _eventually(lambda: gateway.gateway.weights.version(episode.run) == 3, "version 3")
        await _request("POST", gateway.url + "/v1/chat/completions", key=episode.key, json=CHAT)
    spans = await episode.spans(bus)
    assert [(s.weight_version_start, s.weight_version_end) for s in spans] == [(0, 0), (3, 3)]


async def test_spans_name_the_client_that_made_the_call(canned: CannedUpstream, bus: Bus) -> None:
    """The User-Agent, as sent and capped: what tells the trainer's break classes which harness it was."""
    episode = KeyedEpisode()
    agents = ["claude-cli/2.1.332 (external, sdk-cli)", "x" * (CLIENT_MAX_CHARS + 50)]
    async with serve_gateway(settings_for([canned.url]), bus) as gateway:
        for agent in agents:
            headers = {"user-agent": agent}
            await _request(
                "POST", gateway.url + "/v1/chat/completions", key=episode.key, json=CHAT, headers=headers
            )
    spans = await episode.spans(bus)
    assert [s.client for s in spans] == [agents[0], agents[1][:CLIENT_MAX_CHARS]]
    assert [harness_of(s.client) for s in spans] == ["claude-cli", "x" * CLIENT_MAX_CHARS]
    assert harness_of("") == "" and harness_of("AsyncOpenAI/Python 1.109.1") == "AsyncOpenAI"


async def test_replicas_register_on_the_bus_and_by_admin(bus: Bus) -> None:
    episode = KeyedEpisode()
    first, second = CannedUpstream(), CannedUpstream()
    await first.start()
    await second.start()
    try:
        async with serve_gateway(settings_for([]), bus) as gateway:
            status, _, _ = await _request(
                "POST", gateway.url + "/v1/chat/completions", key=episode.key, json=CHAT
            )
            assert status == 503
            registration = UpstreamRegistration(url=first.url, model="policy", weight_version=2)
            await bus.publish(subjects.upstreams(), registration, msg_id=new_id("reg"))
            await _eventually(lambda: first.url in gateway.gateway.pool.upstreams, "registration")
            status, _, _ = await _request(
                "POST", gateway.url + "/v1/chat/completions", key=episode.key, json=CHAT
            )
            assert status == 200
            assert first.bodies[-1]["model"] == "policy"
            status, body, _ = await _request(
                "POST", gateway.url + "/admin/upstreams", headers=ADMIN_HEADERS,
                json={"url": second.url, "model": "policy"},
            )  # fmt: skip
            assert status == 200
            assert {u["url"] for u in body["upstreams"]} == {first.url, second.url}
    finally:
        await first.stop()
        await second.stop()
        # Withdrawn, so later gateways on this session's bus don't route to its port once reused.
        withdrawal = UpstreamRegistration(url=first.url, active=False)
        await bus.publish(subjects.upstreams(), withdrawal, msg_id=new_id("reg"))
    span = (await episode.spans(bus))[0]
    assert (span.upstream, span.weight_version_start) == (first.url, 2)


async def test_sticky_routing_failover_and_recovery(bus: Bus) -> None:
    replicas = [CannedUpstream(), CannedUpstream()]
    for replica in replicas:
        await replica.start()
    episodes = [KeyedEpisode() for _ in range(12)]
    try:
        async with serve_gateway(settings_for([r.url for r in replicas]), bus) as gateway:
            url = gateway.url + "/v1/chat/completions"
            for episode in episodes * 2:
                assert (await _request("POST", url, key=episode.key, json=CHAT))[0] == 200
            homes = {}
            for episode in episodes:
                spans = await episode.spans(bus)
                assert len({s.upstream for s in spans}) == 1, "an episode moved between replicas"
                homes[episode.episode] = spans[0].upstream
            assert set(homes.values()) == {r.url for r in replicas}
            # One replica dies: its episodes fail over (nothing reached it, so the call is retried).
            port = replicas[0].port
            await replicas[0].stop()
            for episode in episodes:
                assert (await _request("POST", url, key=episode.key, json=CHAT))[0] == 200
            # It comes back on the same port: the health probe returns it to the ring.
            replicas[0] = CannedUpstream(port=port)
            await replicas[0].start()
            pool = gateway.gateway.pool
            await _eventually(lambda: pool.upstreams[replicas[0].url].healthy, "recovery")
    finally:
        for replica in replicas:
            await replica.stop()
    moved = [e for e in episodes if homes[e.episode] == replicas[0].url]
    assert moved
    for episode in moved:
        assert (await episode.spans(bus))[-1].upstream == replicas[1].url


async def test_metrics_follow_prometheus_conventions(canned: CannedUpstream, bus: Bus) -> None:
    episode = KeyedEpisode()
    async with serve_gateway(settings_for([canned.url]), bus) as gateway:
        await _request("POST", gateway.url + "/v1/chat/completions", key=episode.key, json=CHAT)
        await _request(
            "POST", gateway.url + "/v1/chat/completions", key=episode.key, json={**CHAT, "stream": True}
        )
        await _request("POST", gateway.url + "/v1/chat/completions", json=CHAT)
        status, text, headers = await _request("GET", gateway.url + "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    assert 'harnessrl_gateway_requests_total{code="200",route="/v1/chat/completions"} 2.0' in text
    assert 'harnessrl_gateway_requests_total{code="401",route="/v1/chat/completions"} 1.0' in text
    for name in (
        "harnessrl_gateway_request_duration_seconds_bucket",
        "harnessrl_gateway_time_to_first_token_seconds_bucket",
        "harnessrl_gateway_span_publish_duration_seconds_count 2.0",
        "harnessrl_gateway_span_publish_failures_total 0.0",
        "harnessrl_gateway_in_flight_requests 0.0",
    ):
        assert name in text
    assert episode.episode not in text and episode.run not in text


async def test_hosted_tools_left_out_of_a_responses_call_are_counted(
    canned: CannedUpstream, bus: Bus
) -> None:
    episode = KeyedEpisode()
    tools = [{"type": "web_search"}, {"type": "function", "name": "bash", "parameters": {"type": "object"}}]
    async with serve_gateway(settings_for([canned.url]), bus) as gateway:
        status, _, _ = await _request(
            "POST", gateway.url + "/v1/responses", key=episode.key, json={"input": "hi", "tools": tools}
        )
        _, text, _ = await _request("GET", gateway.url + "/metrics")
    assert status == 200
    assert [tool["function"]["name"] for tool in canned.bodies[-1]["tools"]] == ["bash"]
    assert (
        'harnessrl_gateway_request_parts_left_out_total{part="hosted_tool",route="/v1/responses"} 1.0' in text
    )


async def test_the_gateway_summarises_its_metrics_and_consumer_lag_on_the_bus(
    canned: CannedUpstream, bus: Bus
) -> None:
    episode = KeyedEpisode()
    seen: list[ServiceMetrics] = []

    async def collect(delivery: Delivery) -> None:
        seen.append(delivery.decode(ServiceMetrics))

    spec = ConsumerSpec(
        stream=subjects.METRICS.name, filter_subject=subjects.service_metrics("gateway"), deliver="new"
    )
    summaries = await bus.subscribe(spec, collect)
    try:
        async with serve_gateway(settings_for([canned.url], metrics_interval_s=0.2), bus) as gateway:
            await _request("POST", gateway.url + "/v1/chat/completions", key=episode.key, json=CHAT)
            async with asyncio.timeout(30):
                while not any(_served(summary) for summary in seen):
                    await asyncio.sleep(0.1)
            _, text, _ = await _request("GET", gateway.url + "/metrics")
    finally:
        await summaries.stop()
    summary = next(summary for summary in seen if _served(summary))
    assert summary.service == "gateway" and summary.instance
    lag = [key for key in summary.values if key.startswith("harnessrl_gateway_consumer_pending_messages{")]
    assert f'consumer="{subjects.PREFIX}.episode.>"' in " ".join(lag), lag
    assert "harnessrl_gateway_consumer_unacked_messages{" in text


def _served(summary: ServiceMetrics) -> bool:
    answered = 'harnessrl_gateway_requests_total{code="200",route="/v1/chat/completions"}'
    return summary.values.get(answered) == 1.0


async def test_artifact_upload(canned: CannedUpstream, bus: Bus) -> None:
    episode = KeyedEpisode()
    patch = b"diff --git a/x b/x\n+fixed\n"
    async with serve_gateway(settings_for([canned.url], max_artifact_bytes=1024), bus) as gateway:
        url = f"{gateway.url}/e/{episode.key}/harnessrl/v1/artifact"
        status, body, _ = await _request("PUT", url, data=patch)
        assert status == 200
        name = f"{episode.run}/{episode.episode}/patch"
        assert body == {"object": name, "size": len(patch), "sha256": hashlib.sha256(patch).hexdigest()}
        assert await bus.get_object(ARTIFACTS_BUCKET, name) == patch
        status, body, _ = await _request(
            "PUT", gateway.url + "/harnessrl/v1/artifact", key=episode.key, data=b"42",
            headers={"x-artifact-kind": "answer"},
        )  # fmt: skip
        assert (status, body["object"]) == (200, f"{episode.run}/{episode.episode}/answer")
        assert (await _request("PUT", url, data=b"x", headers={"x-artifact-kind": "exe"}))[0] == 400
        assert (await _request("PUT", url, data=b"x" * 2000))[0] == 413
        assert (await _request("PUT", gateway.url + "/harnessrl/v1/artifact", data=b"x"))[0] == 401
        exited = AgentExited(run=episode.run, episode=episode.episode, task="t", group="g")
        subject = subjects.episode_event(episode.run, episode.episode, "agent_exited")
        await bus.publish(subject, exited, msg_id=f"{episode.episode}:agent_exited")
        await _eventually(lambda: gateway.gateway.episodes.is_closed(episode.run, episode.episode), "close")
        assert (await _request("PUT", url, data=patch))[0] == 403
    assert await episode.spans(bus) == []


@pytest.mark.parametrize("stream", [False, True])
async def test_seq_and_deltas_survive_a_gateway_restart(
    canned: CannedUpstream, bus: Bus, stream: bool
) -> None:
    episode = KeyedEpisode()
    history: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    for _ in range(2):  # two gateway lifetimes, two calls each
        async with serve_gateway(settings_for([canned.url]), bus) as gateway:
            for turn in range(2):
                body = {"messages": history, "stream": stream}
                status, _, _ = await _request(
                    "POST", gateway.url + "/v1/chat/completions", key=episode.key, json=body
                )
                assert status == 200
                history = [
                    *history,
                    {"role": "assistant", "content": "Hello from the canned upstream."},
                    {"role": "user", "content": f"turn {turn}"},
                ]
    spans = await episode.spans(bus)
    assert [s.seq for s in spans] == [0, 1, 2, 3]
    assert [s.parent_span for s in spans] == [None, *(s.span_id for s in spans[:-1])]
    prompts = reconstruct_prompts(spans)
    assert all(len(prompts[s.span_id]) == s.prompt_len for s in spans)
    assert sum(len(s.prompt_suffix_ids) for s in spans) < sum(s.prompt_len for s in spans) / 2


async def test_access_log_is_one_json_line_per_request_without_prompts(
    canned: CannedUpstream, bus: Bus, capsys: pytest.CaptureFixture[str]
) -> None:
    episode = KeyedEpisode()
    secret_prompt = {"messages": [{"role": "user", "content": "the-prompt-text-never-logged"}]}
    async with serve_gateway(settings_for([canned.url], access_log=True), bus) as gateway:
        for _ in range(3):
            status, _, _ = await _request(
                "POST", gateway.url + "/v1/chat/completions", key=episode.key, json=secret_prompt
            )
            assert status == 200
        status, _, _ = await _request("POST", gateway.url + "/v1/chat/completions", key="bad", json=CHAT)
        assert status == 401
        await asyncio.sleep(0.5)  # lines are written in batches, at most 0.2 s late
        err = capsys.readouterr().err
    assert "the-prompt-text-never-logged" not in err and episode.key not in err
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    lines = [line for line in logged if line.get("event") == "request.served"]
    assert [line["status"] for line in lines] == [200, 200, 200, 401]
    for line in lines:
        assert line["level"] == "info" and line["route"] == "/v1/chat/completions"
        assert line["method"] == "POST" and line["ms"] >= 0 and line["timestamp"].endswith("Z")


async def _schedule(bus: Bus, episode: KeyedEpisode, sampling: dict[str, Any]) -> None:
    """What the controller publishes before it launches the episode's harness."""
    event = EpisodeScheduled(run=episode.run, episode=episode.episode, task="t", group="g", sampling=sampling)
    subject = subjects.episode_event(episode.run, episode.episode, "scheduled")
    await bus.publish(subject, event, msg_id=f"{episode.run}:{episode.episode}:scheduled")


async def test_sampling_policy_run_over_gateway_over_client(canned: CannedUpstream, bus: Bus) -> None:
    trained, untrained = KeyedEpisode(run=new_id("samp")), KeyedEpisode(run=new_id("free"))
    await _schedule(bus, trained, {"temperature": 0.25, "top_p": 0.5})
    settings = settings_for([canned.url], sampling={"temperature": 0.9, "seed": 7})
    async with serve_gateway(settings, bus) as gateway:
        asked = {**CHAT, "temperature": 1.5, "max_tokens": 5}
        for episode in (trained, untrained):
            status, _, _ = await _request(
                "POST", gateway.url + "/v1/chat/completions", key=episode.key, json=asked
            )
            assert status == 200
    trained_body, untrained_body = canned.bodies[-2:]
    chosen = [trained_body[name] for name in ("temperature", "top_p", "seed", "max_tokens")]
    assert chosen == [0.25, 0.5, 7, 5]  # the run's, the gateway's default, the client's own
    assert (untrained_body["temperature"], untrained_body["seed"]) == (0.9, 7)
    assert "top_p" not in untrained_body
    [span] = await trained.spans(bus)
    assert (span.request["temperature"], span.request["top_p"], span.request["seed"]) == (0.25, 0.5, 7)


async def test_first_sight_of_an_episode_reads_its_runs_sampling(bus: Bus) -> None:
    first = KeyedEpisode(run=new_id("samp"))
    await _schedule(bus, first, {"temperature": 1.0})
    cache = EpisodeCache(bus, cache_size=8)  # not following events: only the first-sight lookup
    await cache.episode(first.run, first.episode)
    assert cache.sampling(first.run) == {"temperature": 1.0}
    second = KeyedEpisode(run=first.run)  # no schedule of its own yet: the run's policy is known
    await cache.episode(second.run, second.episode)
    assert cache.sampling(second.run) == {"temperature": 1.0}
    stranger = KeyedEpisode(run=new_id("none"))  # a key minted outside any run: no policy
    await cache.episode(stranger.run, stranger.episode)
    assert cache.sampling(stranger.run) == {}
    # Remembered as "none" only until a schedule of that run is seen.
    following = EpisodeCache(bus, cache_size=8)
    await following.start()
    try:
        await following.episode(stranger.run, stranger.episode)
        assert following.sampling(stranger.run) == {}
        await _schedule(bus, KeyedEpisode(run=stranger.run), {"temperature": 0.3})
        await _eventually(lambda: following.sampling(stranger.run) == {"temperature": 0.3}, "schedule")
        later = KeyedEpisode(run=stranger.run)
        await following.episode(later.run, later.episode)
        assert following.sampling(later.run) == {"temperature": 0.3}
    finally:
        await following.stop()


@pytest.mark.parametrize(("keepalive_s", "second_status"), [(0.3, 200), (5.0, 502)])
async def test_no_call_goes_out_on_a_connection_the_replica_is_closing(
    bus: Bus, keepalive_s: float, second_status: int
) -> None:
    """vLLM closes connections idle for 5 s; the gateway must stop reusing them before that."""
    upstream = CannedUpstream(idle_close_s=0.6)
    await upstream.start()
    episode = KeyedEpisode()
    try:
        settings = settings_for([upstream.url], upstream_keepalive_s=keepalive_s)
        async with serve_gateway(settings, bus) as gateway:
            url = gateway.url + "/v1/chat/completions"
            assert (await _request("POST", url, key=episode.key, json=CHAT))[0] == 200
            await asyncio.sleep(0.9)  # idle past the replica's keep-alive
            assert (await _request("POST", url, key=episode.key, json=CHAT))[0] == second_status
        assert upstream.dropped == (second_status != 200)
    finally:
        await upstream.stop()


@pytest.mark.parametrize(
    ("upstream_delay_s", "grace_s", "answered"),
    [(1.0, 15, True), (600.0, 1, False)],
    ids=["drained", "cut-after-grace"],
)
async def test_sigterm_drains_calls_in_flight_for_at_most_the_grace(
    nats_server: NatsServer, upstream_delay_s: float, grace_s: int, answered: bool
) -> None:
    """`harnessrl gateway` on SIGTERM: a call finishing within `shutdown_grace_s` is answered; one on
    a replica that never answers is cut when the grace ends (503), and the process exits either way."""
    upstream = CannedUpstream(delay_s=upstream_delay_s)
    async with _gateway_process(nats_server, upstream, grace_s) as (url, process):
        call = asyncio.ensure_future(
            _request("POST", url + "/v1/chat/completions", key=KeyedEpisode().key, json=CHAT)
        )
        exited_s = await _sigterm_once_upstream_busy(upstream, process, grace_s)
        status, body, headers = await call
    if answered:
        assert status == 200 and body["choices"][0]["message"]["content"]
        assert exited_s < grace_s
    else:
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["error"]["message"] == "the gateway is shutting down"
        assert grace_s <= exited_s


async def test_sigterm_cuts_a_stream_after_the_grace_and_records_its_partial_span(
    nats_server: NatsServer, bus: Bus
) -> None:
    upstream = CannedUpstream(event_delay_s=0.3)  # 30 tokens: 9 s, far past the grace
    episode = KeyedEpisode()
    gateway = _gateway_process(nats_server, upstream, 1)
    async with gateway as (url, process), aiohttp.ClientSession() as session:
        response = await session.post(
            url + "/v1/chat/completions", json={**CHAT, "stream": True},
            headers={"authorization": f"Bearer {episode.key}"},
        )  # fmt: skip
        assert response.status == 200
        exited_s = await _sigterm_once_upstream_busy(upstream, process, 1)
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    assert exited_s >= 1
    spans = await episode.spans(bus)
    assert [(span.status, span.error) for span in spans] == [("aborted", "the gateway shut down")]
    assert 0 < len(spans[0].completions[0].token_ids) < len("Hello from the canned upstream.")


@asynccontextmanager
async def _gateway_process(
    nats_server: NatsServer, upstream: CannedUpstream, grace_s: int
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """`harnessrl gateway` as its own process in front of `upstream` (started here)."""
    await upstream.start()
    port = free_port()
    env = {
        **os.environ,
        "HRL_GATEWAY_KEY_SECRET": TEST_KEY_SECRET,
        "HRL_GATEWAY_SHUTDOWN_GRACE_S": str(grace_s),
    }
    argv = ["--port", str(port), "--nats-url", nats_server.url, "--upstream", upstream.url]
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "harnessrl.gateway", *argv, env=env)
    try:
        url = f"http://127.0.0.1:{port}"

        async def up() -> bool:
            try:
                return (await _request("GET", url + "/healthz"))[0] == 200
            except aiohttp.ClientError:
                return False

        await _eventually(up, "the gateway to answer")
        yield url, process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await upstream.stop()


async def _sigterm_once_upstream_busy(
    upstream: CannedUpstream, process: asyncio.subprocess.Process, grace_s: int
) -> float:
    """SIGTERM the gateway while its call is at the upstream; seconds until it exited."""
    await _eventually(lambda: upstream.active > 0, "the call to reach the upstream")
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    # uvicorn ends by the signal it was sent once it has shut down, as a shell expects.
    assert await asyncio.wait_for(process.wait(), grace_s + 10) == -signal.SIGTERM
    return time.monotonic() - started


async def test_a_call_retried_on_the_next_replica_names_that_replicas_model(
    canned: CannedUpstream, bus: Bus
) -> None:
    """A replica that refuses the connection: the next one gets the client's model, not the dead one's."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with serve_gateway(settings_for([canned.url]), bus) as gateway:
        pool = gateway.gateway.pool
        pool.register(dead, model="served-by-the-dead-one")
        episode = next(
            e for e in (KeyedEpisode() for _ in range(200)) if next(pool.candidates(e.episode)).url == dead
        )
        status, body, _ = await _request(
            "POST", gateway.url + "/v1/chat/completions", key=episode.key, json={**CHAT, "model": "asked"}
        )
    assert status == 200, body
    assert canned.bodies[-1]["model"] == "asked"

"""The harness-facing routes as one raw ASGI app: auth, rewrite, forward, capture, record.

Paths are `/v1/...` or `/e/<episode-key>/v1/...` (for harnesses that can only change the base
URL), plus the artifact upload `PUT /harnessrl/v1/artifact`. Every error is answered in the
envelope of the API the client speaks; every sampled call publishes exactly one span before its
response completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec

from harnessrl.gateway import artifacts
from harnessrl.gateway.accesslog import AccessLog
from harnessrl.gateway.asgi import (
    JSON_HEADERS,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    respond,
    respond_error,
    span_header,
)
from harnessrl.gateway.auth import KeyVerifier, presented_key
from harnessrl.gateway.capture import Asked, Capture
from harnessrl.gateway.dialects import API_BY_PATH, Api
from harnessrl.gateway.episode_spans import EpisodeSpans
from harnessrl.gateway.episodes import Episode
from harnessrl.gateway.errors import (
    ApiError,
    BadRequest,
    ClientGone,
    Dialect,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    Unavailable,
)
from harnessrl.gateway.forwarding import Forwarder
from harnessrl.gateway.recorder import CallRecord, request_params
from harnessrl.gateway.render import NoRender
from harnessrl.gateway.service import Gateway
from harnessrl.gateway.stream_relay import relay_stream
from harnessrl.gateway.token_in import TokenIn
from harnessrl.shared.contracts import CLIENT_MAX_CHARS
from harnessrl.shared.ids import new_id
from harnessrl.shared.keys import EpisodeClaims
from harnessrl.shared.log import get_logger

log = get_logger(__name__)

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
COUNT_TOKENS = "/v1/messages/count_tokens"
_PASSTHROUGH = {"/v1/models": "GET"}
_MESSAGES = API_BY_PATH["/v1/messages"]
_REQUIRED_FIELDS: dict[str, tuple[tuple[str, type | tuple[type, ...]], ...]] = {
    "chat": (("messages", list),),
    "completions": (("prompt", (str, list)),),
    "responses": (("input", (str, list)),),
    "messages": (("messages", list), ("max_tokens", int)),
    "count_tokens": (("messages", list),),
}


# Request parameters are stored in the span: deeper nesting than this is refused (decoders recurse).
_MAX_PARAM_DEPTH = 32
_SHUTTING_DOWN = Unavailable("the gateway is shutting down", retry_after=1.0)


class Proxy:
    """ASGI app of every harness-facing route."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.settings = gateway.settings
        self.metrics = gateway.metrics
        self.forwarder = Forwarder(gateway)
        self.token_in = TokenIn(gateway)
        self.keys = KeyVerifier(gateway.settings.secret)
        self.access_log = AccessLog(gateway.settings.log_level) if gateway.settings.access_log else None
        self._counters: dict[tuple[str, int], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route one request and account for it (metrics, access log)."""
        path: str = scope["path"]
        path_key: str | None = None
        if path.startswith("/e/"):
            path_key, _, tail = path[3:].partition("/")
            path = "/" + tail
        dialect: Dialect = "anthropic" if path.startswith("/v1/messages") else "openai"
        known = path in API_BY_PATH or path in _PASSTHROUGH or path in (artifacts.PATH, COUNT_TOKENS)
        route = path if known else "other"
        started = time.perf_counter()
        status = 500
        try:
            status = await self._route(path, path_key, scope, receive, send)
        except ApiError as error:
            status = error.status
            await respond_error(send, error, dialect)
        except ClientGone:
            status = 499
        except asyncio.CancelledError:  # only uvicorn cancels a request: the shutdown grace ran out
            status = 503
            log.warning("request.cut_at_shutdown", route=route)
            with contextlib.suppress(RuntimeError):  # a stream had started: its connection just closes
                await respond_error(send, _SHUTTING_DOWN, dialect)
        except Exception as exc:  # a bug still answers in the client's envelope
            log.exception("request.failed", route=route)
            with contextlib.suppress(RuntimeError):  # the response had already started
                await respond_error(send, ApiError(f"internal error: {type(exc).__name__}"), dialect)
        elapsed = time.perf_counter() - started
        counter = self._counters.get((route, status))
        if counter is None:
            counter = self._counters[route, status] = self.metrics.requests.labels(route, str(status))
        counter.inc()
        self.metrics.latency.labels(route).observe(elapsed)
        if self.access_log is not None:
            self.access_log.request(
                method=scope["method"], route=route, status=status, ms=round(elapsed * 1000, 2)
            )

    async def _route(
        self, path: str, path_key: str | None, scope: Scope, receive: Receive, send: Send
    ) -> int:
        method = scope["method"]
        api = API_BY_PATH.get(path)
        if api is not None:
            _require_method(method, "POST")
            return await self._llm_call(api, path_key, scope, receive, send)
        if path == COUNT_TOKENS:
            _require_method(method, "POST")
            return await self._count_tokens(path_key, scope, receive, send)
        if path in _PASSTHROUGH:
            _require_method(method, _PASSTHROUGH[path])
            claims, _ = await self.authenticate(scope, path_key)
            body = await read_body(scope, receive, self.settings.max_body_bytes)
            return await self.forwarder.passthrough(claims, path, method, scope, body=body, send=send)
        if path == artifacts.PATH:
            _require_method(method, "PUT")
            claims, _ = await self.authenticate(scope, path_key)
            return await artifacts.upload(self.gateway, claims, scope, receive, send)
        raise NotFound(f"unknown route {method} {path}")

    async def authenticate(self, scope: Scope, path_key: str | None) -> tuple[EpisodeClaims, Episode]:
        """Verify the episode key (path, `x-api-key` or bearer) and that the episode is open."""
        claims = self.keys.verify(presented_key(scope, path_key))
        try:
            episode = await self.gateway.episodes.episode(claims.run, claims.episode)
        except Exception as exc:
            log.warning("episode.state_unavailable", run=claims.run, episode=claims.episode, error=str(exc))
            raise Unavailable("the episode store is unavailable", retry_after=2.0) from exc
        if episode.closed:
            raise Forbidden("episode is closed")
        return claims, episode

    def _sampling_policy(self, run: str) -> dict[str, Any]:
        """The run's sampling policy over the gateway's default (both win over the client's)."""
        return {**self.settings.sampling, **self.gateway.episodes.sampling(run)}

    async def _count_tokens(self, path_key: str | None, scope: Scope, receive: Receive, send: Send) -> int:
        """`{"input_tokens": N}`: N is the prompt length `/v1/messages` would send upstream for this body.

        Whatever the model name (as `/v1/messages`, it serves the run's policy); token-in runs count
        the spliced prompt. A replica that can't render (no `/tokenize`: not vLLM) counts itself.
        """
        claims, episode = await self.authenticate(scope, path_key)
        raw = await read_body(scope, receive, self.settings.max_body_bytes)
        body = _parse_body(raw, "count_tokens")
        _MESSAGES.prepare(body)  # to the chat request the Messages route sends
        body.update(self._sampling_policy(claims.run))
        call = CallRecord(run=claims.run, episode=claims.episode, api="messages", span_id=new_id("span"))
        try:
            tokens = await self.token_in.count(call, episode.spans, body)
        except NoRender:
            return await self.forwarder.passthrough(claims, COUNT_TOKENS, "POST", scope, body=raw, send=send)
        await respond(send, 200, _encoder.encode({"input_tokens": tokens}), JSON_HEADERS)
        return 200

    async def _llm_call(
        self, api: Api, path_key: str | None, scope: Scope, receive: Receive, send: Send
    ) -> int:
        claims, episode = await self.authenticate(scope, path_key)
        body = _parse_body(await read_body(scope, receive, self.settings.max_body_bytes), api.kind)
        call = CallRecord(run=claims.run, episode=claims.episode, api=api.kind, span_id=new_id("span"))
        call.params = request_params(body)
        call.client = (header(scope, b"user-agent") or b"").decode("utf-8", "replace")[:CLIENT_MAX_CHARS]
        _check_depth(call.params)
        call.stream = body.get("stream") is True
        asked = api.prepare(body)
        for part, count in asked.left_out.items():
            self.metrics.left_out.labels(api.path, part).inc(count)
        gate = self.gateway.gate
        if not await gate.enter():
            raise Unavailable("paused for a weight update", retry_after=5.0)
        self.metrics.in_flight.inc()
        try:
            policy = self._sampling_policy(claims.run)
            body.update(policy)
            call.params.update(policy)  # the span records what was sampled with
            if self.token_in.enabled(claims.run):
                api, body = await self.token_in.plan(api, call, episode.spans, body)
            if call.stream:
                return await relay_stream(
                    self.forwarder, api, call, episode.spans,
                    body=body, asked=asked, scope=scope, receive=receive, send=send,
                )  # fmt: skip
            return await self._complete(
                api, call, episode.spans, body=body, asked=asked, scope=scope, send=send
            )
        finally:
            gate.leave()
            self.metrics.in_flight.dec()

    async def _complete(
        self, api: Api, call: CallRecord, spans: EpisodeSpans, *,
        body: dict[str, Any], asked: Asked, scope: Scope, send: Send,
    ) -> int:  # fmt: skip
        upstream, status, raw, headers = await self.forwarder.call(api, call, body, scope)
        if status != 200:
            await respond(send, status, api.upstream_error(status, raw), headers)
            return status
        capture = Capture()
        try:
            data = api.capture_body(_decoder.decode(raw), asked, capture)
        except (msgspec.DecodeError, AttributeError, TypeError, ValueError, KeyError) as exc:
            raise self.forwarder.garbage(upstream, exc) from exc
        out = _encoder.encode(data)
        version = self.gateway.weights.version(call.run, upstream.weight_version)
        await self.gateway.recorder.record(call, spans, capture, status="ok", weight_version_end=version)
        await respond(send, 200, out, [*JSON_HEADERS, span_header(call.span_id)])
        return 200


def _require_method(method: str, allowed: str) -> None:
    if method != allowed:
        raise MethodNotAllowed(f"use {allowed}")


def _parse_body(raw: bytes, kind: str) -> dict[str, Any]:
    """Decode and shape-check the fields the gateway relies on; the upstream checks the rest."""
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # msgspec's decoder recurses per level: a deep body is refused
        raise BadRequest("request body is nested too deeply") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for name, wanted in _REQUIRED_FIELDS[kind]:
        value = body.get(name)
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise BadRequest(f"`{name}` is required and must be {_kind_name(wanted)}")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("`stream` must be a boolean")
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest("`model` must be a string")
    return body


def _check_depth(params: dict[str, Any]) -> None:
    """Refuse a stored parameter nested so deep that the span could not be decoded again."""
    for name, value in params.items():
        if isinstance(value, dict | list) and _depth(value) > _MAX_PARAM_DEPTH:
            raise BadRequest(f"`{name}` is nested deeper than {_MAX_PARAM_DEPTH} levels")


def _depth(value: dict[str, Any] | list[Any]) -> int:
    """How many containers deep `value` goes (iteratively: no recursion limit)."""
    deepest, level = 0, [value]
    while level:
        deepest += 1
        level = [
            child
            for container in level
            for child in (container.values() if isinstance(container, dict) else container)
            if isinstance(child, dict | list)
        ]
    return deepest


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {list: "an array", str: "a string", int: "an integer"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)

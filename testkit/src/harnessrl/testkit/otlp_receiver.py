"""A real OTLP/HTTP trace receiver (the OpenTelemetry Collector is not installable here).

`POST /v1/traces` with a protobuf `ExportTraceServiceRequest` (gzip or not), decoded with
opentelemetry-proto, answered with an `ExportTraceServiceResponse` as the specification says. Every
span received is kept as it arrived (`received`, a re-sent span twice), with its resource, scope and
attributes decoded. A test can make it answer 503 for a number of requests (`unavailable_for`), refuse
chosen spans with 400 (`refuse_when`), or stop and start it again on the same port (an outage).

`export_once` runs `harnessrl otlp` against a fresh receiver until it is caught up: the OTLP part of
`make analytics-check`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp.web
import msgspec
import nats.js.errors
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.net import free_port
from harnessrl.stack.otlp import TRACES_PATH, OtlpOptions, export_spans


class ReceivedSpan(msgspec.Struct, frozen=True, kw_only=True):
    """One span as the receiver decoded it (ids as hex, attribute values as Python values)."""

    trace_id: str
    span_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    links: list[tuple[str, str]]
    resource: dict[str, Any]
    scope: str

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the span to a backend."""
        return self.trace_id, self.span_id


def plain(value: AnyValue) -> Any:
    """An OTLP attribute value as a Python value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [plain(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return attribute_dict(value.kvlist_value.values)
    return None if kind is None else getattr(value, kind)


def attribute_dict(values: Any) -> dict[str, Any]:
    """Repeated `KeyValue`s as a dict."""
    pairs: list[KeyValue] = list(values)
    return {pair.key: plain(pair.value) for pair in pairs}


def decode_request(body: bytes) -> list[ReceivedSpan]:
    """Every span of an `ExportTraceServiceRequest`."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = attribute_dict(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=attribute_dict(span.attributes),
                        status_code=span.status.code,
                        status_message=span.status.message,
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        resource=resource,
                        scope=scope_spans.scope.name,
                    )
                )
    return spans


class OtlpReceiver:
    """An OTLP/HTTP server on 127.0.0.1 keeping what it receives."""

    def __init__(self, port: int | None = None, *, delay_s: float = 0.0) -> None:
        self.port = port or free_port()
        self.delay_s = delay_s  # before each request is answered (a slow backend)
        self.received: list[ReceivedSpan] = []
        self.requests = 0
        self.unavailable_answers = 0
        self.refused_answers = 0
        self._unavailable = 0
        self._refuse: Callable[[ReceivedSpan], bool] = lambda _span: False
        self._runner: aiohttp.web.AppRunner | None = None
        self._arrived = asyncio.Event()

    @property
    def url(self) -> str:
        """The OTLP/HTTP base URL (what `--endpoint` takes)."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen (again, after `stop`, on the same port)."""
        app = aiohttp.web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(TRACES_PATH, self._traces)
        self._runner = aiohttp.web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        """Stop listening: clients get connection refused until `start`."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def unavailable_for(self, requests: int) -> None:
        """Answer the next `requests` requests 503 with `Retry-After: 0`, storing nothing."""
        self._unavailable = requests

    def refuse_when(self, refuse: Callable[[ReceivedSpan], bool]) -> None:
        """Answer 400 (a permanent refusal) to a request holding a span for which `refuse` is true."""
        self._refuse = refuse

    def unique(self) -> dict[tuple[str, str], ReceivedSpan]:
        """Each span received, once (the last copy)."""
        return {span.key: span for span in self.received}

    def duplicates(self) -> int:
        """How many spans arrived more than once, counted once per extra copy."""
        return sum(count - 1 for count in Counter(span.key for span in self.received).values())

    async def wait_for(self, count: int, timeout_s: float = 30.0) -> None:
        """Wait until `count` distinct spans arrived; `AssertionError` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self.unique()) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{len(self.unique())} of {count} spans arrived in {timeout_s}s")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(remaining, 0.5))
            except TimeoutError:
                continue

    async def _traces(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.requests += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self._unavailable > 0:
            self._unavailable -= 1
            self.unavailable_answers += 1
            return aiohttp.web.Response(status=503, text="receiver unavailable", headers={"Retry-After": "0"})
        if request.content_type != "application/x-protobuf":
            return aiohttp.web.Response(status=415, text=f"not protobuf: {request.content_type}")
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        try:
            spans = decode_request(body)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError; any garbage is a 400
            return aiohttp.web.Response(status=400, text=f"undecodable request: {exc}")
        if any(self._refuse(span) for span in spans):
            self.refused_answers += 1
            return aiohttp.web.Response(status=400, text="span refused by the test")
        self.received.extend(spans)
        self._arrived.set()
        answer = ExportTraceServiceResponse().SerializeToString()
        return aiohttp.web.Response(body=answer, content_type="application/x-protobuf")


async def export_once(nats_url: str, run: str, *, include_content: bool = False, idle_s: float = 2.0) -> int:
    """Export `run`'s spans to a fresh receiver until caught up; how many distinct spans it received.

    Uses a consumer of its own (deleted afterwards), so it sends the whole run whatever ran before.
    """
    receiver = OtlpReceiver()
    await receiver.start()
    consumer = f"otlp-check-{uuid.uuid4().hex[:8]}"
    options = OtlpOptions(
        endpoint=receiver.url, nats_url=nats_url, run=run, consumer=consumer,
        include_content=include_content, until_idle_s=idle_s,
    )  # fmt: skip
    try:
        await export_spans(options)
    finally:
        await receiver.stop()
        await delete_consumer(nats_url, consumer)
    return len(receiver.unique())


async def delete_consumer(nats_url: str, consumer: str) -> None:
    """Remove an OTLP export's durable consumer from SPANS (absent is fine)."""
    bus = NatsBus(nats_url, name="harnessrl-otlp-cleanup")
    await bus.connect()
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await bus.js.delete_consumer(subjects.SPANS.name, consumer)
    finally:
        await bus.close()

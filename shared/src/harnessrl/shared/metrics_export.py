"""How a service exports its Prometheus metrics: `/metrics` over HTTP, and a summary on METRICS.

One shape for the controller, the reward workers and the trainer (the gateway serves `/metrics`
on its own HTTP port): each keeps its metrics in its own `CollectorRegistry`, and its `app.serve`
runs the service inside `exported(...)`, which serves that registry on `metrics_host:metrics_port`
(0: no endpoint) and publishes a `ServiceMetrics` summary of it every `metrics_interval_s`
(0: none).

Names follow Prometheus' conventions: `harnessrl_<service>_<thing>_<unit>`, counters end in
`_total`, base units (seconds, bytes). Labels are bounded (a run, a phase, a reason), never an
episode id.

Summaries go to `hrl.metrics._service.<service>` (stream METRICS). `_service` is a scope no run
can have (run names are lower-case letters, digits and '-'), so a summary never shares a subject
with a run's `StepMetrics` (`hrl.metrics.<run>.trainer`); read every service's summaries with the
filter `hrl.metrics._service.>`. A summary's values are the registry's samples keyed as in the
exposition format (`harnessrl_reward_gradings_total{outcome="graded"}`), histogram buckets left
out (their `_sum` and `_count` stay).

Every service also reports the lag of each stream consumer it runs, refreshed every few seconds:
`harnessrl_<service>_consumer_pending_messages{consumer}` (stored, not delivered yet) and
`harnessrl_<service>_consumer_unacked_messages{consumer}` (delivered, not settled yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import AsyncIterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, BusError
from harnessrl.shared.contracts import ServiceMetrics
from harnessrl.shared.log import get_logger

# A scraper that sends no request head within this long is disconnected.
_REQUEST_TIMEOUT_S = 10.0
_SKIPPED_SAMPLES = ("_bucket", "_created")
# Seconds between two refreshes of the consumer-lag gauges.
LAG_REFRESH_S = 5.0
# The last summary, published as a service stops, is given this long at most.
LAST_SUMMARY_BUDGET_S = 2.0
# The text format every Prometheus reads (what `generate_latest` writes; the gateway serves it too).
_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

_log = get_logger(__name__)


class MetricsSettings(Protocol):
    """What `exported` reads of a service's settings."""

    @property
    def metrics_host(self) -> str:
        """The address `/metrics` listens on."""

    @property
    def metrics_port(self) -> int:
        """The port `/metrics` listens on (0: no endpoint)."""

    @property
    def metrics_interval_s(self) -> float:
        """Seconds between two summaries on METRICS (0: none)."""


def sample_values(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample of `registry` but histogram buckets and creation times, keyed `name{labels}`."""
    values: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith(_SKIPPED_SAMPLES):
                continue
            labels = ",".join(f'{name}="{value}"' for name, value in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return values


class MetricsEndpoint:
    """`GET /metrics` of one registry, answered on the service's own event loop.

    On the loop rather than on prometheus_client's server thread, so collectors that read the
    service's state read it between two of its awaits, never while it changes.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._registry, self._host, self._port = registry, host, port
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The port listened on (the one chosen when asked for port 0)."""
        if self._server is None:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        """The endpoint's URL."""
        return f"http://{self._host}:{self.port}/metrics"

    async def start(self) -> None:
        """Listen (an address in use fails here, at start-up)."""
        self._server = await asyncio.start_server(self._answer, self._host, self._port)

    async def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A scraper that hangs up, sends garbage or nothing at all just gets its connection closed.
        dropped = (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError)
        try:
            with contextlib.suppress(*dropped):
                async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                    head = await reader.readuntil(b"\r\n\r\n")
                writer.write(self._response(head))
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _response(self, head: bytes) -> bytes:
        """The whole HTTP/1.1 response to a request head (the connection closes after it)."""
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if path != b"/metrics":
            return _http(404, b"Not Found", b"text/plain", b"not found: only /metrics is served\n")
        if method != b"GET":
            return _http(405, b"Method Not Allowed", b"text/plain", b"GET /metrics\n")
        return _http(200, b"OK", _CONTENT_TYPE, generate_latest(self._registry))


def _http(status: int, reason: bytes, content_type: bytes, body: bytes) -> bytes:
    lines = (
        b"HTTP/1.1 %d %s" % (status, reason),
        b"Content-Type: " + content_type,
        b"Content-Length: %d" % len(body),
        b"Connection: close",
    )
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class SummaryPublisher:
    """Publishes a `ServiceMetrics` summary of one registry every `interval_s` (0: never).

    A last summary is published on `stop` while the bus is up, within `LAST_SUMMARY_BUDGET_S`, so a
    service that lives shorter than one interval (a trainer whose steps were ready when it started)
    still reports its final figures, and one stopping with its NATS gone isn't held up. A summary
    that cannot be published is logged and skipped: metrics never stop a service.
    """

    def __init__(
        self, bus: Bus, registry: CollectorRegistry, *, service: str, interval_s: float, run: str = ""
    ) -> None:
        self._bus, self._registry = bus, registry
        self.service, self.interval_s, self.run = service, interval_s, run
        self.instance = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._sent = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        """Begin publishing in the background."""
        if self.interval_s > 0:
            self._task = asyncio.create_task(self._publish_every(), name=f"{self.service}-metrics-summary")

    async def stop(self) -> None:
        """Stop publishing, after a last summary."""
        if self._task is not None:
            self._stopping = True  # the loop ends by this too: a cancel can be lost (see `_refresh_every`)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            if self._bus.connected:
                await self.publish(budget_s=LAST_SUMMARY_BUDGET_S)

    async def publish(self, budget_s: float | None = None) -> ServiceMetrics:
        """Publish one summary now, retrying for `budget_s` (default: one interval, at least 1 s)."""
        self._sent += 1
        summary = ServiceMetrics(
            service=self.service, instance=self.instance, run=self.run, values=sample_values(self._registry)
        )
        try:
            await self._bus.publish(
                subjects.service_metrics(self.service),
                summary,
                msg_id=f"{self.service}:{self.instance}:{self._sent}",
                budget_s=budget_s if budget_s is not None else max(self.interval_s, 1.0),
            )
        except BusError as exc:
            _log.warning("metrics.summary_failed", service=self.service, error=str(exc))
        return summary

    async def _publish_every(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval_s)
            await self.publish()


class ConsumerLag:
    """Gauges of every stream consumer's lag on one bus, refreshed every `LAG_REFRESH_S`."""

    def __init__(self, bus: Bus, registry: CollectorRegistry, *, service: str) -> None:
        self._bus = bus
        prefix = f"harnessrl_{service}_consumer"
        self.pending = Gauge(
            f"{prefix}_pending_messages",
            "Messages stored under a consumer's filter and not delivered to it yet (its lag).",
            ["consumer"],
            registry=registry,
        )
        self.unacked = Gauge(
            f"{prefix}_unacked_messages",
            "Messages delivered to a consumer and not settled yet.",
            ["consumer"],
            registry=registry,
        )
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def refresh(self) -> None:
        """Read every consumer's lag now (a consumer that stopped leaves the gauges)."""
        backlogs = await self._bus.backlogs()
        self.pending.clear()
        self.unacked.clear()
        for backlog in backlogs:
            self.pending.labels(consumer=backlog.consumer).set(backlog.pending)
            self.unacked.labels(consumer=backlog.consumer).set(backlog.unacked)

    async def start(self) -> None:
        """Refresh in the background."""
        self._task = asyncio.create_task(self._refresh_every(), name="consumer-lag")

    async def stop(self) -> None:
        """Stop refreshing."""
        if self._task is not None:
            self._stopping = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _refresh_every(self) -> None:
        # Not `while True`: on Python 3.11 a cancel that arrives as a bus reply completes can be lost
        # inside nats.py's `asyncio.wait_for` (fixed in 3.12); such a loop then runs on, and its stop
        # waits forever (a gateway test hung 600 s in `reports.stop()` in two full runs here, its
        # summaries still going out every 0.2 s).
        while not self._stopping:
            await self.refresh()
            await asyncio.sleep(LAG_REFRESH_S)


class BusReports:
    """What a service reports of one registry on the bus: lag gauges and periodic summaries."""

    def __init__(
        self, bus: Bus, registry: CollectorRegistry, *, service: str, interval_s: float, run: str = ""
    ) -> None:
        self.lag = ConsumerLag(bus, registry, service=service)
        self.summaries = SummaryPublisher(bus, registry, service=service, interval_s=interval_s, run=run)

    async def start(self) -> None:
        """Begin refreshing and publishing."""
        await self.lag.start()
        await self.summaries.start()

    async def stop(self) -> None:
        """Stop both."""
        await self.summaries.stop()
        await self.lag.stop()


@contextlib.asynccontextmanager
async def exported(
    bus: Bus, registry: CollectorRegistry, *, service: str, settings: MetricsSettings, run: str = ""
) -> AsyncIterator[MetricsEndpoint | None]:
    """Serve `registry` on `/metrics` and summarise it on METRICS while the block runs.

    Yields the endpoint (None when `metrics_port` is 0).
    """
    endpoint = None
    if settings.metrics_port:
        endpoint = MetricsEndpoint(registry, settings.metrics_host, settings.metrics_port)
        await endpoint.start()
        _log.info("metrics.serving", service=service, url=endpoint.url)
    reports = BusReports(bus, registry, service=service, interval_s=settings.metrics_interval_s, run=run)
    await reports.start()
    try:
        yield endpoint
    finally:
        await reports.stop()
        if endpoint is not None:
            await endpoint.stop()

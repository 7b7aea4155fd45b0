"""The gateway service: its stateful parts, wired once per process and started/stopped with the app.

Everything the routes (`proxy`, `admin`, `asgi_app`) share lives here: the episode cache, weight
versions, the pause gate, the upstream pool and the span recorder.
"""

from __future__ import annotations

import asyncio

from harnessrl.gateway.episodes import EpisodeCache
from harnessrl.gateway.metrics import GatewayMetrics
from harnessrl.gateway.recorder import SpanRecorder
from harnessrl.gateway.settings import GatewaySettings
from harnessrl.gateway.upstreams import UpstreamPool
from harnessrl.gateway.weights import PauseGate, WeightBook
from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus, ConsumerSpec, Delivery, Subscription
from harnessrl.shared.contracts import UpstreamRegistration
from harnessrl.shared.log import get_logger
from harnessrl.shared.metrics_export import BusReports

log = get_logger(__name__)


class Gateway:
    """Settings, bus and every stateful component of one gateway process."""

    def __init__(self, settings: GatewaySettings, bus: Bus) -> None:
        self.settings = settings
        self.bus = bus
        self.metrics = GatewayMetrics()
        self.episodes = EpisodeCache(bus, cache_size=settings.episode_cache_size)
        self.weights = WeightBook(bus)
        self.gate = PauseGate(settings.pause_wait_s)
        self.pool = UpstreamPool(
            max_in_flight=settings.max_in_flight_per_upstream,
            connect_timeout_s=settings.connect_timeout_s,
            unhealthy_after=settings.unhealthy_after_failures,
            health_interval_s=settings.health_interval_s,
            keepalive_s=settings.upstream_keepalive_s,
        )
        self.recorder = SpanRecorder(bus, self.metrics, timeout_s=settings.span_publish_timeout_s)
        self.reports = BusReports(
            bus, self.metrics.registry, service="gateway", interval_s=settings.metrics_interval_s
        )
        self._registrations: Subscription | None = None
        for url in settings.upstreams:
            self.pool.register(url)

    async def start(self) -> None:
        """Connect-dependent start-up: streams, followers, upstream session."""
        if not self.bus.connected:
            await self.bus.connect()
        await self.bus.ensure_streams(
            [subjects.SPANS, subjects.EPISODES, subjects.WEIGHTS, subjects.UPSTREAMS]
        )
        await self.pool.start()
        await self.episodes.start()
        await self.weights.start()
        spec = ConsumerSpec(stream=subjects.UPSTREAMS.name, filter_subject=subjects.upstreams())
        self._registrations = await self.bus.subscribe(spec, self._on_registration)
        await self.reports.start()
        log.info("gateway.started", upstreams=list(self.pool.upstreams))

    async def stop(self) -> None:
        """Stop followers and close upstream connections (the bus belongs to the caller)."""
        await self.reports.stop()
        followers = [self.weights.stop(), self.episodes.stop()]
        if self._registrations is not None:
            followers.append(self._registrations.stop())
        await asyncio.gather(*followers)
        await self.pool.close()

    async def _on_registration(self, delivery: Delivery) -> None:
        message = delivery.decode(UpstreamRegistration)
        self.register(message)

    def register(self, message: UpstreamRegistration) -> None:
        """Apply a replica's registration or withdrawal."""
        if message.active:
            self.pool.register(message.url, model=message.model, weight_version=message.weight_version)
        else:
            self.pool.withdraw(message.url)

    @property
    def ready(self) -> bool:
        """Bus connected and at least one healthy replica."""
        return self.bus.connected and self.pool.any_healthy

    def status(self) -> dict[str, object]:
        """What `/admin/status` reports."""
        return {
            "paused": self.gate.paused,
            "in_flight": self.gate.in_flight,
            "bus_connected": self.bus.connected,
            "upstreams": [u.status() for u in self.pool.upstreams.values()],
            "weight_versions": dict(self.weights.versions),
            "episodes_held": len(self.episodes),
            "closed_episodes_held": self.episodes.closed_count(),
            # Every task of this process's loop: `make soak` checks it returns to idle (no leak).
            "asyncio_tasks": len(asyncio.all_tasks()),
        }

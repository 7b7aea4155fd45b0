"""vLLM replicas: a consistent-hash ring (sticky per episode), health and in-flight bounds.

An episode always lands on the same replica while that replica is healthy, so vLLM's prefix cache
keeps its growing conversation. A replica that fails `unhealthy_after_failures` calls in a row
leaves the ring (its episodes move to the next replica on the ring) until a `/health` probe
passes again. Each replica admits at most `max_in_flight` concurrent calls.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import time
from collections.abc import Iterator

import aiohttp

from harnessrl.shared.log import get_logger

log = get_logger(__name__)

_VIRTUAL_NODES = 64


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Upstream:
    """One vLLM replica."""

    def __init__(self, url: str, *, max_in_flight: int, model: str = "", weight_version: int = 0):
        self.url = url.rstrip("/")
        self.model = model
        self.weight_version = weight_version
        self.slots = asyncio.Semaphore(max_in_flight)
        self.in_flight = 0
        self.healthy = True
        self.failures = 0
        self.checked_at = 0.0

    def succeeded(self) -> None:
        """A call got an answer: reset the failure streak."""
        self.failures = 0

    def failed(self, threshold: int) -> None:
        """A call failed at the transport level; leave the ring after `threshold` in a row."""
        self.failures += 1
        if self.healthy and self.failures >= threshold:
            self.healthy = False
            log.warning("upstream.unhealthy", upstream=self.url, failures=self.failures)

    def status(self) -> dict[str, object]:
        """What `/admin/status` shows."""
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "failures": self.failures,
            "model": self.model,
            "weight_version": self.weight_version,
        }


class UpstreamPool:
    """The replicas this gateway routes to, and the shared aiohttp session."""

    def __init__(
        self,
        *,
        max_in_flight: int,
        connect_timeout_s: float,
        unhealthy_after: int,
        health_interval_s: float,
        keepalive_s: float,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.keepalive_s = keepalive_s
        self.unhealthy_after = unhealthy_after
        self.health_interval_s = health_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.upstreams: dict[str, Upstream] = {}
        self._ring: list[tuple[int, str]] = []
        self._keys: list[int] = []
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The shared client session (one connector, keep-alive to every replica)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def start(self) -> None:
        """Open the session and start health probing."""
        _ = self.session
        self._health_task = asyncio.create_task(self._probe_forever(), name="upstream-health")

    async def close(self) -> None:
        """Stop probing and close connections."""
        if self._health_task is not None:
            self._health_task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def register(self, url: str, *, model: str = "", weight_version: int = 0) -> Upstream:
        """Add a replica (or refresh a known one's model and version)."""
        key = url.rstrip("/")
        upstream = self.upstreams.get(key)
        if upstream is None:
            upstream = Upstream(key, max_in_flight=self.max_in_flight)
            self.upstreams[key] = upstream
            self._rebuild()
            log.info("upstream.registered", upstream=key)
        upstream.model = model or upstream.model
        upstream.weight_version = max(upstream.weight_version, weight_version)
        return upstream

    def withdraw(self, url: str) -> None:
        """Remove a replica; its episodes move to the next one on the ring."""
        if self.upstreams.pop(url.rstrip("/"), None) is not None:
            self._rebuild()
            log.info("upstream.withdrawn", upstream=url)

    def _rebuild(self) -> None:
        ring = sorted((_hash(f"{url}#{i}"), url) for url in self.upstreams for i in range(_VIRTUAL_NODES))
        self._ring = ring
        self._keys = [h for h, _ in ring]

    def candidates(self, episode: str) -> Iterator[Upstream]:
        """Healthy replicas in ring order starting at the episode's position (each once)."""
        if not self._ring:
            return
        start = bisect.bisect(self._keys, _hash(episode)) % len(self._ring)
        seen: set[str] = set()
        for offset in range(len(self._ring)):
            url = self._ring[(start + offset) % len(self._ring)][1]
            if url in seen:
                continue
            seen.add(url)
            upstream = self.upstreams.get(url)
            if upstream is not None and upstream.healthy:
                yield upstream
            if len(seen) == len(self.upstreams):
                return

    @property
    def any_healthy(self) -> bool:
        """Whether at least one replica can take calls (readiness)."""
        return any(u.healthy for u in self.upstreams.values())

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for upstream in list(self.upstreams.values()):
                if not upstream.healthy:
                    await self.probe(upstream)

    async def probe(self, upstream: Upstream) -> bool:
        """GET `/health`; a pass brings the replica back into the ring."""
        timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s)
        upstream.checked_at = time.monotonic()
        try:
            async with self.session.get(f"{upstream.url}/health", timeout=timeout) as response:
                ok = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok and not upstream.healthy:
            log.info("upstream.healthy", upstream=upstream.url)
        if ok:
            upstream.healthy, upstream.failures = True, 0
        return ok

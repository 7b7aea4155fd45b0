"""Weight versions (from WEIGHTS) and the pause gate used while replicas load new weights.

Every span records the policy version at its start and end. The trainer (or an operator) pauses
the gateway around a weight update: new calls wait at the gate, bounded by `pause_wait_s`, then
get 503 with Retry-After; calls already in flight finish, and `drained()` tells when none is left.
"""

from __future__ import annotations

import asyncio

from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus, ConsumerSpec, Delivery, Subscription
from harnessrl.shared.contracts import WeightVersion
from harnessrl.shared.log import get_logger

log = get_logger(__name__)


class WeightBook:
    """The latest weight version of each run, followed from the WEIGHTS stream."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.versions: dict[str, int] = {}
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        """Follow the last version of every run, then each new one."""
        spec = ConsumerSpec(
            stream=subjects.WEIGHTS.name,
            filter_subject=f"{subjects.PREFIX}.weights.>",
            deliver="last_per_subject",
        )
        self._subscription = await self.bus.subscribe(spec, self._on_version)

    async def stop(self) -> None:
        """Stop following."""
        if self._subscription is not None:
            await self._subscription.stop()

    async def _on_version(self, delivery: Delivery) -> None:
        message = delivery.decode(WeightVersion)
        if message.version > self.versions.get(message.run, -1):
            self.versions[message.run] = message.version
            log.info("weights.updated", run=message.run, version=message.version)

    def version(self, run: str, replica_version: int = 0) -> int:
        """The version serving `run` now: the newer of the run's and the replica's."""
        return max(self.versions.get(run, 0), replica_version)


class PauseGate:
    """Holds new calls while paused; counts calls in flight so a pause can wait for the drain."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.in_flight = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def paused(self) -> bool:
        """Whether new calls are being held."""
        return not self._open.is_set()

    def pause(self) -> None:
        """Hold new calls from now on."""
        self._open.clear()

    def resume(self) -> None:
        """Release the waiting calls."""
        self._open.set()

    async def enter(self) -> bool:
        """Admit one call (waiting while paused); False when the pause outlasted `wait_s`."""
        if not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), self.wait_s)
            except TimeoutError:
                return False
        self.in_flight += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        """A call admitted by `enter` finished."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no call is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

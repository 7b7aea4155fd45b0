"""The controller lease: which controller of a group is the active one, decided by KV revisions.

One key per group in the `hrl-controller-lease` bucket; its value names the holder and its TTL.
No clocks are compared across machines: each contender measures time on its own monotonic clock
and reads expiry from revisions.

- Acquire: `create` an absent key, or `update` a released one (empty holder) at its revision.
- Renew: `update` at the revision of our own last write, every third of the TTL. A renewal that
  finds another revision means someone took over: the lease is lost.
- Take over: a contender that has seen one revision for a whole TTL (counted from the return of
  the read that first showed it) `update`s at that revision. Of several contenders exactly one
  write succeeds, and a renewal that lands first makes all of them fail.
- Fencing: the holder counts from when it *sent* its last confirmed write, which is before anyone
  could read that revision, so no takeover can land before `sent + ttl`. It holds the lease only
  until `sent + 2/3 ttl` (`fence_at`), which leaves a third of the TTL to stop before anyone else starts.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence

import msgspec

from harnessrl.controller.errors import ControllerError
from harnessrl.shared.bus import BusError, KeyExistsError, KeyValue, RevisionMismatchError
from harnessrl.shared.log import get_logger

# Fractions of the TTL: renew after a third, stop holding after two thirds, standbys poll every tenth.
RENEW_FRACTION = 1 / 3
FENCE_FRACTION = 2 / 3
POLL_FRACTION = 1 / 10

Clock = Callable[[], float]
OnLost = Callable[[str], None]


class LeaseLostError(ControllerError):
    """This controller does not hold its group's lease (any more): it must not act for the group."""


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The lease key's value: who holds it (empty: released) and how long its silence must last."""

    holder: str = ""
    ttl_s: float = 0.0


def lease_key(group: str, runs: Sequence[str]) -> str:
    """The group's key: `group` if set, else one named after the runs the controller owns."""
    if group:
        return group
    if not runs:
        return "all"
    return "runs-" + hashlib.sha256("\n".join(sorted(set(runs))).encode()).hexdigest()[:16]


def holder_id() -> str:
    """This process's name among its contenders: host, pid and a random part (never reused)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Lease:
    """One contender's view of its group's lease (see the module doc for the protocol)."""

    def __init__(
        self, kv: KeyValue, key: str, holder: str, ttl_s: float, *, clock: Clock = time.monotonic
    ) -> None:
        self.key, self.holder, self.ttl_s = key, holder, ttl_s
        self._kv, self._clock = kv, clock
        self._value = msgspec.json.encode(LeaseRecord(holder=holder, ttl_s=ttl_s))
        self._revision: int | None = None
        self._sent = -math.inf
        # The revision another holder's entry had when first read here, and when that read returned.
        self._seen: tuple[int, float] | None = None
        # The other holder last seen (for the logs).
        self.other = ""
        self._log = get_logger(__name__, key=key, holder=holder)

    @property
    def fence_at(self) -> float:
        """When, on this contender's clock, it stops holding the lease unless a renewal is confirmed."""
        return self._sent + self.ttl_s * FENCE_FRACTION

    @property
    def held(self) -> bool:
        """Whether this contender holds the lease right now."""
        return self._revision is not None and self._clock() < self.fence_at

    def check(self) -> None:
        """Raise `LeaseLostError` unless the lease is held now (called before every write and publish)."""
        if not self.held:
            raise LeaseLostError(f"controller {self.holder} does not hold lease {self.key}")

    async def try_acquire(self) -> bool:
        """One attempt: take an absent, released or expired lease; False while someone else holds it."""
        entry = await self._kv.get(self.key)
        read_at = self._clock()
        if entry is None:
            return await self._write(None)
        record = msgspec.json.decode(entry.value, type=LeaseRecord)
        ttl = max(record.ttl_s, self.ttl_s)  # a holder's longer TTL is honoured
        if record.holder and not self._silent_for(entry.revision, ttl, read_at):
            self.other = record.holder
            return False
        return await self._write(entry.revision)

    def _silent_for(self, revision: int, ttl: float, read_at: float) -> bool:
        """Whether `revision` has been the current one for `ttl` seconds, as seen from here."""
        if self._seen is None or self._seen[0] != revision:
            self._seen = (revision, read_at)
        return read_at - self._seen[1] >= ttl

    async def _write(self, revision: int | None) -> bool:
        sent = self._clock()
        try:
            if revision is None:
                written = await self._kv.create(self.key, self._value)
            else:
                written = await self._kv.update(self.key, self._value, revision)
        except (KeyExistsError, RevisionMismatchError):
            return False
        self._revision, self._sent = written, sent
        return True

    async def acquire(self) -> None:
        """Wait as a standby until this contender holds the lease, polling every tenth of the TTL."""
        waiting_on = ""
        while True:
            try:
                if await self.try_acquire():
                    self._log.info("lease.acquired", ttl_s=self.ttl_s)
                    return
            except BusError as exc:
                self._log.warning("lease.unreachable", error=str(exc))
            if self.other != waiting_on:
                waiting_on = self.other
                self._log.info("controller.standby", active=waiting_on)
            await asyncio.sleep(self.ttl_s * POLL_FRACTION)

    async def renew(self) -> None:
        """Extend the lease; `LeaseLostError` when another contender has taken it over."""
        if self._revision is None:
            raise LeaseLostError(f"controller {self.holder} never held lease {self.key}")
        sent = self._clock()
        try:
            written = await self._kv.update(self.key, self._value, self._revision)
        except RevisionMismatchError as exc:
            self._revision = None
            raise LeaseLostError(f"lease {self.key} was taken over") from exc
        self._revision, self._sent = written, sent
        self._log.debug("lease.renewed", revision=written, took_s=round(self._clock() - sent, 3))

    async def keep(self, on_lost: OnLost) -> None:
        """Renew every third of the TTL until the lease is lost, then call `on_lost(why)` and return.

        Lost means taken over, or no renewal confirmed by `fence_at`: a renewal that hangs (a
        partition) is abandoned at that moment, not when the bus gives up.
        """
        while True:
            await asyncio.sleep(max(0.0, self._sent + self.ttl_s * RENEW_FRACTION - self._clock()))
            budget = self.fence_at - self._clock()
            if budget <= 0:
                on_lost(f"no renewal confirmed within {self.ttl_s * FENCE_FRACTION:g} s")
                return
            try:
                async with asyncio.timeout(budget):
                    await self.renew()
            except LeaseLostError as exc:
                on_lost(str(exc))
                return
            except TimeoutError:
                continue
            except BusError as exc:
                self._log.warning("lease.renew_failed", error=str(exc))
                await asyncio.sleep(min(self.ttl_s * POLL_FRACTION, max(0.0, self.fence_at - self._clock())))

    async def release(self) -> None:
        """Hand a held lease back, so a standby takes it at its next poll (a lost one is left alone)."""
        revision, self._revision = self._revision, None
        if revision is None or self._clock() >= self.fence_at:
            return
        released = msgspec.json.encode(LeaseRecord(ttl_s=self.ttl_s))
        try:
            await self._kv.update(self.key, released, revision)
        except RevisionMismatchError:
            return
        except BusError as exc:  # it expires on its own; a standby takes over a TTL later
            self._log.warning("lease.release_failed", error=str(exc))
            return
        self._log.info("lease.released")

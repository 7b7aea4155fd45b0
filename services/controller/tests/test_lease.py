"""The controller lease on a real KV bucket: one holder at a time, expiry by revision, fencing."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest

from harnessrl.controller.lease import FENCE_FRACTION, Lease, LeaseLostError, LeaseRecord, lease_key
from harnessrl.controller.records import EpisodeRecord
from harnessrl.controller.store import EpisodeStore, StateConflictError
from harnessrl.shared import subjects
from harnessrl.shared.bus import KeyValue, KvEntry, NatsBus

TTL = 9.0


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Partitionable(KeyValue):
    """A real bucket whose writes hang, as across a network partition, once `cut` is set."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self.cut = False

    async def _hang_if_cut(self) -> None:
        if self.cut:
            await asyncio.Event().wait()

    async def get(self, key: str) -> KvEntry | None:
        return await self._kv.get(key)

    async def put(self, key: str, value: bytes) -> int:
        await self._hang_if_cut()
        return await self._kv.put(key, value)

    async def create(self, key: str, value: bytes) -> int:
        await self._hang_if_cut()
        return await self._kv.create(key, value)

    async def update(self, key: str, value: bytes, revision: int) -> int:
        await self._hang_if_cut()
        return await self._kv.update(key, value, revision)

    async def delete(self, key: str) -> None:
        await self._kv.delete(key)

    async def keys(self) -> list[str]:
        return await self._kv.keys()


async def contenders(bus: NatsBus, clock: FakeClock, *names: str, ttl: float = TTL) -> list[Lease]:
    kv = await bus.kv(subjects.CONTROLLER_LEASE)
    key = f"test-{os.urandom(4).hex()}"
    return [Lease(kv, key, name, ttl, clock=clock) for name in names]


async def test_one_holder_until_its_lease_has_been_silent_for_a_ttl(bus: NatsBus) -> None:
    clock = FakeClock()
    a, b = await contenders(bus, clock, "a", "b")
    assert await a.try_acquire()
    assert not await b.try_acquire()
    assert b.other == "a"
    clock.advance(TTL / 3)
    await a.renew()  # a new revision: b starts counting again from its next read
    clock.advance(TTL - 1)
    assert not await b.try_acquire()
    clock.advance(TTL - 1)
    assert not await b.try_acquire()  # b first saw a's renewal 8 s ago
    assert not a.held  # long past its fence, a no longer acts ...
    clock.advance(1)
    assert await b.try_acquire()  # ... and b may take over only later
    assert b.held
    with pytest.raises(LeaseLostError):
        await a.renew()
    with pytest.raises(LeaseLostError):
        a.check()


async def test_of_contenders_for_an_expired_lease_exactly_one_wins(bus: NatsBus) -> None:
    clock = FakeClock()
    holder, *standbys = await contenders(bus, clock, "dead", *(f"standby-{i}" for i in range(5)))
    assert await holder.try_acquire()
    assert not any(await asyncio.gather(*(s.try_acquire() for s in standbys)))
    clock.advance(TTL)
    won = await asyncio.gather(*(s.try_acquire() for s in standbys))
    assert sorted(won) == [False] * 4 + [True]
    assert [s.held for s in standbys] == won


async def test_a_renewal_landing_first_defeats_the_takeover(bus: NatsBus) -> None:
    clock = FakeClock()
    a, b = await contenders(bus, clock, "a", "b")
    assert await a.try_acquire()
    assert not await b.try_acquire()
    clock.advance(TTL)  # b would take over at its next read, but a renews first
    await a.renew()
    assert not await b.try_acquire()
    assert a.held
    a.check()


async def test_a_released_lease_is_taken_at_once_and_a_lost_one_is_not_released(bus: NatsBus) -> None:
    clock = FakeClock()
    a, b, c = await contenders(bus, clock, "a", "b", "c")
    assert await a.try_acquire()
    await a.release()
    assert not a.held
    assert await b.try_acquire()  # no TTL to wait
    clock.advance(TTL)
    assert not await c.try_acquire()
    clock.advance(TTL)
    assert await c.try_acquire()  # b's lease expired and c took it
    await b.release()  # b lost it: its release must not free c's lease
    assert c.held
    assert not await a.try_acquire()


async def test_the_holder_fences_itself_a_third_of_the_ttl_before_a_takeover(bus: NatsBus) -> None:
    clock = FakeClock()
    a, b = await contenders(bus, clock, "a", "b")
    assert await a.try_acquire()
    assert not await b.try_acquire()
    fence = TTL * FENCE_FRACTION
    clock.advance(fence - 0.1)
    a.check()
    clock.advance(0.2)
    assert not a.held  # a stopped acting at 2/3 of the TTL ...
    with pytest.raises(LeaseLostError):
        a.check()
    clock.advance(TTL - fence - 0.2)
    assert not await b.try_acquire()  # ... a third of the TTL before b may take over
    clock.advance(0.2)
    assert await b.try_acquire()


async def test_the_lease_is_absent_at_first_and_create_decides(bus: NatsBus) -> None:
    clock = FakeClock()
    leases = await contenders(bus, clock, *(f"c{i}" for i in range(4)))
    won = await asyncio.gather(*(lease.try_acquire() for lease in leases))
    assert sorted(won) == [False, False, False, True]
    winner = leases[won.index(True)]
    entry = await bus.kv(subjects.CONTROLLER_LEASE)
    stored = await entry.get(winner.key)
    assert stored is not None
    assert msgspec.json.decode(stored.value, type=LeaseRecord) == LeaseRecord(holder=winner.holder, ttl_s=TTL)


async def test_keep_reports_a_hanging_renewal_by_the_fence(bus: NatsBus) -> None:
    ttl = 0.9
    kv = Partitionable(await bus.kv(subjects.CONTROLLER_LEASE))
    lease = Lease(kv, f"test-{os.urandom(4).hex()}", "cut-off", ttl)
    assert await lease.try_acquire()
    lost: list[tuple[float, str]] = []
    keeper = asyncio.create_task(lease.keep(lambda why: lost.append((time.monotonic(), why))))
    await asyncio.sleep(ttl)  # renewed a few times
    assert lease.held and not lost
    kv.cut = True
    async with asyncio.timeout(ttl * 2):
        await keeper
    ((at, why),) = lost
    assert "no renewal confirmed" in why
    assert lease.fence_at <= at < lease.fence_at + 0.2  # at its fence, not when the bus gives up
    assert not lease.held


async def test_keep_reports_a_takeover_at_the_next_renewal(bus: NatsBus) -> None:
    ttl = 0.9
    kv = await bus.kv(subjects.CONTROLLER_LEASE)
    lease = Lease(kv, f"test-{os.urandom(4).hex()}", "victim", ttl)
    assert await lease.try_acquire()
    lost: list[str] = []
    keeper = asyncio.create_task(lease.keep(lost.append))
    entry = await kv.get(lease.key)
    assert entry is not None
    await kv.update(lease.key, msgspec.json.encode(LeaseRecord(holder="thief", ttl_s=ttl)), entry.revision)
    async with asyncio.timeout(ttl):
        await keeper
    assert lost == [f"lease {lease.key} was taken over"]


async def test_a_store_behind_a_lost_lease_refuses_every_write(bus: NatsBus) -> None:
    clock = FakeClock()
    (lease,) = await contenders(bus, clock, "writer")
    assert await lease.try_acquire()
    store = EpisodeStore(await bus.kv(subjects.EPISODE_STATE), ensure_active=lease.check)
    run = f"fenced-{os.urandom(3).hex()}"
    record = EpisodeRecord(run=run, episode="e0", task="t", group="g")
    assert await store.create_episode(record)
    clock.advance(TTL * FENCE_FRACTION)
    with pytest.raises(LeaseLostError):
        await store.save_episode(record)
    with pytest.raises(LeaseLostError):
        await store.create_episode(EpisodeRecord(run=run, episode="e1", task="t", group="g"))
    assert [r.episode for r in await store.episodes(run)] == ["e0"]


async def test_adopting_a_record_makes_the_old_controllers_late_write_fail(bus: NatsBus) -> None:
    kv = await bus.kv(subjects.EPISODE_STATE)
    old, new = EpisodeStore(kv), EpisodeStore(kv)
    run = f"claimed-{os.urandom(3).hex()}"
    first = EpisodeRecord(run=run, episode="e0", task="t", group="g", published=True)
    second = msgspec.structs.replace(first, episode="e1")
    assert await old.create_episode(first)
    assert await old.create_episode(second)
    adopted = {r.episode: r for r in await new.episodes(run)}
    started = msgspec.structs.replace(second, phase="started")
    await old.save_episode(started)  # lands between the new controller's read and its claim
    assert await new.claim_episode(adopted["e0"]) == first
    assert await new.claim_episode(adopted["e1"]) == started  # read back and adopted as it is
    with pytest.raises(StateConflictError):  # still on its way from the old controller
        await old.save_episode(msgspec.structs.replace(first, phase="failed"))
    with pytest.raises(StateConflictError):
        await old.save_episode(msgspec.structs.replace(started, phase="failed"))
    assert {r.episode: r.phase for r in await new.episodes(run)} == {"e0": "scheduled", "e1": "started"}


def test_lease_keys_follow_the_runs_a_controller_owns() -> None:
    assert lease_key("", []) == "all"
    assert lease_key("", ["b", "a"]) == lease_key("", ["a", "b", "a"])
    assert lease_key("", ["a"]) != lease_key("", ["b"])
    assert lease_key("blue", ["a"]) == "blue"

"""Episodes as this gateway replica knows them: open or closed, their spans, their run's sampling.

All of it is a cache of the bus, bounded and right after a restart. On first sight of an episode (a
new one, or after a restart or an eviction) the gateway looks its closing events up on the bus
(`agent_exited`, `completed`, `failed`: one exact-subject read each, in parallel) and, for a run
whose sampling policy it doesn't know, the episode's `scheduled` event (the controller publishes it
before it launches the harness). Afterwards it follows new lifecycle events (never the stream's
history) for closes of the episodes it holds and for schedules. It holds at most `cache_size`
episodes (LRU); an evicted one is looked up again when it comes back. A closed episode refuses
further calls; one never seen is open while its key verifies (keys are signed and expire).

An episode's spans (`EpisodeSpans`) start empty and are read only when an append finds the
subject already moved on, so a new episode costs no read of SPANS at all.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from harnessrl.gateway.episode_spans import EpisodeSpans
from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus, ConsumerSpec, Delivery, Subscription
from harnessrl.shared.contracts import (
    AgentExited,
    EpisodeCompleted,
    EpisodeFailed,
    EpisodeScheduled,
    Sampling,
    decode_event,
)
from harnessrl.shared.log import get_logger

log = get_logger(__name__)

# The harness is done once it exited; terminal events close episodes whose exit was missed.
CLOSING_EVENTS = (AgentExited, EpisodeCompleted, EpisodeFailed)
_CLOSING_KINDS = tuple(str(kind.__struct_config__.tag) for kind in CLOSING_EVENTS)

Key = tuple[str, str]


class Episode:
    """One episode held by this replica: whether it is closed, and its spans."""

    __slots__ = ("closed", "looked_up", "spans")

    def __init__(self, looked_up: asyncio.Future[bool]) -> None:
        self.closed = False  # once True, stays True
        self.spans = EpisodeSpans()
        self.looked_up = looked_up  # True: a closing event is stored


class EpisodeCache:
    """The episodes this replica holds (an LRU of `cache_size`) and each run's sampling policy."""

    def __init__(self, bus: Bus, *, cache_size: int) -> None:
        self.bus = bus
        self.cache_size = cache_size
        self.run_sampling: dict[str, Sampling] = {}
        self.run_token_in: dict[str, bool] = {}  # runs whose spec set `token_in`
        self._episodes: OrderedDict[Key, Episode] = OrderedDict()
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        """Follow lifecycle events from now on (an ephemeral consumer; first sight covers the past)."""
        spec = ConsumerSpec(
            stream=subjects.EPISODES.name, filter_subject=f"{subjects.PREFIX}.episode.>", deliver="new"
        )
        self._subscription = await self.bus.subscribe(spec, self._on_event)

    async def stop(self) -> None:
        """Stop following events."""
        if self._subscription is not None:
            await self._subscription.stop()

    async def _on_event(self, delivery: Delivery) -> None:
        event = decode_event(delivery.data)
        if isinstance(event, EpisodeScheduled):
            self._learn_run(event)
        elif isinstance(event, CLOSING_EVENTS):
            held = self._episodes.get((event.run, event.episode))
            if held is not None:
                held.closed = True

    def __len__(self) -> int:
        return len(self._episodes)

    def is_closed(self, run: str, episode: str) -> bool:
        """Whether the episode is held here and known to be closed (no lookup)."""
        held = self._episodes.get((run, episode))
        return held is not None and held.closed

    def closed_count(self) -> int:
        """How many of the episodes held here are closed."""
        return sum(1 for held in self._episodes.values() if held.closed)

    def sampling(self, run: str) -> Sampling:
        """The run's sampling policy (known once one of its scheduled episodes was seen)."""
        return self.run_sampling.get(run, {})

    def token_in(self, run: str, default: bool) -> bool:
        """Whether the run's calls go token-in (its spec's `token_in`, else `default`)."""
        return self.run_token_in.get(run, default)

    def _learn_run(self, event: EpisodeScheduled) -> None:
        self.run_sampling[event.run] = event.sampling
        if event.token_in is not None:
            self.run_token_in[event.run] = event.token_in

    async def episode(self, run: str, episode: str) -> Episode:
        """The episode, looked up on the bus on first sight; raises what the bus raised."""
        key = (run, episode)
        held = self._episodes.get(key)
        if held is None:
            held = self._hold(key)
        else:
            self._episodes.move_to_end(key)
        # Shielded: one caller going away must not cancel the lookup the others wait for.
        if await asyncio.shield(held.looked_up):
            held.closed = True
        return held

    def _hold(self, key: Key) -> Episode:
        """Hold the episode before its lookup runs, so a close followed meanwhile is not missed."""
        held = Episode(asyncio.ensure_future(self._look_up(*key)))
        self._episodes[key] = held
        if len(self._episodes) > self.cache_size:
            self._episodes.popitem(last=False)
        held.looked_up.add_done_callback(lambda done: self._drop_failed(key, held, done))
        return held

    def _drop_failed(self, key: Key, held: Episode, done: asyncio.Future[bool]) -> None:
        if (done.cancelled() or done.exception() is not None) and self._episodes.get(key) is held:
            del self._episodes[key]  # the next call looks it up again

    async def _look_up(self, run: str, episode: str) -> bool:
        """Whether a closing event of the episode is stored (and the run's sampling, if new)."""
        reads = [
            self.bus.replay(subjects.EPISODES.name, subjects.episode_event(run, episode, kind))
            for kind in _CLOSING_KINDS
        ]
        closing, _ = await asyncio.gather(asyncio.gather(*reads), self._learn_sampling(run, episode))
        return any(closing)

    async def _learn_sampling(self, run: str, episode: str) -> None:
        """A run not seen in the events followed: its policy from this episode's schedule.

        An episode that was not scheduled (a key minted outside the controller) teaches nothing;
        the run's next episodes are looked up again until a schedule of the run is seen.
        """
        if run in self.run_sampling:
            return
        subject = subjects.episode_event(run, episode, "scheduled")
        for delivery in await self.bus.replay(subjects.EPISODES.name, subject):
            event = decode_event(delivery.data)
            if isinstance(event, EpisodeScheduled):
                self._learn_run(event)

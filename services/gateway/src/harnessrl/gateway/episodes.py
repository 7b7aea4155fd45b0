"""Episodes as the gateway sees them: open or closed, call counter and last span (for deltas).

Open/closed comes from the EPISODES stream: an episode whose `agent_exited`, `completed` or
`failed` event was seen refuses further calls. An episode never seen is open while its key
verifies (keys are signed and expire). A run's sampling policy comes from its episodes'
`scheduled` events; on first sight of an episode of a run not yet seen, from that episode's own
`scheduled` event (the controller publishes it before it launches the harness).

Per episode the gateway keeps its next `seq` and its last span's context (prompt + completion
ids) in an LRU. On first sight of an episode (a new one, or after a restart or eviction) the
state is rebuilt from the episode's spans on the bus, so `seq` never repeats and deltas keep
referring to a stored span.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus, ConsumerSpec, Delivery, Subscription
from harnessrl.shared.contracts import (
    AgentExited,
    ContractError,
    EpisodeCompleted,
    EpisodeFailed,
    EpisodeScheduled,
    Sampling,
    Span,
    decode_event,
)
from harnessrl.shared.log import get_logger
from harnessrl.shared.tokens import TokenDeltaError, reconstruct_prompts, span_context

log = get_logger(__name__)

# The harness is done once it exited; terminal events close episodes whose exit was missed.
CLOSING_EVENTS = (AgentExited, EpisodeCompleted, EpisodeFailed)


class EpisodeCalls:
    """The call state of one episode: next seq and the parent of the next span."""

    __slots__ = ("last_context", "last_span", "next_seq")

    def __init__(self) -> None:
        self.next_seq = 0
        self.last_span: str | None = None
        self.last_context: list[int] | None = None

    def take_seq(self) -> int:
        """Reserve the next sequence number (never reused, even if its publish fails)."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def advance(self, span_id: str, context: list[int]) -> None:
        """Make `span_id` the parent of the episode's next call."""
        self.last_span, self.last_context = span_id, context


class EpisodeCache:
    """What the gateway knows of episodes, all of it a cache of the bus.

    Which episodes are closed and each run's sampling (both from lifecycle events), and each
    episode's call state (an LRU, rebuilt from the episode's spans on a miss).
    """

    def __init__(self, bus: Bus, *, cache_size: int) -> None:
        self.bus = bus
        self.cache_size = cache_size
        self.closed: set[tuple[str, str]] = set()
        self.run_sampling: dict[str, Sampling] = {}
        self._calls: OrderedDict[tuple[str, str], EpisodeCalls] = OrderedDict()
        self._loading: dict[tuple[str, str], asyncio.Future[EpisodeCalls]] = {}
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        """Follow every lifecycle event from the start of the stream (an ephemeral consumer)."""
        spec = ConsumerSpec(stream=subjects.EPISODES.name, filter_subject=f"{subjects.PREFIX}.episode.>")
        self._subscription = await self.bus.subscribe(spec, self._on_event)

    async def stop(self) -> None:
        """Stop following events."""
        if self._subscription is not None:
            await self._subscription.stop()

    async def _on_event(self, delivery: Delivery) -> None:
        event = decode_event(delivery.data)
        if isinstance(event, EpisodeScheduled):
            self.run_sampling[event.run] = event.sampling
        elif isinstance(event, CLOSING_EVENTS):
            self.closed.add((event.run, event.episode))

    def is_closed(self, run: str, episode: str) -> bool:
        """Whether the episode's harness is done (its calls are refused)."""
        return (run, episode) in self.closed

    async def calls(self, run: str, episode: str) -> EpisodeCalls:
        """The episode's call state, rebuilt from its stored spans on first sight."""
        key = (run, episode)
        found = self._calls.get(key)
        if found is not None:
            self._calls.move_to_end(key)
            return found
        task = self._loading.get(key)
        if task is None:
            task = asyncio.ensure_future(self._load(key))
            self._loading[key] = task
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        # Shielded: one caller going away must not cancel the load the others wait for.
        return await asyncio.shield(task)

    async def _load(self, key: tuple[str, str]) -> EpisodeCalls:
        state = EpisodeCalls()
        await self._rebuild(*key, state)
        await self._learn_sampling(*key)
        self._calls[key] = state
        if len(self._calls) > self.cache_size:
            self._calls.popitem(last=False)
        return state

    def sampling(self, run: str) -> Sampling:
        """The run's sampling policy (known once one of its episodes was loaded by `calls`)."""
        return self.run_sampling.get(run, {})

    async def _learn_sampling(self, run: str, episode: str) -> None:
        """A run not seen in the events followed: its policy from this episode's schedule.

        A run none of whose episodes was scheduled (keys minted outside the controller) has none;
        that is remembered until a schedule of the run says otherwise.
        """
        if run in self.run_sampling:
            return
        subject = subjects.episode_event(run, episode, "scheduled")
        for delivery in await self.bus.replay(subjects.EPISODES.name, subject):
            event = decode_event(delivery.data)
            if isinstance(event, EpisodeScheduled):
                self.run_sampling[run] = event.sampling
        self.run_sampling.setdefault(run, {})

    async def _rebuild(self, run: str, episode: str, state: EpisodeCalls) -> None:
        deliveries = await self.bus.replay(subjects.SPANS.name, subjects.span(run, episode))
        spans: list[Span] = []
        for delivery in deliveries:
            try:
                spans.append(delivery.decode(Span))
            except ContractError:
                log.warning("episode.span_unreadable", run=run, episode=episode)
        if not spans:
            return
        state.next_seq = max(span.seq for span in spans) + 1
        last = max((s for s in spans if s.status == "ok"), key=lambda s: s.seq, default=None)
        if last is None:
            return
        try:
            prompts = reconstruct_prompts(spans)
        except TokenDeltaError as exc:
            log.warning("episode.delta_chain_broken", run=run, episode=episode, error=str(exc))
            return
        state.advance(last.span_id, span_context(prompts[last.span_id], last))

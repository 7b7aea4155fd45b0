"""Per-episode statistics from the event stream: calls, tokens, weight versions and reward."""

from __future__ import annotations

import argparse
import asyncio

from harnessrl.shared import subjects
from harnessrl.shared.bus import ConsumerSpec, Delivery, NatsBus
from harnessrl.shared.contracts import EpisodeCompleted, Span, decode_event


class EpisodeStats:
    """Token counts and versions of one episode, accumulated span by span."""

    def __init__(self) -> None:
        self.calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.versions: set[int] = set()

    def add(self, span: Span) -> None:
        self.calls += 1
        self.prompt_tokens += span.prompt_len
        self.completion_tokens += sum(len(c.token_ids) for c in span.completions)
        self.versions.update({span.weight_version_start, span.weight_version_end})


async def follow(url: str, run: str, durable: str, limit: int | None) -> dict[str, dict[str, object]]:
    """Print one line per completed episode; return the lines' data (stops after `limit`)."""
    done: dict[str, dict[str, object]] = {}
    finished = asyncio.Event()
    bus = NatsBus(url)

    async def on_completed(delivery: Delivery) -> None:
        event = decode_event(delivery.data)
        if not isinstance(event, EpisodeCompleted):
            return
        stats = EpisodeStats()
        for stored in await bus.replay("SPANS", subjects.span(run, event.episode)):
            stats.add(stored.decode(Span))
        row = {
            "calls": stats.calls,
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "versions": sorted(stats.versions),
            "reward": event.reward,
        }
        done[event.episode] = row
        print(event.episode, row)
        if limit is not None and len(done) >= limit:
            finished.set()

    await bus.connect()
    completed = subjects.episode_events_of_run(run, "completed")
    await bus.subscribe(
        ConsumerSpec(stream="EPISODES", filter_subject=completed, durable=durable), on_completed
    )
    try:
        await finished.wait()
    finally:
        await bus.close()
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--run", required=True)
    parser.add_argument("--durable", default="span-stats")
    parser.add_argument("--limit", type=int, default=None, help="stop after this many episodes")
    args = parser.parse_args()
    asyncio.run(follow(args.nats_url, args.run, args.durable, args.limit))


if __name__ == "__main__":
    main()

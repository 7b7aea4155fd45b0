"""Tool-call error rate and tokens per turn of a run, from the event stream (`harnessrl.shared` only).

A durable consumer on EPISODES takes each finished episode (completed or failed), reads its spans
from SPANS and counts, turn by turn (one span is one LLM call):

- tool calls: a completion the server ended with `finish_reason == "tool_calls"` (native tool
  calling, parsed by vLLM), a `<tool_call>...</tool_call>` block in its text (hermes-style calls,
  as the tiny policy writes them), or a reply that starts with `CALC` (the demo harness's calculator);
- tool-call errors: calls no harness can run: a `<tool_call>` block that is not closed (the turn ran
  out of tokens) or whose body is no JSON object with a `name`, a `CALC` reply other than exactly
  `CALC <int>*<int>`, or a call whose LLM call itself failed (span status other than `ok`);
- tokens per turn: by turn number, the mean completion tokens and the mean new prompt tokens (what
  the harness added to the conversation since the previous call: tool output, user turns).

It prints one JSON line per `--every` finished episodes and one when it stops (after `--limit`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
from collections import defaultdict
from typing import Any

from harnessrl.shared import subjects
from harnessrl.shared.bus import ConsumerSpec, Delivery, NatsBus
from harnessrl.shared.contracts import TERMINAL_KINDS, Completion, Span, decode_event, event_kind

HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
CALC = re.compile(r"^\s*CALC\s+(\d+)\s*\*\s*(\d+)\s*$")  # exactly what the demo harness runs


def well_formed(body: str) -> bool:
    """Whether a hermes tool-call body is a JSON object naming the tool."""
    try:
        call = json.loads(body)
    except ValueError:
        return False
    return isinstance(call, dict) and isinstance(call.get("name"), str)


def tool_calls(completion: Completion) -> tuple[int, int]:
    """How many tool calls a completion makes, and how many of them are malformed."""
    if completion.finish_reason == "tool_calls":
        return 1, 0
    text = completion.text
    blocks = HERMES.findall(text)
    if blocks:
        return len(blocks), sum(not (closed and well_formed(body)) for body, closed in blocks)
    if text.lstrip().startswith("CALC"):
        return 1, int(CALC.match(text) is None)
    return 0, 0


class RunStats:
    """A run's tool calls and tokens, accumulated episode by episode."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.episodes = 0
        self.turns = 0
        self.calls = 0
        self.errors = 0
        self.failed_turns = 0
        # turn number -> [episodes that reached it, completion tokens, new prompt tokens]
        self.per_turn: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])

    def add_episode(self, spans: list[Span]) -> None:
        self.episodes += 1
        for span in spans:
            self.add_turn(span)

    def add_turn(self, span: Span) -> None:
        self.turns += 1
        completion = span.completions[0] if span.completions else Completion(token_ids=[], logprobs=[])
        calls, malformed = tool_calls(completion)
        failed = span.status != "ok"
        self.calls += calls
        self.errors += calls if failed else malformed
        self.failed_turns += failed
        turn = self.per_turn[span.seq + 1]
        turn[0] += 1
        turn[1] += len(completion.token_ids)
        turn[2] += span.prompt_len - span.prefix_len

    def summary(self) -> dict[str, Any]:
        per_turn = [
            {
                "turn": n,
                "episodes": t[0],
                "completion_tokens": round(t[1] / t[0], 1),
                "new_prompt_tokens": round(t[2] / t[0], 1),
            }
            for n, t in sorted(self.per_turn.items())
        ]
        rate = round(self.errors / self.calls, 4) if self.calls else 0.0
        return {
            "run": self.run,
            "episodes": self.episodes,
            "turns": self.turns,
            "failed_turns": self.failed_turns,
            "tool_calls": self.calls,
            "tool_call_errors": self.errors,
            "tool_call_error_rate": rate,
            "per_turn": per_turn,
        }


async def follow(url: str, run: str, durable: str, every: int, limit: int | None) -> RunStats:
    """Accumulate finished episodes of `run`; print a summary every `every` and at the end."""
    stats = RunStats(run)
    finished = asyncio.Event()
    bus = NatsBus(url)

    async def on_event(delivery: Delivery) -> None:
        event = decode_event(delivery.data)
        if event_kind(event) not in TERMINAL_KINDS or finished.is_set():
            return
        stored = await bus.replay(subjects.SPANS.name, subjects.span(run, event.episode))
        stats.add_episode([d.decode(Span) for d in stored])
        if stats.episodes % every == 0 and stats.episodes != limit:
            print(json.dumps(stats.summary()))
        if limit is not None and stats.episodes >= limit:
            finished.set()

    await bus.connect()
    events = subjects.episode_events_of_run(run)
    await bus.subscribe(ConsumerSpec(stream="EPISODES", filter_subject=events, durable=durable), on_event)
    try:
        await finished.wait()
    finally:
        await bus.close()
    print(json.dumps(stats.summary()))
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--run", required=True)
    parser.add_argument("--durable", default="tool-calls")
    parser.add_argument("--every", type=int, default=16, help="print a summary every N episodes")
    parser.add_argument("--limit", type=int, default=None, help="stop after this many episodes")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends a follow without --limit
        asyncio.run(follow(args.nats_url, args.run, args.durable, args.every, args.limit))


if __name__ == "__main__":
    main()

"""What the clients saw against what the bus holds, after a run on the scaled-out deployment.

Each harness logs the span id of every answer it got (`claimed`); the bus holds the spans, the
episodes' lifecycle events, the rollouts and the weight versions (`read_bus`). `verify` counts what
must be zero: seq gaps and duplicates, answered calls without their span, span ids stored twice,
episodes without exactly one terminal event, completed episodes without a rollout, rollouts whose
spans the trainer's `spans_complete` refuses, weight versions that do not strictly increase.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import (
    TERMINAL_KINDS,
    EpisodeEvent,
    RolloutComplete,
    Span,
    StepMetrics,
    WeightVersion,
    decode,
    decode_event,
    event_kind,
)


class BusRecord(msgspec.Struct, kw_only=True):
    """What the bus holds about the run (and the loads' spans)."""

    spans: list[Span]
    events: list[EpisodeEvent]
    rollouts: list[RolloutComplete]
    weights: list[WeightVersion]
    steps: list[StepMetrics]
    load_spans: list[Span]


async def read_bus(url: str, run: str, load_runs: list[str] = []) -> BusRecord:  # noqa: B006 - never mutated
    """Replay every stream's messages of `run` (and the spans of `load_runs`)."""
    bus = NatsBus(url)
    await bus.connect()

    async def replay(stream: str, subject: str) -> list[bytes]:
        return [delivery.data for delivery in await bus.replay(stream, subject)]

    try:
        spans = await replay(subjects.SPANS.name, subjects.spans_of_run(run))
        events = await replay(subjects.EPISODES.name, subjects.episode_events_of_run(run))
        rollouts = await replay(subjects.ROLLOUTS.name, subjects.rollout(run))
        weights = await replay(subjects.WEIGHTS.name, subjects.weights(run))
        steps = await replay(subjects.METRICS.name, subjects.metrics(run, "trainer"))
        load = [
            raw
            for name in load_runs
            for raw in await replay(subjects.SPANS.name, subjects.spans_of_run(name))
        ]
    finally:
        await bus.close()
    return BusRecord(
        spans=[decode(raw, Span) for raw in spans], events=[decode_event(raw) for raw in events],
        rollouts=[decode(raw, RolloutComplete) for raw in rollouts],
        weights=[decode(raw, WeightVersion) for raw in weights],
        steps=[decode(raw, StepMetrics) for raw in steps],
        load_spans=[decode(raw, Span) for raw in load],
    )  # fmt: skip


def seq_faults(spans: list[Span]) -> tuple[int, int]:
    """(gaps, duplicates) over every episode: seqs must be exactly 0..n-1."""
    by_episode: dict[tuple[str, str], list[int]] = defaultdict(list)
    for span in spans:
        by_episode[span.run, span.episode].append(span.seq)
    gaps = sum(max(seqs) + 1 - len(set(seqs)) for seqs in by_episode.values())
    duplicates = sum(len(seqs) - len(set(seqs)) for seqs in by_episode.values())
    return gaps, duplicates


def claimed(calls_dir: Path) -> list[str | None]:
    """The span id of every call the harnesses got answered (None: an answer without one)."""
    lines = (line for log in calls_dir.glob("*.jsonl") for line in log.read_text().splitlines())
    return [json.loads(line)["span"] for line in lines if line]


def versions_increase(weights: list[WeightVersion]) -> bool:
    """Steps strictly increase in stream order; a new version is the last one + 1, a carried one equals it."""
    steps = [w.step for w in weights]
    if any(later <= earlier for earlier, later in itertools.pairwise(steps)):
        return False
    last = 0
    for weight in weights:
        if weight.version != (last if weight.carries_previous else last + 1):
            return False
        last = weight.version
    return True


def verify(record: BusRecord, answered: list[str | None], load_answered: list[str] = []) -> dict[str, Any]:  # noqa: B006
    """The correctness figures: seqs, spans of answered calls, terminal events, rollouts, versions."""
    from harnessrl.trainer.assembly import spans_complete  # imports torch: only once the run is over

    by_episode: dict[str, list[Span]] = defaultdict(list)
    for span in record.spans:
        by_episode[span.episode].append(span)
    every_span = [*record.spans, *record.load_spans]
    stored = Counter(span.span_id for span in every_span)
    gaps, duplicates = seq_faults(every_span)
    kinds = [(event.episode, event_kind(event)) for event in record.events]
    terminal = Counter(episode for episode, kind in kinds if kind in TERMINAL_KINDS)
    scheduled = {episode for episode, kind in kinds if kind == "scheduled"}
    completed = {episode for episode, kind in kinds if kind == "completed"}
    rolled = [r.episode for r in record.rollouts]
    dropped: Counter[str] = Counter()
    for step in {metrics.step: metrics for metrics in record.steps}.values():  # a restart may repeat one
        dropped.update(step.dropped)
    return {
        "episodes": len(scheduled),
        "calls": len(answered),
        "seq_gaps": gaps,
        "seq_duplicates": duplicates,
        "spans_missing": sum(1 for span in [*answered, *load_answered] if span not in stored),
        "span_ids_stored_twice": sum(count - 1 for count in stored.values()),
        "rollouts_dropped": len(completed - set(rolled)),
        "rollouts_incomplete": sum(not spans_complete(r, by_episode[r.episode]) for r in record.rollouts),
        "terminal_exactly_once": bool(scheduled) and all(terminal[e] == 1 for e in scheduled | set(terminal)),
        "episodes_failed": len(scheduled - completed),
        "spans_unclaimed": len({s.span_id for s in record.spans} - set(answered)),
        "rollout_duplicates": len(rolled) - len(set(rolled)),
        "weight_versions": [w.version for w in record.weights],
        "versions_strictly_increase": versions_increase(record.weights),
        "trainer_dropped": dict(dropped),
        "load_calls": len(load_answered),
    }

"""Artifacts and spans the controller reads back from the bus when an episode ends."""

from __future__ import annotations

import hashlib

import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import ArtifactRef


async def read_artifact(bus: Bus, run: str, episode: str, kind: str) -> ArtifactRef | None:
    """A reference to the uploaded artifact, or None when the harness left none."""
    name = subjects.artifact_object(run, episode, kind)
    try:
        data = await bus.get_object(subjects.ARTIFACTS_BUCKET, name)
    except KeyError:
        return None
    return ArtifactRef(
        kind=kind,  # type: ignore[arg-type]
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        object_name=name,
    )


class SpanSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What a rollout says about its episode's spans."""

    count: int = 0
    last_seq: int = -1
    versions: list[int] = msgspec.field(default_factory=list)


class _SpanHead(msgspec.Struct, kw_only=True):
    seq: int
    weight_version_start: int = 0
    weight_version_end: int = 0


_head_decoder = msgspec.msgpack.Decoder(_SpanHead)


async def summarize_spans(bus: Bus, run: str, episode: str) -> SpanSummary:
    """Count an episode's spans, their last seq and the weight versions they saw."""
    deliveries = await bus.replay(subjects.SPANS.name, subjects.span(run, episode))
    if not deliveries:
        return SpanSummary()
    versions: set[int] = set()
    last = -1
    for delivery in deliveries:
        head = _head_decoder.decode(delivery.data)
        last = max(last, head.seq)
        versions.update((head.weight_version_start, head.weight_version_end))
    return SpanSummary(count=len(deliveries), last_seq=last, versions=sorted(versions))

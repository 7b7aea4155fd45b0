"""Stream configuration as this build defines it, and the check that a server's streams still match.

How many replicas a stream or bucket gets is the deployment's choice, not the build's: one on a
single server, three on a cluster (every process of a deployment is told `HRL_NATS_REPLICAS`).
The count is a floor: a stream with fewer replicas is scaled up, one with more is left alone, so a
tool that was not told the count never shrinks a deployment's replication.
"""

from __future__ import annotations

import os

from nats.js import api

from harnessrl.shared.bus.base import StreamDriftError
from harnessrl.shared.subjects import StreamSpec

REPLICAS_ENV = "HRL_NATS_REPLICAS"
# JetStream replicates a stream on at most 5 servers.
MAX_REPLICAS = 5


def deployment_replicas() -> int:
    """Replicas of every stream and bucket: `HRL_NATS_REPLICAS`, 1 when unset; fails fast when invalid."""
    text = os.environ.get(REPLICAS_ENV, "").strip() or "1"
    if not text.isdigit() or not 1 <= int(text) <= MAX_REPLICAS:
        raise ValueError(f"{REPLICAS_ENV} must be a whole number from 1 to {MAX_REPLICAS}, not {text!r}")
    return int(text)


def stream_config(spec: StreamSpec, replicas: int = 1) -> api.StreamConfig:
    """The server-side configuration of a stream this build defines, at the deployment's replicas."""
    return api.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        storage=api.StorageType(spec.storage),
        max_age=spec.max_age_s or None,
        duplicate_window=spec.duplicate_window_s,
        max_msg_size=spec.max_msg_size,
        num_replicas=replicas,
    )


def scaled_up(have: api.StreamConfig, replicas: int) -> api.StreamConfig | None:
    """`have` raised to `replicas`, or None when it already has as many or more."""
    if (have.num_replicas or 1) >= replicas:
        return None
    return have.evolve(num_replicas=replicas)


def check_drift(spec: StreamSpec, have: api.StreamConfig) -> None:
    """Raise `StreamDriftError` when an existing stream differs from what this build defines."""
    want = stream_config(spec)
    diffs = []
    if sorted(have.subjects or []) != sorted(want.subjects or []):
        diffs.append(f"subjects {have.subjects} != {want.subjects}")
    if have.storage != want.storage:
        diffs.append(f"storage {have.storage} != {want.storage}")
    if abs((have.duplicate_window or 0) - (want.duplicate_window or 0)) > 1e-3:
        diffs.append(f"duplicate_window {have.duplicate_window} != {want.duplicate_window}")
    if abs((have.max_age or 0) - (want.max_age or 0)) > 1e-3:
        diffs.append(f"max_age {have.max_age} != {want.max_age}")
    if diffs:
        raise StreamDriftError(f"stream {spec.name} differs from this build: " + "; ".join(diffs))

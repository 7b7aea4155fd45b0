"""Stream configuration as this build defines it, and the check that a server's streams still match."""

from __future__ import annotations

from nats.js import api

from harnessrl.shared.bus.base import StreamDriftError
from harnessrl.shared.subjects import StreamSpec


def stream_config(spec: StreamSpec) -> api.StreamConfig:
    """The server-side configuration of a stream this build defines."""
    return api.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        storage=api.StorageType(spec.storage),
        max_age=spec.max_age_s or None,
        duplicate_window=spec.duplicate_window_s,
        max_msg_size=spec.max_msg_size,
    )


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

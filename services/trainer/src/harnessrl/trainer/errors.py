"""The trainer's errors: one root, and the type of a handler's error decides redelivery."""

from __future__ import annotations

from harnessrl.shared.bus import TransientError


class TrainerError(Exception):
    """Root of every error the trainer raises on purpose."""


class RolloutNotSettled(TrainerError, TransientError):
    """A rollout no checkpoint covers yet: the bus redelivers it after `delay` seconds.

    Not a failure: it is how the trainer holds a rollout unacknowledged until the step that
    trains it (or the record that drops it) is on disk (see `service.py`).
    """


class ReplicaError(TrainerError):
    """A replica refused or failed an admin call; carries the status and body."""


class WeightSyncError(TrainerError):
    """A replica did not take the new weights (probe mismatch) or refused the update."""

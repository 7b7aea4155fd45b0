"""The reward service's errors: one root, and the type decides what happens to the event.

Most errors become a verdict (an `invalid-artifact` score, an `infra-error` failure) and the event
is acknowledged. `BusUnavailableError` is the exception: the bus could not be read or written, so
the event is redelivered later (a `TransientError`) instead of being answered now.
"""

from __future__ import annotations

from harnessrl.shared.bus import TransientError


class RewardError(Exception):
    """Root of every error the reward service raises on purpose."""


class UnknownGraderError(RewardError, LookupError):
    """No installed grader has that name, or what is registered is not a grader."""


class ArtifactUnavailableError(RewardError):
    """The artifact is gone or corrupted: the episode fails as infra."""


class BusUnavailableError(RewardError, TransientError):
    """The results could not be published or the artifact store read: grade again later."""

    def __init__(self, message: str = "", *, delay: float = 2.0) -> None:
        super().__init__(message, delay=delay)

"""The controller's error root.

Every error the controller raises on purpose derives from `ControllerError`: a refused control
request (its message goes back to the caller), an unreadable task file, a failed launch (an infra
failure of the episode), a record another controller changed. Errors a feed handler raises to have
its message redelivered also derive from the bus's `TransientError` (see `lifecycle.py`); this
module stays free of the bus so the `harnessrl` command imports it cheaply.
"""

from __future__ import annotations


class ControllerError(Exception):
    """Root of every error the controller raises on purpose."""


class RequestRefusedError(ControllerError):
    """A control request the controller refuses; the message goes back to the caller."""


class TaskFileError(ControllerError):
    """A task row is malformed; the message names the file and line (or row)."""


class DatasetError(TaskFileError):
    """A dataset cannot be read as asked (format, split, flavour); the message names file and field."""

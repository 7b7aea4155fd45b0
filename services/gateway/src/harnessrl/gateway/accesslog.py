"""The access log: one structlog JSON line per request, never prompt contents, written in batches.

A line per request printed and flushed on its own costs a write system call on the hot path; here
lines collect in memory and go out together at most `FLUSH_S` later (or once `MAX_LINES` are
waiting, and at shutdown), as a busy web server's access log does.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import msgspec
import structlog

FLUSH_S = 0.2
MAX_LINES = 512
_json = msgspec.json.Encoder(enc_hook=str)


def _render(event: dict[str, Any], **_: Any) -> str:
    return _json.encode(event).decode()


class _Lines:
    """A structlog logger that keeps rendered lines until `flush`."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    def msg(self, message: str) -> None:
        """Keep one line; schedule (or do) the write."""
        self.lines.append(message)
        if len(self.lines) >= MAX_LINES:
            self.flush()
        elif self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
            except RuntimeError:  # no event loop: write now
                self.flush()

    info = msg

    def flush(self) -> None:
        """Write every waiting line in one call."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.lines:
            text = "\n".join(self.lines) + "\n"
            self.lines.clear()
            sys.stderr.write(text)
            sys.stderr.flush()


class AccessLog:
    """`request(...)` fields as one JSON line (`event`, `level`, `timestamp` like every log)."""

    def __init__(self, level: str = "INFO") -> None:
        self._lines = _Lines()
        self._log: structlog.typing.FilteringBoundLogger = structlog.wrap_logger(
            self._lines,
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.JSONRenderer(serializer=_render),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
            cache_logger_on_first_use=True,
        )

    def request(self, **fields: Any) -> None:
        """Log one answered request at info level."""
        self._log.info("request.served", **fields)

    def flush(self) -> None:
        """Write what is waiting (at shutdown)."""
        self._lines.flush()

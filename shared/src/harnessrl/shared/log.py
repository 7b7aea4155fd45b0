"""structlog configured once per process: JSON for services, console for the CLI."""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog

_configured = False


# HTTP clients that log every request at info level (the demo's held-out evaluation alone makes
# thousands); their warnings and errors still show.
_PER_REQUEST_LOGGERS = ("httpx", "httpx2", "httpcore", "openai", "anthropic")


class _CurrentStderr:
    """`sys.stderr` as it is at each write, not as it was when logging was configured.

    A process that swaps stderr later (pytest's capture, a redirect) keeps getting its logs, and
    a stream closed since is never written to.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(
    style: Literal["json", "console"] = "json",
    level: str = "INFO",
    *,
    force: bool = False,
    stream: TextIO | None = None,
) -> None:
    """Set up structlog and stdlib logging to `stream` (stderr); later calls are no-ops unless `force`."""
    global _configured  # noqa: PLW0603 - process-wide logging is configured exactly once
    if _configured and not force:
        return
    out: TextIO = stream or _CurrentStderr()  # type: ignore[assignment]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if style == "json"
        else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=level.upper(), stream=out, format="%(name)s %(message)s", force=force)
    threshold = logging.getLevelName(level.upper())
    for name in _PER_REQUEST_LOGGERS:  # shown when debugging
        logging.getLogger(name).setLevel(
            threshold if threshold <= logging.DEBUG else max(threshold, logging.WARNING)
        )
    _configured = True


def get_logger(name: str, **context: object) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to `name` and optional context (run, episode, span).

    The logger stays lazy: module-level loggers created before `configure_logging` still follow it.
    """
    return structlog.get_logger(name, **context)  # type: ignore[no-any-return]

"""Running a service as a process: the one start-up shape and stop-and-signal loop of every service.

`service_main` is the body of each service's `app.run` (settings -> logging -> serve, with the same
exit codes everywhere); `run_until_signalled` is the loop inside `serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from harnessrl.shared.bus.base import BusError
from harnessrl.shared.log import configure_logging, get_logger
from harnessrl.shared.settings import SettingsError

_log = get_logger(__name__)


class ServiceSettings(Protocol):
    """What `service_main` reads of every service's settings."""

    @property
    def log_format(self) -> Literal["json", "console"]:
        """How the service logs: JSON lines, or key-value for a person."""

    @property
    def log_level(self) -> str:
        """The lowest level logged (stdlib names)."""


S = TypeVar("S", bound=ServiceSettings)


def service_main(service: str, load: Callable[[], S], serve: Callable[[S], None]) -> int:
    """Load settings, configure logging, `serve` until stopped; the process's exit code.

    0 after a clean stop; 2 when the settings are invalid (one line on stderr naming the service and
    the setting); 1 when the bus fails for good (logged as `bus.failed`). Any other error propagates.
    """
    try:
        settings = load()
    except SettingsError as exc:
        sys.stderr.write(f"harnessrl {service}: {exc}\n")
        return 2
    configure_logging(settings.log_format, settings.log_level, force=True)
    try:
        serve(settings)
    except BusError as exc:
        _log.error("bus.failed", service=service, error=str(exc))
        return 1
    return 0


class Service(Protocol):
    """What a process runs: started once, stopped once (stop also runs after a failed start)."""

    async def start(self) -> None:
        """Begin consuming and serving."""

    async def stop(self) -> None:
        """Finish what is in flight and release everything."""


async def run_until_signalled(
    service: Service, *, finished: Awaitable[None] | None = None, stop: asyncio.Event | None = None
) -> None:
    """Start `service`, wait for SIGTERM/SIGINT, `stop`, or `finished` to end, then stop it.

    An exception raised by `finished` propagates after the service has been stopped.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(stop.wait())
    done = asyncio.ensure_future(finished) if finished is not None else None
    try:
        await service.start()
        await asyncio.wait({waiter, *([done] if done else [])}, return_when=asyncio.FIRST_COMPLETED)
        if done is not None and done.done():
            done.result()
    finally:
        waiter.cancel()
        if done is not None and not done.done():
            done.cancel()
        await service.stop()


def signal_group(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send `sig` to the process group led by `pid`, if it still exists.

    Harnesses, tests and vLLM start children of their own; signalling the group reaches every one
    (a group outlives its leader while a child still runs).
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of `/proc/<pid>/stat` after the command name (state, ppid, pgrp, ...); None when gone.

    The command name (field 2) may hold spaces and parentheses: everything after its last ')'
    splits cleanly, so index 0 is the state (field 3) and index 19 the start time (field 22).
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()

"""Supervised local processes: the embedded default runs every service this way.

Each process runs in its own process group with its output in a log file, and gets SIGTERM if the
supervising process dies (`harnessrl.stack.spawn`). A process that exits unexpectedly is reported
and restarted with a growing back-off (up to `max_restarts`); stopping sends SIGTERM to every group,
then SIGKILL to what is left, so no grandchild survives.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from pathlib import Path

import msgspec

from harnessrl.shared.log import get_logger
from harnessrl.shared.process import signal_group
from harnessrl.stack.spawn import spawn

log = get_logger(__name__)


class ProcessSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to run and how to tell that it is ready."""

    name: str
    argv: list[str]
    env: dict[str, str] = msgspec.field(default_factory=dict)
    ready_url: str | None = None
    ready_timeout_s: float = 60.0
    max_restarts: int = 5
    url: str = ""


class ProcessStatus(msgspec.Struct, kw_only=True):
    """One line of `harnessrl status`."""

    name: str
    pid: int
    url: str
    log: str
    restarts: int = 0


class SupervisorError(RuntimeError):
    """A supervised process failed to start or became ready too late."""


class _Running:
    def __init__(self, spec: ProcessSpec, log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.next_restart = 0.0

    def start(self) -> None:
        env = {**os.environ, **self.spec.env}
        with self.log_path.open("ab") as out:
            self.process = spawn(
                self.spec.argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 1500) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


def url_ready(url: str) -> bool:
    """Whether `url` answers HTTP 2xx right now."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 - our own loopback URL
            return 200 <= int(response.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Supervisor:
    """Starts processes in order, waits for readiness, restarts crashes, stops everything."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.logs = home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._running: dict[str, _Running] = {}

    def start(self, spec: ProcessSpec) -> None:
        """Start one process and block until it is ready (or raise with its log tail)."""
        running = _Running(spec, self.logs / f"{spec.name}.log")
        self._running[spec.name] = running
        running.start()
        log.info("process.started", name=spec.name, pid=running.process.pid if running.process else 0)
        self._wait_ready(running)
        self._write_state()

    def _wait_ready(self, running: _Running) -> None:
        url = running.spec.ready_url
        deadline = time.monotonic() + running.spec.ready_timeout_s
        while url is not None and not url_ready(url):
            if not running.alive():
                raise SupervisorError(f"{running.spec.name} exited during start:\n{running.log_tail()}")
            if time.monotonic() > deadline:
                raise SupervisorError(f"{running.spec.name} not ready at {url}:\n{running.log_tail()}")
            time.sleep(0.2)

    def check(self, on_crash: Callable[[str, str], None] | None = None) -> None:
        """Restart crashed processes (with back-off); give up after `max_restarts`."""
        now = time.monotonic()
        for running in self._running.values():
            if running.alive() or now < running.next_restart:
                continue
            code = running.process.returncode if running.process else None
            tail = running.log_tail(500)
            log.warning("process.crashed", name=running.spec.name, code=code)
            if on_crash is not None:
                on_crash(running.spec.name, tail)
            if running.restarts >= running.spec.max_restarts:
                raise SupervisorError(f"{running.spec.name} keeps crashing (exit {code}):\n{tail}")
            running.restarts += 1
            running.next_restart = now + min(2.0**running.restarts, 30.0)
            running.start()
            self._write_state()

    def stop(self, names: Collection[str] | None = None, grace_s: float = 10.0) -> None:
        """SIGTERM the named process groups (default: all, reverse start order), then SIGKILL stragglers."""
        order = [r for r in reversed(self._running.values()) if names is None or r.spec.name in names]
        for running in order:
            _signal_group(running, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for running in order:
            while running.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            _signal_group(running, signal.SIGKILL)
            if running.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    running.process.wait(timeout=5)
            del self._running[running.spec.name]
        if self._running:
            self._write_state()
        else:
            (self.home / "up.json").unlink(missing_ok=True)

    def statuses(self) -> list[ProcessStatus]:
        """What runs now."""
        return [
            ProcessStatus(
                name=r.spec.name,
                pid=r.process.pid if r.process else 0,
                url=r.spec.url,
                log=str(r.log_path),
                restarts=r.restarts,
            )
            for r in self._running.values()
        ]

    def _write_state(self) -> None:
        state = [msgspec.to_builtins(s) for s in self.statuses()]
        (self.home / "up.json").write_text(json.dumps(state, indent=2))


def _signal_group(running: _Running, sig: signal.Signals) -> None:
    # The group outlives its leader when a child (e.g. vLLM's engine) is still running.
    if running.process is None:
        return
    signal_group(running.process.pid, sig)


def read_state(home: Path) -> list[ProcessStatus]:
    """The processes a running `harnessrl up` recorded (empty when none)."""
    path = home / "up.json"
    if not path.exists():
        return []
    return msgspec.json.decode(path.read_bytes(), type=list[ProcessStatus])


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

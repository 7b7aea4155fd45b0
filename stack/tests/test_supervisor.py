"""Supervised processes: readiness, crash restart, and a stop that leaves no process behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from harnessrl.shared.net import free_port
from harnessrl.stack.supervisor import ProcessSpec, Supervisor, SupervisorError, pid_alive, read_state

SERVER = """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a grandchild
port = int(sys.argv[1])
http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_start_ready_restart_and_clean_stop(tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    sup = Supervisor(tmp_path / "home")
    sup.start(
        ProcessSpec(
            name="web",
            argv=[sys.executable, str(script), str(port)],
            ready_url=f"http://127.0.0.1:{port}/",
            max_restarts=2,
        )
    )
    [state] = read_state(tmp_path / "home")
    first_pid = state.pid
    assert pid_alive(first_pid)

    os.killpg(first_pid, signal.SIGKILL)
    crashes: list[str] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        sup.check(on_crash=lambda name, _tail: crashes.append(name))
        statuses = sup.statuses()
        if statuses[0].pid != first_pid and pid_alive(statuses[0].pid):
            break
        time.sleep(0.1)
    assert crashes == ["web"]
    second_pid = sup.statuses()[0].pid
    assert second_pid != first_pid and pid_alive(second_pid)

    sup.stop(grace_s=5)
    assert not pid_alive(second_pid)
    with pytest.raises(ProcessLookupError):  # the grandchild went with its group
        os.killpg(second_pid, 0)
    assert read_state(tmp_path / "home") == []


def test_stopping_named_processes_leaves_the_others_running(tmp_path: Path) -> None:
    """The local stack stops its controller before the rest: `stop(names)` stops only those."""
    sup = Supervisor(tmp_path / "home")
    for name in ("first", "second"):
        sup.start(ProcessSpec(name=name, argv=[sys.executable, "-c", "import time; time.sleep(60)"]))
    first, second = (status.pid for status in sup.statuses())
    sup.stop(["second"], grace_s=5)
    assert pid_alive(first) and not pid_alive(second)
    assert [state.name for state in read_state(tmp_path / "home")] == ["first"]
    sup.stop(grace_s=5)
    assert not pid_alive(first)
    assert read_state(tmp_path / "home") == []


def test_process_that_dies_during_start_reports_its_log(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    argv = [sys.executable, "-c", "import sys; print('boom: bad config'); sys.exit(3)"]
    with pytest.raises(SupervisorError, match="boom: bad config"):
        sup.start(ProcessSpec(name="bad", argv=argv, ready_url=f"http://127.0.0.1:{free_port()}/"))
    sup.stop()

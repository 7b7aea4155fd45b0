"""`harnessrl train` refuses bad input with a clear message and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harnessrl.shared.demo import harness as demo_harness
from harnessrl.shared.demo.tasks import task_spec, write_tasks


def harnessrl(*args: str, home: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cli = Path(sys.executable).parent / "harnessrl"
    argv = [str(cli), "train", *args, "--home", str(home)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env)


def orphans(home: Path) -> list[str]:
    """Processes still running that belong to this state folder."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            env = proc.info["environ"] or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.pid != os.getpid() and (str(home) in cmdline or env.get("HRL_HOME") == str(home)):
            found.append(cmdline)
    return found


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    write_tasks(tmp_path / "tasks.jsonl", [task_spec(12, 34)])
    spec = tmp_path / "run.toml"
    spec.write_text(
        'run = "cli-test"\ntasks = "tasks.jsonl"\nmax_steps = 1\n[launcher]\ncommand = ["true"]\n'
    )
    return spec


def test_bad_spec_names_the_field(tmp_path: Path) -> None:
    write_tasks(tmp_path / "tasks.jsonl", [task_spec(12, 34)])
    bad = tmp_path / "bad.toml"
    bad.write_text('run = "x"\ntasks = "tasks.jsonl"\ngroup_sise = 4\n[launcher]\ncommand = ["true"]\n')
    done = harnessrl(str(bad), home=tmp_path / "home")
    assert done.returncode == 2
    assert "group_sise" in done.stderr and "Traceback" not in done.stderr
    assert orphans(tmp_path / "home") == []


def test_missing_model_path(tmp_path: Path, spec_file: Path) -> None:
    done = harnessrl(str(spec_file), "--model", str(tmp_path / "nope"), home=tmp_path / "home")
    assert done.returncode == 1
    assert "model path" in done.stderr and "Traceback" not in done.stderr
    assert orphans(tmp_path / "home") == []


def test_port_in_use(tmp_path: Path, spec_file: Path, tiny_model: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = harnessrl(
            str(spec_file), "--model", str(tiny_model), "--gateway-port", str(port), home=tmp_path / "home"
        )
    assert done.returncode == 1
    assert f"gateway port {port} is already in use" in done.stderr and "Traceback" not in done.stderr
    assert orphans(tmp_path / "home") == []


def test_nats_server_failing_to_start(tmp_path: Path, spec_file: Path, tiny_model: Path) -> None:
    broken = tmp_path / "nats-server"
    broken.write_text(
        '#!/bin/sh\n[ "$1" = "--version" ] && echo "nats-server: v2.15.1" && exit 0\n'
        'echo "fatal: JetStream store is corrupt" >&2; exit 1\n'
    )
    broken.chmod(0o755)
    env = {**os.environ, "HARNESSRL_NATS_SERVER": str(broken)}
    done = harnessrl(str(spec_file), "--model", str(tiny_model), home=tmp_path / "home", env=env)
    assert done.returncode == 1
    assert "nats-server exited" in done.stderr and "Traceback" not in done.stderr
    assert orphans(tmp_path / "home") == []


def test_up_status_and_ctrl_c_leave_nothing_behind(tmp_path: Path) -> None:
    home = tmp_path / "home"
    cli = str(Path(sys.executable).parent / "harnessrl")
    up = subprocess.Popen(
        [cli, "up", "--home", str(home)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        status = None
        for _ in range(240):
            status = subprocess.run(
                [cli, "status", "--home", str(home)], capture_output=True, text=True, check=False
            )
            if status.returncode == 0 and all(
                name in status.stdout for name in ("gateway", "reward", "controller")
            ):
                break
            time.sleep(0.5)
        assert status is not None and status.returncode == 0, status
        assert "NO" not in status.stdout, status.stdout  # every recorded process is alive
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0, up.stderr[-2000:]
    assert orphans(home) == []


def test_ctrl_c_leaves_a_resumable_run(tmp_path: Path, tiny_model: Path) -> None:
    write_tasks(tmp_path / "tasks.jsonl", [task_spec(a, 21) for a in range(10, 22)])
    harness = Path(demo_harness.__file__)
    spec = tmp_path / "run.toml"
    spec.write_text(
        'run = "resume"\ntasks = "tasks.jsonl"\ngroup_size = 2\nbatch_tasks = 2\nmax_steps = 3\n'
        'mode = "sync"\n'
        f'staleness = 0\n[launcher]\ncommand = ["{sys.executable}", "{harness}"]\npreload = ["openai"]\n'
    )
    home = tmp_path / "home"
    cli = str(Path(sys.executable).parent / "harnessrl")
    argv = [cli, "train", str(spec), "--model", str(tiny_model), "--home", str(home)]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = home / "runs" / "resume" / "checkpoints" / "resume"
    for _ in range(600):
        if (checkpoints / "latest").exists():
            break
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)
    first.wait(timeout=90)
    assert orphans(home) == []
    second = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming" in second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary == {"run": "resume", "steps": 3, "version": 3}
    assert orphans(home) == []

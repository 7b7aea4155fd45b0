"""`harnessrl train` refuses bad input with a clear message and leaves no process behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from harnessrl.shared.demo.tasks import task_spec, write_tasks


def harnessrl(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    cli = Path(sys.executable).parent / "harnessrl"
    return subprocess.run(
        [str(cli), "train", *args, "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


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
    home = tmp_path / "home"
    home.mkdir()
    (home / "nats").write_text("a file where the JetStream store should be")
    done = harnessrl(str(spec_file), "--model", str(tiny_model), home=home)
    assert done.returncode == 1
    assert "nats-server" in done.stderr and "Traceback" not in done.stderr
    assert orphans(home) == []

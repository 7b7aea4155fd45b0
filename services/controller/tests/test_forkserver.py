"""The local launcher's fork server: preloaded Python harnesses, plain commands, deadlines."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import msgspec
import pytest

from harnessrl.controller.launchers.local import LocalLauncher
from harnessrl.testkit.exits import ExitRecorder, launch_request

HARNESS = """
import os, sys
print("preloaded" if "json.tool" in sys.modules else "cold", "group", os.getpgid(0))
key, secret = os.environ["HARNESSRL_EPISODE_KEY"], os.environ.get("HRL_CONTROLLER_KEY_SECRET", "none")
print("key", key, "secret", secret)
open(os.path.join(os.environ["HARNESSRL_WORKDIR"], "answer.txt"), "w").write(sys.argv[1])
sys.exit(int(sys.argv[2]))
"""


async def forking_launcher(tmp_path: Path, exits: ExitRecorder) -> LocalLauncher:
    launcher = LocalLauncher("r1", tmp_path, kill_grace_s=0.5, preload=["json.tool"])
    await launcher.start(exits)
    return launcher


async def test_python_harness_runs_in_a_preloaded_fork(
    tmp_path: Path, exits: type[ExitRecorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HRL_CONTROLLER_KEY_SECRET", "do-not-leak")
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    seen = exits()
    launcher = await forking_launcher(tmp_path, seen)
    await launcher.launch(launch_request("e1", [sys.executable, str(script), "42", "3"]))
    status = await seen.wait("e1")
    assert (status.outcome, status.exit_code) == ("exited", 3)
    folder = launcher.episode_dir("e1")
    out = (folder / "stdout.log").read_text()
    pid = json.loads((folder / "proc.json").read_text())["pid"]
    assert f"preloaded group {pid}" in out  # imported once by the server; the episode's own group
    assert "key hrl_secret-key secret none" in out
    assert (folder / "work" / "answer.txt").read_text() == "42"
    assert json.loads((folder / "exit.json").read_text()) == {"exit_code": 3}
    await launcher.close()


async def test_plain_command_and_crash_through_the_fork_server(
    tmp_path: Path, exits: type[ExitRecorder]
) -> None:
    crash = tmp_path / "crash.py"
    crash.write_text("raise RuntimeError('harness bug')\n")
    seen = exits()
    launcher = await forking_launcher(tmp_path, seen)
    await launcher.launch(launch_request("e2", ["sh", "-c", "echo oops >&2; exit 4"]))
    await launcher.launch(launch_request("e3", [sys.executable, str(crash)]))
    assert (await seen.wait("e2")).exit_code == 4
    assert "oops" in (launcher.episode_dir("e2") / "stderr.log").read_text()
    assert (await seen.wait("e3")).exit_code == 1
    assert "harness bug" in (launcher.episode_dir("e3") / "stderr.log").read_text()
    await launcher.close()


async def test_deadline_stops_a_forked_harness_that_ignores_sigterm(
    tmp_path: Path, exits: type[ExitRecorder]
) -> None:
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    )
    seen = exits()
    launcher = await forking_launcher(tmp_path, seen)
    request = launch_request("e4", [sys.executable, str(stubborn)])
    await launcher.launch(msgspec.structs.replace(request, timeout_s=1.0))
    status = await seen.wait("e4")
    assert status.outcome == "timeout"
    pid = json.loads((launcher.episode_dir("e4") / "proc.json").read_text())["pid"]
    still_there = True
    for _ in range(100):  # SIGKILLed processes vanish once their parent (or init) reaps them
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            still_there = False
            break
        await asyncio.sleep(0.05)
    assert not still_there
    await launcher.close()

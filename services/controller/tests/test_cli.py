"""The user commands end to end against a controller process: clear errors, never tracebacks."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

SECRET = "cli-secret"


async def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "harnessrl.controller.cli",
        *args,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    return process.returncode or 0, out.decode(), err.decode()


def spec_file(tmp_path: Path, run: str, launcher: str) -> Path:
    (tmp_path / "tasks.jsonl").write_text(
        json.dumps({"task_id": "add", "prompt": "2+2?", "answer": "4"}) + "\n"
    )
    path = tmp_path / f"{run}.toml"
    path.write_text(
        f'run = "{run}"\ntasks = "tasks.jsonl"\ngroup_size = 1\nbatch_tasks = 1\nmax_steps = 1\n{launcher}'
    )
    return path


@pytest.fixture
async def controller(nats_server: Any, tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    runs = [f"cli{n}-{os.urandom(3).hex()}" for n in range(4)]
    env = {
        **os.environ,
        "HRL_CONTROLLER_NATS_URL": nats_server.url,
        "HRL_CONTROLLER_KEY_SECRET": SECRET,
        "HRL_CONTROLLER_STATE_DIR": str(tmp_path / "state"),
        "HRL_CONTROLLER_KUBE_API_URL": "http://127.0.0.1:9",
        "HRL_CONTROLLER_RUNS": json.dumps(runs),
        "HRL_CONTROLLER_LOG_FORMAT": "console",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "harnessrl.controller",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    async with asyncio.timeout(30):
        while (await cli("run", "status", "--nats", nats_server.url))[0] != 0:
            await asyncio.sleep(0.2)
    yield nats_server.url, runs
    process.terminate()
    assert await process.wait() == 0


async def test_bad_spec_is_one_clear_line(tmp_path: Path) -> None:
    bad = spec_file(tmp_path, "x1", 'mode = "fast"\n[launcher]\ncommand = ["true"]\n')
    code, _, err = await cli("run", "submit", str(bad), "--nats", "nats://127.0.0.1:9")
    assert code == 1 and err.startswith("error: ") and "$.mode" in err and "Traceback" not in err


async def test_unreachable_nats_is_a_clear_error(tmp_path: Path) -> None:
    good = spec_file(tmp_path, "x2", '[launcher]\ncommand = ["true"]\n')
    code, _, err = await cli("run", "submit", str(good), "--nats", "nats://127.0.0.1:9")
    assert code == 1 and "cannot connect to NATS at nats://127.0.0.1:9" in err and "Traceback" not in err


async def test_service_refuses_to_start_without_a_key_secret(tmp_path: Path) -> None:
    env = {**os.environ, "HRL_CONTROLLER_KEY_SECRET": "", "HRL_CONTROLLER_LOG_FORMAT": "console"}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "harnessrl.controller",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    err, _ = await process.communicate()
    assert process.returncode == 2 and b"HRL_CONTROLLER_KEY_SECRET is required" in err


async def test_submit_status_open_close(controller: tuple[str, list[str]], tmp_path: Path) -> None:
    nats, (run, kube_run, *_) = controller
    spec = spec_file(tmp_path, run, '[launcher]\ncommand = ["sh", "-c", "echo 4 > answer.txt"]\n')
    code, out, err = await cli("run", "submit", str(spec), "--nats", nats, "--timeout", "30")
    assert (code, out) == (0, f"run {run} submitted: 1 tasks, 1 groups of 1\n"), err
    code, out, _ = await cli("run", "status", run, "--json", "--nats", nats)
    assert code == 0 and json.loads(out)["runs"][run]["groups_total"] == 1
    code, out, _ = await cli("episode", "open", "--run", run, "--nats", nats)
    assert code == 0 and "export OPENAI_API_KEY=hrl_" in out
    key = next(
        line.split("=", 1)[1] for line in out.splitlines() if line.startswith("export HARNESSRL_EPISODE_KEY")
    )
    answer = tmp_path / "answer.txt"
    answer.write_text("4\n")
    code, out, err = await cli("episode", "close", "--key", key, "--artifact", str(answer), "--nats", nats)
    assert code == 0 and "closed: exited" in out, err
    code, _, err = await cli("episode", "close", "--key", "hrl_forged.key", "--nats", nats)
    assert code == 1 and "error: episode key refused" in err
    code, _, err = await cli("episode", "open", "--run", "missing", "--nats", nats)
    assert code == 1 and "unknown run 'missing'" in err

    kube_spec = spec_file(
        tmp_path, kube_run, '[launcher]\nkind = "kubernetes"\nimage = "h:1"\ncommand = ["true"]\n'
    )
    code, _, err = await cli("run", "submit", str(kube_spec), "--nats", nats, "--timeout", "30")
    assert (
        code == 1
        and "cannot reach the Kubernetes API at http://127.0.0.1:9" in err
        and "Traceback" not in err
    )


async def test_a_missing_script_is_refused_before_submitting(tmp_path: Path) -> None:
    spec = spec_file(tmp_path, "x3", '[launcher]\ncommand = ["python", "../nowhere/harness.py"]\n')
    code, _, err = await cli("run", "submit", str(spec), "--nats", "nats://127.0.0.1:9")
    missing = tmp_path.parent / "nowhere" / "harness.py"
    assert code == 1 and f"script ../nowhere/harness.py (resolved to {missing}) does not exist" in err


async def test_relative_paths_mean_the_spec_folder_and_a_missing_program_is_refused(
    controller: tuple[str, list[str]], tmp_path: Path
) -> None:
    nats, (*_, run, missing_run) = controller
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "harness.sh").write_text("echo 4 > answer.txt\n")
    spec = spec_file(folder, run, '[launcher]\ncommand = ["sh", "harness.sh"]\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, out, err = await cli("run", "submit", "../specs/" + spec.name, "--nats", nats, cwd=elsewhere)
    assert code == 0 and "submitted" in out, err
    async with asyncio.timeout(30):  # the harness ran (exit 0): the script was found
        while "exited=1" not in (await cli("run", "status", run, "--nats", nats))[1]:
            await asyncio.sleep(0.3)

    spec = spec_file(folder, missing_run, '[launcher]\ncommand = ["nosuch-harness-bin"]\n')
    code, _, err = await cli("run", "submit", str(spec), "--nats", nats)
    assert code == 1 and "program nosuch-harness-bin is not on the controller's PATH" in err
    code, out, _ = await cli("run", "status", "--nats", nats)
    assert "submissions refused since the controller started: 1" in out


async def test_status_says_a_run_stopped_and_why(controller: tuple[str, list[str]], tmp_path: Path) -> None:
    nats, (_, _, run, _) = controller
    spec = spec_file(tmp_path, run, '[launcher]\ncommand = ["sh", "-c", "echo boom >&2; exit 3"]\n')
    assert (await cli("run", "submit", str(spec), "--nats", nats))[0] == 0
    async with asyncio.timeout(30):
        while not (out := (await cli("run", "status", run, "--nats", nats))[1]).startswith(f"{run}: stopped"):
            await asyncio.sleep(0.3)
    assert "(agent: harness exited with 3)" in out and "boom" in out and "logs: /" in out

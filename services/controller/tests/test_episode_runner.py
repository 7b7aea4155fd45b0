"""The episode runner: runs the harness, collects the artifact, uploads it with the episode key."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.keys import sign_episode_key
from harnessrl.testkit.artifact_sink import ArtifactSink

SECRET = b"entrypoint-secret"


@pytest.fixture
async def sink(bus: NatsBus) -> AsyncIterator[ArtifactSink]:
    server = ArtifactSink(bus, SECRET)
    await server.start()
    yield server
    await server.stop()


async def run_wrapper(workdir: Path, script: str, env: dict[str, str]) -> tuple[int, Path]:
    exit_file = workdir.parent / f"exit-{os.urandom(2).hex()}.json"
    full = {**os.environ, **env, "HARNESSRL_WORKDIR": str(workdir), "HARNESSRL_EXIT_FILE": str(exit_file)}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "harnessrl.controller.episode_runner",
        "--",
        "sh",
        "-c",
        script,
        cwd=workdir,
        env=full,
    )
    return await process.wait(), exit_file


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def make_repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q")
    git(path, "config", "user.email", "t@example.com")
    git(path, "config", "user.name", "t")
    (path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "base")
    return path


async def test_swe_patch_includes_new_files_and_commits(
    bus: NatsBus, sink: ArtifactSink, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "work")
    key = sign_episode_key(SECRET, "swe-run", "ep1", 60)
    script = (
        "sed -i 's/a - b/a + b/' calc.py && git commit -qam fix && "
        "printf 'def test():\\n    assert True\\n' > test_new.py && exit 0"
    )
    env = {
        "HARNESSRL_GATEWAY_URL": sink.url,
        "HARNESSRL_EPISODE_KEY": key,
        "HARNESSRL_ARTIFACT": "patch",
        "GIT_AUTHOR_NAME": "a",
        "GIT_AUTHOR_EMAIL": "a@b",
        "GIT_COMMITTER_NAME": "a",
        "GIT_COMMITTER_EMAIL": "a@b",
    }
    code, exit_file = await run_wrapper(repo, script, env)
    assert code == 0 and json.loads(exit_file.read_text()) == {"exit_code": 0}
    patch = await bus.get_object(subjects.ARTIFACTS_BUCKET, "swe-run/ep1/patch")
    assert b"+    return a + b" in patch and b"test_new.py" in patch
    pristine = make_repo(tmp_path / "pristine")
    (tmp_path / "p.diff").write_bytes(patch)
    git(pristine, "apply", str(tmp_path / "p.diff"))
    assert "a + b" in (pristine / "calc.py").read_text() and (pristine / "test_new.py").exists()


async def test_answer_file_and_exit_code_pass_through(
    bus: NatsBus, sink: ArtifactSink, tmp_path: Path
) -> None:
    work = tmp_path / "qa"
    work.mkdir()
    key = sign_episode_key(SECRET, "qa-run", "ep2", 60)
    env = {"HARNESSRL_GATEWAY_URL": sink.url, "HARNESSRL_EPISODE_KEY": key, "HARNESSRL_ARTIFACT": "answer"}
    code, exit_file = await run_wrapper(work, "echo 42 > answer.txt; exit 7", env)
    assert code == 7 and json.loads(exit_file.read_text()) == {"exit_code": 7}
    assert await bus.get_object(subjects.ARTIFACTS_BUCKET, "qa-run/ep2/answer") == b"42\n"


async def test_a_wrong_key_uploads_nothing_but_keeps_the_exit_code(
    bus: NatsBus, sink: ArtifactSink, tmp_path: Path
) -> None:
    work = tmp_path / "bad"
    work.mkdir()
    forged = sign_episode_key(b"another-secret", "qa-run", "ep3", 60)
    env = {"HARNESSRL_GATEWAY_URL": sink.url, "HARNESSRL_EPISODE_KEY": forged, "HARNESSRL_ARTIFACT": "answer"}
    code, _ = await run_wrapper(work, "echo 1 > answer.txt", env)
    assert code == 0 and sink.received == []
    with pytest.raises(KeyError):
        await bus.get_object(subjects.ARTIFACTS_BUCKET, "qa-run/ep3/answer")

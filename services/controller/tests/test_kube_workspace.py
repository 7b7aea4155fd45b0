"""A Kubernetes SWE episode's workspace: the image's repository at its base commit, and no history.

The init container's own command (from the rendered Job) runs here on a repository that holds what
a task image may: a later commit with the fix on a branch, a tag, a stash and reflog entries.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from harnessrl.controller.launchers.base import LaunchError, LaunchRequest
from harnessrl.controller.launchers.kube_manifest import render_job
from harnessrl.shared.contracts import LauncherSpec, TaskSpec

SPEC = LauncherSpec(kind="kubernetes", command=["mini"], image="harness:1")
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True, env={**os.environ, **GIT_ENV}
    )
    return done.stdout.strip()


def request(base: str) -> LaunchRequest:
    row = {"instance_id": "i-1", "image": "registry.local/i-1:1", "base_commit": base, "workdir": "/testbed"}
    task = TaskSpec(task_id="i-1", kind="swe", prompt="fix it", grader="swebench", instance=row)
    return LaunchRequest(run="r1", episode="e1", task=task, command=["mini"], artifact_kind="patch")


@pytest.fixture
def image_repo(tmp_path: Path) -> tuple[Path, str, str]:
    """A task image's /testbed: base commit checked out, the fix reachable in four other ways."""
    repo = tmp_path / "testbed"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "lib.py").write_text("def f():\n    return 1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD")
    (repo / "lib.py").write_text("def f():\n    return 2  # THE FIX\n")
    git(repo, "commit", "-q", "-am", "fix")
    fix = git(repo, "rev-parse", "HEAD")
    git(repo, "tag", "solved")
    git(repo, "branch", "upstream")
    git(repo, "checkout", "-q", base)
    (repo / "lib.py").write_text("def f():\n    return 2  # stashed\n")
    git(repo, "stash", "-q")
    return repo, base, fix


def test_the_workspace_keeps_the_base_commit_and_nothing_else(
    image_repo: tuple[Path, str, str], tmp_path: Path
) -> None:
    repo, base, fix = image_repo
    job = render_job(request(base), SPEC, ttl_s=60, allowed_images=["*"])
    (init,) = job["spec"]["template"]["spec"]["initContainers"]
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    command = [
        str(repo) if arg == "/testbed" else str(workspace) if arg == "/workspace" else arg
        for arg in init["command"]
    ]
    subprocess.run(
        command,
        check=True,
        capture_output=True,
        env={**os.environ, **{e["name"]: e["value"] for e in init["env"]}},
    )
    assert git(workspace, "rev-parse", "HEAD") == base
    assert git(workspace, "rev-list", "--all") == base  # no branch, tag or stash reaches the fix
    assert git(workspace, "reflog", "--all") == ""
    unreachable = subprocess.run(
        ["git", "cat-file", "-e", fix], cwd=workspace, capture_output=True, check=False
    )
    assert unreachable.returncode != 0, "the fix commit is still in the workspace's object store"
    assert (
        "THE FIX"
        not in subprocess.run(
            ["grep", "-r", "THE FIX", "."], cwd=workspace, capture_output=True, text=True, check=False
        ).stdout
    )
    assert (workspace / "lib.py").read_text() == "def f():\n    return 1\n"


@pytest.mark.parametrize("base", ["--orphan=x", "main; rm -rf /", "HEAD~1", "ABCDEF1234"])
def test_a_base_commit_that_is_not_a_commit_id_fails_the_launch(base: str) -> None:
    with pytest.raises(LaunchError, match=r"base_commit .* is not a commit id"):
        render_job(request(base), SPEC, ttl_s=60, allowed_images=["*"])

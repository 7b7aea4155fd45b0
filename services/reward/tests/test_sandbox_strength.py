"""The sandbox is as strong as configured or grading refuses; no grading workspace keeps git history.

A privilege drop is made impossible on purpose: the interpreter sits in a folder only root can
enter, so `nobody` cannot start it on any machine (and without root no privilege drop exists).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.service import RewardService
from harnessrl.reward.settings import RewardSettings, SandboxLimits
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.kube import config_map, job_name, parse_pod_output
from harnessrl.reward.swe.patchfile import parse_patch
from harnessrl.reward.swe.sandbox import (
    SandboxUnavailableError,
    available_limits,
    base_environment,
    confinement,
    give_to,
    grading_uid,
    missing_isolation,
    run_sandboxed,
)
from harnessrl.reward.swe.testlog import parse_junit
from harnessrl.reward.swe.workspace import apply_patch
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import AgentExited, ArtifactRef, EpisodeFailed, TaskSpec, decode_event

# Fails the import of `calc` while the repository's history is visible to the tests.
HISTORY_PROBE = (
    "diff --git a/calc/__init__.py b/calc/__init__.py\n--- a/calc/__init__.py\n"
    "+++ b/calc/__init__.py\n@@ -1,3 +1,6 @@\n"
    ' """calc: a tokenizer and evaluator for arithmetic expressions."""\n'
    "+import os as _os\n"
    "+assert not _os.path.exists(_os.path.join(_os.path.dirname(__file__), '..', '.git')), 'history'\n"
    "+\n \n from calc.evaluator import CalcError, evaluate\n"
)


@pytest.fixture
def unreachable_python(tmp_path: Path) -> str:
    """An interpreter an unprivileged user cannot start: a script that runs this one from its folder.

    Not a link to it: `setpriv` resolves the path it executes with root's rights, so a link in a
    private folder still starts as `nobody` (and finds a system Python's pytest if there is one).
    The script's own `exec` runs as the user: this environment's folder is out of its reach.
    """
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    python = private / "python3"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o700)
    return str(python)


async def test_a_privilege_drop_that_cannot_happen_is_refused(
    tmp_path: Path, unreachable_python: str
) -> None:
    strict = SandboxLimits(timeout_s=10, isolate_network=False, drop_privileges=True)
    assert missing_isolation(strict, unreachable_python)[0].startswith("drop_privileges")
    with pytest.raises(SandboxUnavailableError, match=r"weaker than configured.*drop_privileges"):
        await run_sandboxed(
            [unreachable_python, "-c", "open('ran', 'w')"],
            cwd=tmp_path,
            log_path=tmp_path / "log",
            env=base_environment(tmp_path),
            limits=strict,
        )
    assert not (tmp_path / "ran").exists()  # nothing ran, not even unprivileged-less
    accepted = available_limits(strict, unreachable_python)
    assert accepted.drop_privileges is False  # an explicit choice, which the sandbox then honours
    run = await run_sandboxed(
        [unreachable_python, "-c", "pass"],
        cwd=tmp_path,
        log_path=tmp_path / "log",
        env=base_environment(tmp_path),
        limits=accepted,
    )
    assert run.exit_code == 0 and run.unprivileged is False


async def test_the_service_fails_a_patch_as_infra_instead_of_grading_it_weaker(
    calc_row: dict[str, Any], tinyswe_root: Path, bus: Bus, unreachable_python: str
) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    settings = RewardSettings(
        durable=f"reward-{run}", runs=run, tasks_root=str(tinyswe_root), python=unreachable_python
    )
    assert settings.drop_privileges is True  # the default asks for the privilege drop
    service = RewardService(bus, settings)
    await service.start()
    try:
        task = TaskSpec(task_id=calc_row["instance_id"], kind="swe", instance=calc_row)
        gold = calc_row["patch"].encode()
        event = AgentExited(
            run=run, episode=f"{run}-e", task=task.task_id, group="g", artifact=ArtifactRef(inline=gold),
            task_spec=task,
        )  # fmt: skip
        await bus.publish(f"hrl.episode.{run}.{run}-e.agent_exited", event, msg_id=f"{run}-e:agent_exited")
        published = []
        for _ in range(300):
            published = await bus.replay("EPISODES", f"hrl.episode.{run}.*.*")
            if len(published) > 1:
                break
            await asyncio.sleep(0.1)
    finally:
        await service.stop()
    outcome = decode_event(published[-1].data)
    assert isinstance(outcome, EpisodeFailed), outcome  # the gold patch was not scored
    assert outcome.cause == "infra" and "weaker than configured" in outcome.reason
    assert service.metrics.gradings.labels("infra-error")._value.get() == 1


def test_the_kubernetes_grading_workspace_has_no_history(
    calc_row: dict[str, Any], tinyswe_root: Path, tmp_path: Path
) -> None:
    """The pod runner on a real checkout: the gold patch with a probe that fails while `.git` exists."""
    instance = SweInstance.from_row({**calc_row, "image": "registry.local/tinyswe/calc:0.1"})
    patch = calc_row["patch"] + HISTORY_PROBE
    name = job_name(instance.instance_id, "run-1:ep-1")
    config = config_map(
        name, "grading", instance, parse_patch(patch.encode()), parse_patch(instance.test_patch.encode())
    )
    grading = tmp_path / "grading"
    grading.mkdir()
    for file, text in config["data"].items():
        (grading / file).write_text(text)
    work = tmp_path / "work"
    subprocess.run(["git", "clone", "-q", str(tinyswe_root / calc_row["repo_path"]), str(work)], check=True)
    subprocess.run(["git", "checkout", "-q", calc_row["base_commit"]], cwd=work, check=True)
    env = {**os.environ, "GRADING_DIR": str(grading), "REPO_DIR": str(work), "REPORT_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-I", str(grading / "runner.py")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "history" not in done.stdout, done.stdout[-2000:]
    statuses = parse_junit(parse_pod_output(done.stdout).junit or b"")
    assert all(statuses.get(t) == "PASSED" for t in json.loads(calc_row["FAIL_TO_PASS"])), done.stdout[-2000:]
    assert not (work / ".git").exists()
    spec = json.loads((grading / "spec.json").read_text())
    assert spec["test_files"]  # the tests really ran against the patched tree
    shutil.rmtree(work)


async def test_the_models_patch_is_applied_as_the_gradings_user_without_network(
    context: GradingContext,
) -> None:
    """`git apply` and `patch` read hostile input: they run confined, as the grading's own user."""
    assert context.limits.drop_privileges and context.limits.isolate_network, context.limits
    work = Path(tempfile.mkdtemp(prefix="hrl-grade-"))  # where gradings work: any uid may pass /tmp
    try:
        await _apply_twice(work, context)
    finally:
        shutil.rmtree(work)


async def _apply_twice(tmp_path: Path, context: GradingContext) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "lib.py").write_text("def f():\n    return 1\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "b"], cwd=repo, check=True
    )
    patch = tmp_path / "model.diff"
    patch.write_text(
        "diff --git a/lib.py b/lib.py\n--- a/lib.py\n+++ b/lib.py\n@@ -1,2 +1,2 @@\n"
        " def f():\n-    return 1\n+    return 2\n"
    )
    uid = grading_uid()
    confined = confinement(context.limits, uid)
    assert confined[:3] == ["unshare", "-n", "--"] and f"--reuid={uid}" in confined
    home = tmp_path / "home"
    home.mkdir()
    # Still root's: the grading's user can change nothing in it, so every strategy fails.
    strategy, errors = await apply_patch(repo, patch, confined, base_environment(home))
    assert strategy is None and (repo / "lib.py").read_text().endswith("return 1\n"), errors
    give_to(tmp_path, uid)
    strategy, errors = await apply_patch(repo, patch, confined, base_environment(home))
    assert strategy == "git-apply" and (repo / "lib.py").read_text().endswith("return 2\n"), errors

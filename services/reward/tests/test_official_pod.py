"""Official grading in the instance image: the bash runner a grading Job executes, run for real.

The row is tinyswe's calc bug given an eval script in the official shape (`testkit.swe_eval`: the
shape SWE-bench 5.x rows ship). The runner is run here as the pod runs it, on a copy of the
repository, and its log graded by `evalpod.grade_output`, i.e. by swebench's parser and report.
"""

import importlib
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harnessrl.reward.graders.base import Grade
from harnessrl.reward.settings import GradingRules
from harnessrl.reward.swe import evalpod, official
from harnessrl.reward.swe.container import run_flags
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.kube import config_map, grading_job, job_name
from harnessrl.reward.swe.patchfile import parse_patch
from harnessrl.testkit.swe_eval import official_row

CONFTEST_HACK = (
    "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n"
    "+++ b/conftest.py\n@@ -0,0 +1,6 @@\n+import pytest\n+\n+\n"
    "+@pytest.hookimpl(hookwrapper=True)\n+def pytest_runtest_makereport(item, call):\n"
    "+    (yield).get_result().outcome = 'passed'\n"
)


@pytest.fixture
def row(calc_row: dict[str, Any]) -> dict[str, Any]:
    with_image = {**calc_row, "image": "registry.local/tinyswe/calc:0.1"}
    return official_row(with_image, sys.executable, repo_dir='"$REPO_DIR"')


def run_official_pod(root: Path, row: dict[str, Any], patch: str, tmp_path: Path) -> tuple[str, Path]:
    """Do what the Job does: copy the image's repository (with a later commit in its history), run."""
    instance = SweInstance.from_row(row)
    name = job_name(instance.instance_id, "run-1:ep-1")
    config = config_map(
        name, "grading", instance, parse_patch(patch.encode()), parse_patch(row["test_patch"].encode())
    )
    grading = tmp_path / "grading"
    grading.mkdir(parents=True)
    for file, text in config["data"].items():
        (grading / file).write_text(text)
    work = tmp_path / "work"
    subprocess.run(["git", "clone", "-q", str(root / row["repo_path"]), str(work)], check=True)
    subprocess.run(["git", "checkout", "-q", row["base_commit"]], cwd=work, check=True)
    env = {**os.environ, "GRADING_DIR": str(grading), "REPO_DIR": str(work), "HOME": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(grading / "runner.sh")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=True,
    )
    return done.stdout.decode(), work


def grade(root: Path, row: dict[str, Any], patch: str, tmp_path: Path) -> Grade:
    log, _ = run_official_pod(root, row, patch, tmp_path)
    return evalpod.grade_output(SweInstance.from_row(row), log, GradingRules())


def test_the_gold_patch_resolves_through_swebench_parser(
    tinyswe_root: Path, row: dict[str, Any], tmp_path: Path
) -> None:
    result = grade(tinyswe_root, row, row["patch"], tmp_path)
    assert (result.outcome, result.resolved, result.reward) == ("graded", True, 1.0), result.details
    assert result.details["log_parser"] == "parse_log_pytest"
    assert result.details["patch_strategy"] == "git-apply"
    assert set(result.details["tests"].values()) == {"PASSED"}
    assert set(result.details["tests"]) == set(json.loads(row["FAIL_TO_PASS"])) | set(
        json.loads(row["PASS_TO_PASS"])
    )


def test_a_patch_that_fixes_nothing_is_graded_unresolved(
    tinyswe_root: Path, row: dict[str, Any], tmp_path: Path
) -> None:
    noop = "diff --git a/README.md b/README.md\n--- a/README.md\n+++ b/README.md\n@@ -1 +1,2 @@\n"
    first = (tinyswe_root / row["repo_path"] / "README.md").read_text().splitlines()[0]
    result = grade(tinyswe_root, row, f"{noop} {first}\n+more\n", tmp_path)
    assert (result.outcome, result.resolved, result.reward) == ("graded", False, 0.0), result.details
    assert result.details["FAIL_TO_PASS"]["failure"] == json.loads(row["FAIL_TO_PASS"])


def test_a_conftest_the_patch_adds_is_removed_before_the_tests(
    tinyswe_root: Path, row: dict[str, Any], tmp_path: Path
) -> None:
    result = grade(tinyswe_root, row, CONFTEST_HACK, tmp_path)
    assert (result.outcome, result.resolved) == ("graded", False), result.details
    assert result.details["FAIL_TO_PASS"]["failure"]


def test_an_unappliable_patch_fails_before_any_test(
    tinyswe_root: Path, row: dict[str, Any], tmp_path: Path
) -> None:
    patch = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n"
    log, _ = run_official_pod(tinyswe_root, row, patch, tmp_path)
    assert ">>>>> Start Test Output" not in log
    result = evalpod.grade_output(SweInstance.from_row(row), log, GradingRules())
    assert result.outcome == "patch-failed"


def test_history_after_the_base_commit_is_gone_before_the_eval_script_runs(
    tinyswe_root: Path, row: dict[str, Any], tmp_path: Path
) -> None:
    # The pristine repository gets a later commit on a branch and a tag (as an image's clone has).
    repo = tmp_path / "pristine"
    shutil.copytree(tinyswe_root / row["repo_path"], repo)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "checkout", "-q", "-b", "future", row["base_commit"]], check=True)
    (repo / "FIX.txt").write_text("the reference fix\n")
    subprocess.run([*git, "add", "FIX.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "fix"], check=True)
    future = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    subprocess.run([*git, "tag", "v-fixed"], check=True)
    moved = {**row, "repo_path": "pristine"}
    log, work = run_official_pod(tmp_path, moved, row["patch"], tmp_path / "run")
    assert ">>>>> Start Test Output" in log
    seen = subprocess.run(
        ["git", "-C", str(work), "cat-file", "-e", future], capture_output=True, check=False
    )
    assert seen.returncode != 0, "the later commit is still in the grading copy's object store"
    refs = subprocess.run(
        ["git", "-C", str(work), "for-each-ref"], capture_output=True, text=True, check=True
    )
    assert refs.stdout == ""


def test_a_run_that_exits_non_zero_without_a_failure_is_not_a_valid_run(row: dict[str, Any]) -> None:
    # What a patch that prints pytest's summary lines and then kills the run looks like to swebench.
    cases = json.loads(row["FAIL_TO_PASS"]) + json.loads(row["PASS_TO_PASS"])
    log = (
        ">>>>> Strategy: git-apply\n>>>>> Result: tests\n+ : '>>>>> Start Test Output'\n"
        + "".join(f"PASSED {case}\n" for case in cases)
        + "+ SWEBENCH_TEST_EXIT_CODE=2\n+ : '>>>>> End Test Output'\n>>>>> Test Exit Code: 2\n"
    )
    result = evalpod.grade_output(SweInstance.from_row(row), log, GradingRules())
    assert (result.outcome, result.reward) == ("inconsistent", 0.0)


def test_the_job_runs_the_bash_runner_in_the_instance_image(row: dict[str, Any]) -> None:
    instance = SweInstance.from_row(row)
    patch = parse_patch(CONFTEST_HACK.encode())
    config = config_map("g", "grading", instance, patch, parse_patch(row["test_patch"].encode()))
    assert set(config["data"]) == {"runner.sh", "model.diff", "protected.txt", "eval.sh"}
    assert config["data"]["protected.txt"] == "conftest.py\n"
    assert ">>>>> Test Exit Code: $SWEBENCH_TEST_EXIT_CODE" in config["data"]["eval.sh"]
    pod = grading_job("g", "grading", instance)["spec"]["template"]["spec"]
    grader = pod["containers"][0]
    assert grader["image"] == row["image"] == pod["initContainers"][0]["image"]
    assert grader["command"] == ["bash", "/grading/runner.sh"]
    assert grader["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_exit_code_edit_is_swebenchs_own(row: dict[str, Any]) -> None:
    # swebench.harness.utils imports `datasets` (in the dev environment, not the reward image).
    official.swebench()
    utils = importlib.import_module("swebench.harness.utils")
    script = row["eval_script"]
    ours = utils.parse_eval_script(official.with_test_exit_code(script))
    assert ours == utils.record_test_exit_code(utils.parse_eval_script(script))


def test_the_container_sandbox_runs_the_jobs_pod_with_its_hardening(row: dict[str, Any]) -> None:
    pod = grading_job("g", "grading", SweInstance.from_row(row))["spec"]["template"]["spec"]
    volumes = {volume["name"]: Path(f"/host/{volume['name']}") for volume in pod["volumes"]}
    flags = run_flags(pod, pod["containers"][0], volumes)
    pairs = set(itertools.pairwise(flags))
    assert {("--network", "none"), ("--user", "65534:65534"), ("--memory", str(2 * 1024**3))} <= pairs
    assert {"--read-only", "--cap-drop=ALL"} <= set(flags)
    assert ("--security-opt", "no-new-privileges") in pairs
    assert ("--mount", "type=bind,source=/host/grading,destination=/grading,ro") in pairs
    assert ("--mount", "type=bind,source=/host/work,destination=/testbed") in pairs
    assert ("--env", "REPO_DIR=/testbed") in pairs

"""Grading in the instance's own image on this machine: the reward's `container` sandbox, for real.

Two instance images in the official layout (a git checkout at the base commit at /testbed, its
environment, an eval script in the SWE-bench 5.x shape): tinyswe's calc bug, a pytest repository
graded by swebench's pytest parser, and Django's own source distribution with a bug put in,
graded by `tests/runtests.py` and swebench's django parser (`testkit.swe_images`). The SWE-bench
grader, set to the `container` sandbox, runs the grading Job's pod with podman: the copy, then the
patch and the eval script, read by swebench.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.graders.swebench import SweBenchGrader
from harnessrl.reward.swe.container import ContainerGrader
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.kube import config_map, grading_job
from harnessrl.reward.swe.patchfile import parse_patch
from harnessrl.reward.tinyswe.build import ensure_tinyswe, load_instances
from harnessrl.shared.contracts import TaskSpec
from harnessrl.testkit.images import IMAGE_BY_NAME, PODMAN_FLAGS, build_images, podman
from harnessrl.testkit.swe_eval import official_row
from harnessrl.testkit.swe_images import SOURCES, RealInstance, real_instance

pytestmark = pytest.mark.images

CONFTEST_HACK = (
    "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n"
    "+++ b/conftest.py\n@@ -0,0 +1,6 @@\n+import pytest\n+\n+\n"
    "+@pytest.hookimpl(hookwrapper=True)\n+def pytest_runtest_makereport(item, call):\n"
    "+    (yield).get_result().outcome = 'passed'\n"
)

NOTES = (
    "diff --git a/NOTES.md b/NOTES.md\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES.md\n"
    "@@ -0,0 +1 @@\n+hi\n"
)


@pytest.fixture(scope="module", params=sorted(SOURCES))
def released(request: pytest.FixtureRequest) -> RealInstance:
    """Django's and SymPy's instance (each image built once per machine, cached by input hash)."""
    build_images(["task"])
    return real_instance(request.param)


@pytest.fixture(scope="module")
def row(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The calc instance as an official row whose image holds its repository at /testbed."""
    build_images(["task"])
    root = ensure_tinyswe(sys.executable)
    calc = next(r for r in load_instances(root) if r["instance_id"] == "tinyswe__calc-0001")
    context = tmp_path_factory.mktemp("calc-image")
    repo = context / "testbed"
    subprocess.run(["git", "clone", "-q", str(root / calc["repo_path"]), str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "--detach", calc["base_commit"]], check=True)
    (context / "Containerfile").write_text(f"FROM {IMAGE_BY_NAME['task'].ref}\nCOPY testbed /testbed\n")
    ref = f"{IMAGE_BY_NAME['task'].ref.rsplit(':', 1)[0]}:calc-official"
    podman("build", *PODMAN_FLAGS, "--network", "none", "--quiet", "-t", ref, str(context))
    pristine = {k: v for k, v in calc.items() if k != "repo_path"} | {"image": ref}
    return official_row(pristine, "python3")


async def grade(row: dict[str, Any], patch: str) -> Any:
    context = GradingContext(sandbox="container", namespace="grading")
    task = TaskSpec(task_id=row["instance_id"], kind="swe", prompt="fix", grader="swebench", instance=row)
    return await SweBenchGrader(context).grade(task, patch.encode())


async def test_the_gold_patch_resolves_in_the_instance_image(row: dict[str, Any]) -> None:
    result = await grade(row, row["patch"])
    assert (result.outcome, result.resolved, result.reward) == ("graded", True, 1.0), result.details
    assert result.details["sandbox"] == "container"
    assert result.details["grading"] == "official"
    # The repository's tests ran in the image's environment, on its copy of /testbed.
    assert "rootdir: /testbed" in result.details["log_tail"]
    assert set(result.details["tests"].values()) == {"PASSED"}


@pytest.mark.parametrize("patch", ["noop", "conftest-hack"])
async def test_what_does_not_fix_the_bug_is_graded_unresolved(row: dict[str, Any], patch: str) -> None:
    text = {
        "noop": NOTES,
        "conftest-hack": CONFTEST_HACK,
    }[patch]
    result = await grade(row, text)
    assert (result.outcome, result.resolved, result.reward) == ("graded", False, 0.0), result.details
    assert result.details["FAIL_TO_PASS"]["failure"]


@pytest.mark.parametrize(
    ("patch", "resolved"), [("gold", True), ("wrong", False), ("hack", False), ("noop", False)]
)
async def test_released_repositories_are_graded_by_their_own_runner_and_swebenchs_parser(
    released: RealInstance, patch: str, resolved: bool
) -> None:
    row = released.row
    # `hack`: Django's runner (tests/ is protected: put back by the grader) and SymPy's test module
    # (put back by the grader and by the eval script) print every graded test's `ok` and exit 0.
    text = {**released.patches, "noop": NOTES}[patch]
    result = await grade(row, text)
    assert (result.outcome, result.resolved) == ("graded", resolved), result.details
    assert result.details["log_parser"] == row["log_parser"]
    assert set(result.details["tests"]) == set(row["FAIL_TO_PASS"]) | set(row["PASS_TO_PASS"])
    if resolved:
        assert set(result.details["tests"].values()) == {"PASSED"}, result.details
    else:
        assert result.details["FAIL_TO_PASS"]["failure"], result.details


async def test_the_grading_container_is_unprivileged_read_only_and_offline(
    row: dict[str, Any], tmp_path: Path
) -> None:
    # The Job's own pod, its grading container's command swapped for a probe of its confinement.
    instance = SweInstance.from_row(row)
    patch = parse_patch(row["patch"].encode())
    job = grading_job("probe", "grading", instance)
    probe = (
        "id -u; touch /usr/probe 2>/dev/null && echo root-writable; "
        "(exec 3<>/dev/tcp/10.88.0.1/53) 2>/dev/null && echo network; "
        "git -C /testbed log --oneline | wc -l; echo done"
    )
    job["spec"]["template"]["spec"]["containers"][0]["command"] = ["bash", "-c", probe]
    objects = [config_map("probe", "grading", instance, patch, parse_patch(row["test_patch"].encode())), job]
    log = await ContainerGrader().run("probe", objects, 120)
    lines = log.split()
    assert lines[0] == "65534", log
    assert "root-writable" not in lines and "network" not in lines, log
    assert lines[-1] == "done", log

"""The Kubernetes grading Job: validated manifests, hardening, and the pod runner for real.

The API round trip (create, watch, logs, delete) is test_kubernetes_roundtrip's; here the runner
script the Job executes is run locally on a tinyswe checkout and its output graded like a pod's
log, and the grader's client is pointed by `kube_api_url` at the test kit's fake API server.
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client, config

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.grading import grading_context
from harnessrl.reward.settings import read_settings
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.kube import (
    KubernetesGrader,
    config_map,
    grading_job,
    job_name,
    parse_pod_output,
)
from harnessrl.reward.swe.patchfile import parse_patch
from harnessrl.reward.swe.pipeline import resolve_output
from harnessrl.shared.settings import SettingsError
from harnessrl.testkit.fake_kube import FakeKubeServer

CONFTEST = (
    "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n"
    "+++ b/conftest.py\n@@ -0,0 +1,6 @@\n+import pytest\n+\n+\n"
    "+@pytest.hookimpl(hookwrapper=True)\n+def pytest_runtest_makereport(item, call):\n"
    "+    (yield).get_result().outcome = 'passed'\n"
)
# A few lines in the package under test that flip failed reports to passed (as in test_reward_hacks).
REPORT_FORGERY = (
    "diff --git a/calc/__init__.py b/calc/__init__.py\n--- a/calc/__init__.py\n+++ b/calc/__init__.py\n"
    "@@ -1,3 +1,8 @@\n"
    ' """calc: a tokenizer and evaluator for arithmetic expressions."""\n'
    "+import _pytest.reports as _r\n+_i = _r.TestReport.__init__\n"
    "+def _f(s, *a, **k):\n"
    "+    _i(s, *a, **k); s.outcome = 'passed' if s.outcome == 'failed' else s.outcome\n"
    "+_r.TestReport.__init__ = _f\n"
    " \n from calc.evaluator import CalcError, evaluate\n"
)


def manifests(row: dict[str, Any], patch: str) -> tuple[dict[str, Any], dict[str, Any]]:
    instance = SweInstance.from_row({**row, "image": "registry.local/tinyswe/calc:0.1"})
    name = job_name(instance.instance_id, "run-1:ep-7")
    test_patch = parse_patch(instance.test_patch.encode())
    return (
        config_map(name, "grading", instance, parse_patch(patch.encode()), test_patch),
        grading_job(name, "grading", instance, timeout_s=120),
    )


@pytest.mark.parametrize("index", [0, 1])
def test_manifests_validate_strictly(calc_row: dict[str, Any], index: int) -> None:
    kubernetes_validate.validate(manifests(calc_row, calc_row["patch"])[index], "1.33.0", strict=True)


def test_job_is_hardened(calc_row: dict[str, Any]) -> None:
    _, job = manifests(calc_row, calc_row["patch"])
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert job["metadata"]["name"] == "grade-tinyswe-calc-0001-run-1-ep-7"
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 120
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The episode pods' policy (harnessrl.shared.podpolicy), as user "nobody".
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": 65534,
        "runAsGroup": 65534,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["hostNetwork"] is False and pod["hostPID"] is False and pod["hostIPC"] is False
    # The grading sees a copy of the repository where the image has it, never the image's original
    # (whose `.git` the runner cannot delete on a read-only root): the copy is mounted over it.
    (copy,) = pod["initContainers"]
    assert copy["command"] == ["cp", "-R", "/testbed/.", "/work/"] and copy["image"] == container["image"]
    assert copy["securityContext"] == container["securityContext"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/testbed"] == "work" == {m["mountPath"]: m["name"] for m in copy["volumeMounts"]}["/work"]
    assert {v["name"]: v for v in pod["volumes"]}["work"]["emptyDir"]
    assert container["resources"]["limits"]["memory"] == "2Gi"
    assert job["spec"]["template"]["metadata"]["labels"]["harnessrl.io/network"] == "none"


def run_pod_locally(root: Path, row: dict[str, Any], patch: str, tmp_path: Path) -> str:
    """Do what the Job does: copy the image's repository, run the shipped runner on it."""
    config, _ = manifests(row, patch)
    grading = tmp_path / "grading"
    grading.mkdir()
    for name, text in config["data"].items():
        (grading / name).write_text(text)
    testbed = tmp_path / "testbed"
    subprocess.run(["git", "clone", "-q", str(root / row["repo_path"]), str(testbed)], check=True)
    subprocess.run(["git", "checkout", "-q", row["base_commit"]], cwd=testbed, check=True)
    work = tmp_path / "work"
    shutil.copytree(testbed, work)
    env = {**os.environ, "GRADING_DIR": str(grading), "REPO_DIR": str(work), "REPORT_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-I", str(grading / "runner.py")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


@pytest.mark.parametrize(
    ("patch", "outcome", "resolved"),
    [("gold", "graded", True), ("conftest-hack", "graded", False), ("report-forgery", "forgery", False)],
)
def test_pod_runner_output_grades_like_the_local_sandbox(
    tinyswe_root: Path,
    calc_row: dict[str, Any],
    context: GradingContext,
    tmp_path: Path,
    patch: str,
    outcome: str,
    resolved: bool,
) -> None:
    text = {"gold": calc_row["patch"], "conftest-hack": CONFTEST, "report-forgery": REPORT_FORGERY}[patch]
    output = parse_pod_output(run_pod_locally(tinyswe_root, calc_row, text, tmp_path))
    grade = resolve_output(SweInstance.from_row(calc_row), output, context)
    assert grade.outcome == outcome, grade.details
    assert grade.resolved is resolved
    assert set(grade.details["tests"]) == set(json.loads(calc_row["FAIL_TO_PASS"])) | set(
        json.loads(calc_row["PASS_TO_PASS"])
    )
    assert grade.details["integrity_verdict"] is True, grade.details


def test_forged_markers_in_test_output_do_not_count() -> None:
    log = (
        ">>>>> Strategy: git-apply\n>>>>> Start Test Output\n>>>>> Test Exit Code: 0\n"
        ">>>>> JUnit: AAAA\n>>>>> End Test Output\n>>>>> JUnit: \n>>>>> Test Exit Code: 1\n"
    )
    output = parse_pod_output(log)
    assert output.exit_code == 1 and output.junit is None


async def test_grading_talks_to_the_api_server_kube_api_url_names(
    calc_row: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """HRL_REWARD_KUBE_API_URL reaches the grader's client: its Job lands on that server."""
    server = FakeKubeServer()
    url = await server.start()
    try:
        monkeypatch.setenv("HRL_REWARD_KUBE_API_URL", url)
        monkeypatch.setenv("HRL_REWARD_NAMESPACE", "grading")
        grader = KubernetesGrader.connect(grading_context(read_settings(sandbox="kubernetes")))
        assert grader.namespace == "grading"
        _, job = manifests(calc_row, calc_row["patch"])
        batch = client.BatchV1Api(grader.api_client)
        await asyncio.to_thread(batch.create_namespaced_job, grader.namespace, job)
        listed = await asyncio.to_thread(batch.list_namespaced_job, grader.namespace)
        assert [j.metadata and j.metadata.name for j in listed.items] == [job["metadata"]["name"]]
    finally:
        await server.stop()


def test_without_kube_api_url_the_grader_uses_in_cluster_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a pod (no service-account environment) and no URL: no silent fallback to a kubeconfig."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("HRL_REWARD_KUBE_API_URL", raising=False)
    context = grading_context(read_settings(sandbox="kubernetes"))
    assert context.kube_api_url == ""
    with pytest.raises(config.ConfigException):
        KubernetesGrader.connect(context)


@pytest.mark.parametrize("url", ["kube.internal:6443", "ftp://kube"])
def test_a_kube_api_url_that_is_not_http_is_refused_naming_the_field(url: str) -> None:
    with pytest.raises(SettingsError, match="kube_api_url must be an http:// or https:// URL"):
        read_settings(kube_api_url=url)

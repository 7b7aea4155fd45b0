"""The rendered episode Job passes `kubernetes-validate --strict` and carries every hardening field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harnessrl.controller.launchers.kube_manifest import job_name, render_job, render_secret
from harnessrl.shared.contracts import LauncherSpec, TaskSpec
from harnessrl.testkit.exits import launch_request

SPEC = LauncherSpec(
    kind="kubernetes",
    command=["mini", "-y"],
    image="ghcr.io/example/harness:1",
    cpu="2",
    memory="4Gi",
    job_template={
        "spec": {
            "template": {
                "spec": {
                    "nodeSelector": {"pool": "episodes"},
                    # Overrides that would weaken the hardening are refused (test_launch_policy.py).
                    "tolerations": [{"key": "episodes", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{"imagePullPolicy": "Always"}],
                }
            }
        }
    },
)


def validate(tmp_path: Path, *objects: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    tool = Path(sys.executable).with_name("kubernetes-validate")
    return subprocess.run([str(tool), "--strict", str(path)], capture_output=True, text=True, check=False)


@pytest.fixture
def swe_request() -> Any:
    base = launch_request("e0001-002-03-a1", ["mini", "-y"], timeout_s=900.5)
    task = TaskSpec(
        task_id="x-1", kind="swe", prompt="fix", instance={"image": "swe/x-1:latest", "repo_path": "r"}
    )
    return type(base)(**{**{f: getattr(base, f) for f in base.__struct_fields__}, "task": task, "attempt": 1})


def test_job_and_secret_pass_strict_validation(tmp_path: Path, swe_request: Any) -> None:
    job = render_job(swe_request, SPEC, ttl_s=600)
    done = validate(tmp_path, job, render_secret(swe_request, "default"))
    assert done.returncode == 0, done.stdout + done.stderr
    broken = dict(job, spec={**job["spec"], "backofLimit": 0})
    assert validate(tmp_path, broken).returncode != 0  # the validator is really strict


def test_job_has_every_hardening_field(swe_request: Any) -> None:
    job = render_job(swe_request, SPEC, ttl_s=600)
    spec = job["spec"]
    assert job["metadata"]["name"] == job_name("r1", "e0001-002-03-a1")
    assert job["metadata"]["labels"]["harnessrl.io/episode"] == "e0001-002-03-a1"
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) == (
        0,
        901,
        600,
    )
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailJob",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    pod = spec["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] == "Never" and pod["nodeSelector"] == {"pool": "episodes"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {v["name"]: v for v in pod["volumes"]}["workspace"] == {"name": "workspace", "emptyDir": {}}
    assert [c["name"] for c in pod["initContainers"]] == ["workspace"]
    # The image's repository copied and left at the base commit alone (test_kube_workspace runs it).
    assert pod["initContainers"][0]["command"][4:] == ["/testbed", "/workspace", "HEAD"]
    for container in (*pod["initContainers"], *pod["containers"]):
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
        assert security["readOnlyRootFilesystem"] is True and security["runAsNonRoot"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert (
            container["resources"]["requests"]
            == container["resources"]["limits"]
            == {"cpu": "2", "memory": "4Gi"}
        )
        assert {m["mountPath"] for m in container["volumeMounts"]} == {"/workspace", "/tmp"}
    harness = pod["containers"][0]
    assert harness["command"][:4] == ["python", "-m", "harnessrl.controller.episode_runner", "--"]
    env = {item["name"]: item for item in harness["env"]}
    # git works in the copied repository though the workspace folder is root's.
    assert {k: env[k]["value"] for k in ("GIT_CONFIG_KEY_0", "GIT_CONFIG_VALUE_0")} == {
        "GIT_CONFIG_KEY_0": "safe.directory",
        "GIT_CONFIG_VALUE_0": "/workspace",
    }
    for name in ("HARNESSRL_EPISODE_KEY",):
        assert "value" not in env[name] and env[name]["valueFrom"]["secretKeyRef"]["key"] == name
    assert "hrl_secret-key" not in yaml.safe_dump(job)

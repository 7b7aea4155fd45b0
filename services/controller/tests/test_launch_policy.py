"""The launch policy: what a run's launcher and `job_template` may ask for, refused by field.

The attacker's-side checks through the control API are in tests/test_security.py; here the rules
themselves, the rendered Job a permitted template makes (strictly valid, hardening intact), and the
launcher factory refusing a persisted run that the policy no longer allows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from harnessrl.controller.launchers.kube_manifest import ROLE_LABEL, render_job
from harnessrl.controller.launchers.policy import (
    LaunchPolicyError,
    check_image,
    check_job_template,
    check_launcher,
)
from harnessrl.controller.service import default_launcher
from harnessrl.controller.settings import ControllerSettings
from harnessrl.shared.contracts import LauncherSpec, RunSpec, TaskSpec
from harnessrl.testkit.exits import launch_request

IMAGES = ["registry.local/harness/*", "ghcr.io/acme/mini@sha256:*"]
PERMITTED: dict[str, Any] = {
    "metadata": {"labels": {"team": "rl"}, "annotations": {"note": "nightly"}},
    "spec": {
        "template": {
            "metadata": {"labels": {"team": "rl"}},
            "spec": {
                "nodeSelector": {"pool": "episodes"},
                "tolerations": [{"key": "episodes", "operator": "Exists", "effect": "NoSchedule"}],
                "affinity": {"nodeAffinity": {}},
                "priorityClassName": "episodes",
                "runtimeClassName": "gvisor",
                "terminationGracePeriodSeconds": 5,
                "imagePullSecrets": [{"name": "registry"}],
                "containers": [
                    {
                        "image": "registry.local/harness/mini:2",
                        "imagePullPolicy": "Always",
                        "resources": {"limits": {"cpu": 2, "memory": "4Gi"}},
                    }
                ],
            },
        }
    },
}


def pod(**fields: Any) -> dict[str, Any]:
    return {"spec": {"template": {"spec": fields}}}


@pytest.mark.parametrize(
    ("template", "field"),
    [
        (pod(hostNetwork=True), "spec.template.spec.hostNetwork` is not allowed: episode pods never share"),
        (pod(hostPID=True), "hostPID"),
        (pod(hostIPC=True), "hostIPC"),
        (pod(shareProcessNamespace=True), "shareProcessNamespace"),
        (
            pod(serviceAccountName="controller"),
            "serviceAccountName` is not allowed: episode pods run without",
        ),
        (pod(serviceAccount="controller"), "serviceAccount`"),
        (pod(automountServiceAccountToken=True), "automountServiceAccountToken"),
        (pod(securityContext={"runAsUser": 0}), "spec.template.spec.securityContext"),
        (pod(volumes=[{"name": "h", "hostPath": {"path": "/"}}]), "spec.template.spec.volumes"),
        (pod(initContainers=[{"name": "x"}]), "initContainers"),
        (pod(nodeName="n1"), "nodeName"),
        (pod(dnsPolicy="None"), "dnsPolicy` is not allowed: a job_template may set only"),
        (pod(containers=[{"envFrom": [{"secretRef": {"name": "signing"}}]}]), "containers[0].envFrom"),
        (pod(containers=[{"env": [{"name": "A", "value": "b"}]}]), "containers[0].env"),
        (pod(containers=[{"securityContext": {"privileged": True}}]), "containers[0].securityContext"),
        (pod(containers=[{"volumeMounts": [{"name": "h", "mountPath": "/h"}]}]), "volumeMounts"),
        (pod(containers=[{"name": "renamed"}]), "containers[0].name"),
        (pod(containers=[{"command": ["sh"]}]), "containers[0].command"),
        (pod(containers=[{}, {"name": "sidecar"}]), "containers[1]"),
        (pod(containers=[{"image": "docker.io/evil/miner"}]), "containers[0].image"),
        (pod(containers=[{"resources": {"claims": [{"name": "gpu"}]}}]), "resources.claims"),
        (pod(containers="harness"), "must be a list"),
        ({"spec": {"template": {"metadata": {"labels": {ROLE_LABEL: "gateway"}}}}}, ROLE_LABEL),
        ({"metadata": {"labels": {"app.kubernetes.io/managed-by": "me"}}}, "managed-by"),
        ({"spec": {"backoffLimit": 3}}, "job_template.spec.backoffLimit"),
        ({"kind": "Pod"}, "job_template.kind"),
        ({"spec": "x"}, "must be a table"),
    ],
)
def test_a_template_outside_the_allow_list_is_refused_naming_the_field(template: Any, field: str) -> None:
    with pytest.raises(LaunchPolicyError) as refused:
        check_job_template(template, IMAGES)
    assert field in str(refused.value)
    assert str(refused.value).startswith("`launcher.job_template")


def test_a_permitted_template_renders_a_valid_hardened_job(tmp_path: Path) -> None:
    check_job_template(PERMITTED, IMAGES)
    spec = LauncherSpec(
        kind="kubernetes", command=["mini"], image="registry.local/harness/mini:1", job_template=PERMITTED
    )
    job = render_job(launch_request("ep-1", ["mini"]), spec, ttl_s=60, allowed_images=IMAGES)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    tool = Path(sys.executable).with_name("kubernetes-validate")
    done = subprocess.run([str(tool), "--strict", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    template = job["spec"]["template"]
    assert template["metadata"]["labels"][ROLE_LABEL] == "episode"
    assert template["metadata"]["labels"]["team"] == "rl"
    harness = template["spec"]["containers"][0]
    assert harness["image"] == "registry.local/harness/mini:2"
    assert harness["securityContext"]["privileged"] is False
    assert harness["resources"]["requests"] == harness["resources"]["limits"]
    assert template["spec"]["automountServiceAccountToken"] is False


def test_images_must_match_an_allowed_pattern() -> None:
    check_image("registry.local/harness/mini:1", IMAGES, where="launcher.image")
    check_image("ghcr.io/acme/mini@sha256:abc", IMAGES, where="launcher.image")
    check_image("anything/at:all", [], where="launcher.image")  # no list: any image
    for image in ("registry.local/harness", "registry.local/harnessX/mini:1", "ghcr.io/acme/mini:latest"):
        with pytest.raises(LaunchPolicyError, match=r"launcher\.image"):
            check_image(image, IMAGES, where="launcher.image")


def test_a_task_image_outside_the_list_is_refused_at_launch() -> None:
    task = TaskSpec(task_id="x-1", kind="swe", prompt="fix", instance={"image": "docker.io/evil/repo:1"})
    request = msgspec.structs.replace(launch_request("ep-1", ["mini"]), task=task)
    spec = LauncherSpec(kind="kubernetes", command=["mini"], image="registry.local/harness/mini:1")
    with pytest.raises(LaunchPolicyError, match="image of workspace"):
        render_job(request, spec, ttl_s=60, allowed_images=IMAGES)


def test_a_local_launcher_is_refused_in_a_cluster_only() -> None:
    local = LauncherSpec(kind="local", command=["python3", "h.py"])
    check_launcher(local, in_cluster=False, allowed_images=IMAGES)
    with pytest.raises(LaunchPolicyError, match=r'launcher\.kind = "local"'):
        check_launcher(local, in_cluster=True, allowed_images=IMAGES)


def test_a_persisted_run_the_policy_refuses_is_not_launched(tmp_path: Path) -> None:
    """A run accepted before the controller moved into a cluster: its launcher is refused again."""
    spec = RunSpec(run="old", tasks=str(tmp_path / "t.jsonl"), launcher=LauncherSpec(command=["python3"]))
    settings = ControllerSettings(key_secret="k", state_dir=str(tmp_path), in_cluster=True)
    with pytest.raises(LaunchPolicyError):
        default_launcher(spec, settings)
    kube = LauncherSpec(kind="kubernetes", command=["mini"], image="docker.io/evil/miner:1")
    with pytest.raises(LaunchPolicyError, match=r"launcher\.image"):
        default_launcher(
            msgspec.structs.replace(spec, launcher=kube),
            msgspec.structs.replace(settings, allowed_images=IMAGES),
        )

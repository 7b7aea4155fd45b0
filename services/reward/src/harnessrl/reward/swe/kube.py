"""Grading in Kubernetes: one Job per grading, from the task image, hardened like episode Jobs.

The Job runs `podrunner.py` (shipped in a ConfigMap with the patch, the test patch and the spec)
against the image's pristine repository. The pod has no service-account token, runs as a
non-root user with no capabilities, a read-only root file system (writable emptyDirs only for the
repository copy and /tmp), RuntimeDefault seccomp, resource limits, a deadline, and a label the
chart's deny-all NetworkPolicy selects. Its log carries the test output, the JUnit report and the
exit code between markers; `parse_pod_output` turns that back into what the local sandbox yields.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from importlib import resources
from typing import Any, Protocol

import msgspec

from harnessrl.reward.graders.base import Grade, GradingContext
from harnessrl.reward.swe import evalpod, podrunner
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.patchfile import InvalidPatchError, Patch, parse_patch
from harnessrl.reward.swe.pipeline import resolve_output
from harnessrl.reward.swe.workspace import CONFIG_NAMES, TEST_DIRS
from harnessrl.shared.podpolicy import GRADING_UID, git_safe_directory, harden_pod

GRADING_LABEL = "harnessrl.io/component"
_NAME = re.compile(r"[^a-z0-9-]+")


class PodOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What a grading pod reported."""

    strategy: str | None
    exit_code: int | None
    junit: bytes | None
    log: str
    result: str | None = None
    canaries: str | None = None
    verdict: bytes | None = None


def job_name(instance_id: str, episode: str) -> str:
    """A DNS-1123 name unique per episode (at most 63 characters)."""
    slug = _NAME.sub("-", f"grade-{instance_id}-{episode}".lower()).strip("-")
    return slug[:63].rstrip("-")


def grading_spec(instance: SweInstance, test_patch: Patch) -> dict[str, list[str]]:
    """The reset rules and test files the pod runner needs."""
    return {
        "config_names": sorted(CONFIG_NAMES),
        "test_dirs": sorted(TEST_DIRS),
        "extra": test_patch.paths,
        "test_files": instance.test_files(test_patch.paths),
    }


def config_map(
    name: str, namespace: str, instance: SweInstance, patch: Patch, test_patch: Patch
) -> dict[str, Any]:
    """The ConfigMap holding the runner, both patches and the spec."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": {GRADING_LABEL: "reward-grading"}},
        "data": _files(instance, patch, test_patch),
    }


def _files(instance: SweInstance, patch: Patch, test_patch: Patch) -> dict[str, str]:
    """What the grading container finds in /grading: the official runner's, or the pytest runner's."""
    if instance.official:
        return evalpod.grading_files(instance, patch, test_patch)
    package = resources.files(podrunner.__package__ or "")
    return {
        "runner.py": package.joinpath("podrunner.py").read_text(),
        "integrity.py": package.joinpath("integrity.py").read_text(),
        "model.diff": patch.text,
        "test.diff": test_patch.text,
        "spec.json": json.dumps(grading_spec(instance, test_patch)),
    }


def _containers(instance: SweInstance, cpu: str, memory: str) -> dict[str, list[dict[str, Any]]]:
    """The copy of the image's repository (init) and the grading over it, mounted where it was.

    The grading container sees the copy at the repository's own path (its environment's editable
    installs point there), and so never the image's original with its `.git`: the runner deletes
    the copy's history before any test runs.
    """
    resources = {
        "requests": {"cpu": cpu, "memory": memory},
        "limits": {"cpu": cpu, "memory": memory, "ephemeral-storage": "2Gi"},
    }
    tmp = {"name": "tmp", "mountPath": "/tmp"}  # noqa: S108 - an emptyDir
    # Not `cp -a`: the emptyDir belongs to root (the kubelet's), and setting its times as a non-root
    # user fails. The files keep their modes; git rehashes the new times.
    copy = {
        "name": "testbed",
        "image": instance.image,
        "command": ["cp", "-R", f"{instance.repo_dir}/.", "/work/"],
        "resources": resources,
        "volumeMounts": [{"name": "work", "mountPath": "/work"}, tmp],
    }
    grade = {
        "name": "grade",
        "image": instance.image,
        # The official runner is bash (a Multilingual image need not have Python).
        "command": ["bash", "/grading/runner.sh"]
        if instance.official
        else ["python3", "-I", "/grading/runner.py"],
        "env": [
            {"name": "REPO_DIR", "value": instance.repo_dir},
            {"name": "GRADING_DIR", "value": "/grading"},
            {"name": "REPORT_DIR", "value": "/tmp"},  # noqa: S108 - the pod's own emptyDir
            {"name": "HOME", "value": "/tmp"},  # noqa: S108 - eval scripts' tools may write there
            # The copy is the grading user's, the folder it is mounted on root's.
            *({"name": k, "value": v} for k, v in git_safe_directory(instance.repo_dir).items()),
        ],
        "resources": resources,
        "volumeMounts": [
            {"name": "grading", "mountPath": "/grading", "readOnly": True},
            {"name": "work", "mountPath": instance.repo_dir},
            tmp,
        ],
    }
    return {"initContainers": [copy], "containers": [grade]}


def grading_job(
    name: str,
    namespace: str,
    instance: SweInstance,
    *,
    timeout_s: float = 300.0,
    cpu: str = "1",
    memory: str = "2Gi",
) -> dict[str, Any]:
    """The hardened grading Job (pair it with `config_map` of the same name)."""
    labels = {GRADING_LABEL: "reward-grading", "harnessrl.io/network": "none"}
    pod_spec = {
        **_containers(instance, cpu, memory),
        "volumes": [
            {"name": "grading", "configMap": {"name": name, "defaultMode": 0o444}},
            {"name": "work", "emptyDir": {"sizeLimit": "1Gi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": int(timeout_s),
            "ttlSecondsAfterFinished": 300,
            "template": {"metadata": {"labels": labels}, "spec": harden_pod(pod_spec, GRADING_UID)},
        },
    }


def _marker(log: str, marker: str) -> str | None:
    for line in reversed(log.splitlines()):
        if line.startswith(f"{marker}: "):
            return line[len(marker) + 2 :].strip()
    return None


def parse_pod_output(log: str) -> PodOutput:
    """Read the runner's markers back (the last occurrence wins: test output comes before)."""
    strategy = _marker(log, podrunner.STRATEGY)
    exit_text = _marker(log, podrunner.EXIT)
    junit_text = _marker(log, podrunner.JUNIT)
    verdict_text = _marker(log, podrunner.VERDICT)
    body = log.split(podrunner.BEGIN_LOG, 1)[-1].rsplit(podrunner.END_LOG, 1)[0]
    return PodOutput(
        strategy=None if strategy in (None, "None") else strategy,
        exit_code=int(exit_text) if exit_text and exit_text.lstrip("-").isdigit() else None,
        junit=base64.b64decode(junit_text) if junit_text else None,
        log=body,
        result=_marker(log, podrunner.RESULT),
        canaries=_marker(log, podrunner.CANARIES),
        verdict=base64.b64decode(verdict_text) if verdict_text else None,
    )


class JobRunner(Protocol):
    """Runs a grading Job's pod and returns its log: in a cluster, or on this machine's engine."""

    sandbox: str
    namespace: str

    async def run(self, name: str, objects: list[dict[str, Any]], timeout_s: float) -> str:
        """Create `objects` (the ConfigMap, then the Job), wait for the pod, return its log."""
        ...


class KubernetesGrader:
    """Submits the ConfigMap and Job with the official client, waits, reads the pod log."""

    sandbox = "kubernetes"

    def __init__(self, namespace: str, api_client: Any) -> None:
        self.namespace = namespace
        self.api_client = api_client

    @classmethod
    def connect(cls, context: GradingContext) -> KubernetesGrader:
        """A grader in the context's namespace, talking to its `kube_api_url` (else in-cluster)."""
        from kubernetes import client, config

        if context.kube_api_url:
            configuration = client.Configuration()
            configuration.host = context.kube_api_url
            return cls(context.namespace, client.ApiClient(configuration))
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        return cls(context.namespace, client.ApiClient())

    async def run(self, name: str, objects: list[dict[str, Any]], timeout_s: float) -> str:
        """Create `objects`, wait for the Job to finish, return its pod's log; clean up."""
        return await asyncio.to_thread(self._run_blocking, name, objects, timeout_s)

    def _run_blocking(self, name: str, objects: list[dict[str, Any]], timeout_s: float) -> str:
        from kubernetes import client, watch

        core, batch = client.CoreV1Api(self.api_client), client.BatchV1Api(self.api_client)
        # The client serialises plain dicts as request bodies; the stubs only name the models.
        body: Any = objects[0]
        core.create_namespaced_config_map(self.namespace, body)
        try:
            body = objects[1]
            batch.create_namespaced_job(self.namespace, body)
            watcher: Any = watch.Watch()  # type: ignore[no-untyped-call]
            for event in watcher.stream(
                batch.list_namespaced_job,
                self.namespace,
                field_selector=f"metadata.name={name}",
                timeout_seconds=int(timeout_s),
            ):
                status = event["object"].status
                if status and (status.succeeded or status.failed):
                    break
            pods = core.list_namespaced_pod(self.namespace, label_selector=f"job-name={name}")
            if not pods.items:
                return ""
            pod: Any = pods.items[0]
            return str(core.read_namespaced_pod_log(pod.metadata.name, self.namespace))
        finally:
            batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background")
            core.delete_namespaced_config_map(name, self.namespace)


async def grade_with_job(
    instance: SweInstance,
    artifact: bytes,
    context: GradingContext,
    runner: JobRunner,
    episode: str,
) -> Grade:
    """Grade `artifact` in a grading Job's pod; the same checks and rules as the local sandbox."""
    try:
        patch = parse_patch(artifact, limit=context.max_artifact_bytes)
    except InvalidPatchError as exc:
        return Grade(reward=0.0, resolved=False, outcome="invalid-artifact", details={"reason": str(exc)})
    if patch.empty:
        return Grade(
            reward=0.0, resolved=False, outcome="empty-patch", details={"reason": "the patch is empty"}
        )
    test_patch = parse_patch(instance.test_patch.encode(), limit=64 * 1024 * 1024)
    name = job_name(instance.instance_id, episode)
    objects = [
        config_map(name, runner.namespace, instance, patch, test_patch),
        grading_job(name, runner.namespace, instance, timeout_s=context.limits.timeout_s),
    ]
    log = await runner.run(name, objects, context.limits.timeout_s + 60)
    if instance.official:
        return evalpod.grade_output(instance, log, context.rules, runner.sandbox)
    return resolve_output(instance, parse_pod_output(log), context, runner.sandbox)

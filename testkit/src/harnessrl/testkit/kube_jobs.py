"""The fake cluster's Job controller: a pod per Job, and hooks that end Jobs the way Kubernetes does."""

from __future__ import annotations

import base64
import copy
import os
from typing import Any

from harnessrl.testkit.kube_store import ObjectStore, timestamp

JOBS, PODS, SECRETS = "jobs", "pods", "secrets"
FAILURE_REASONS = ("DeadlineExceeded", "BackoffLimitExceeded", "PodFailurePolicy")


def admit_secret(obj: dict[str, Any]) -> dict[str, Any]:
    """Fold `stringData` into base64 `data`, as the API server does."""
    data = obj.setdefault("data", {}) or {}
    for key, value in (obj.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    obj["data"] = data
    return obj


def start_pod(store: ObjectStore, job: dict[str, Any]) -> dict[str, Any]:
    """Create the running pod of a new Job (the Job controller's first step)."""
    meta, template = job["metadata"], job["spec"]["template"]
    job_label = {"job-name": meta["name"], "batch.kubernetes.io/job-name": meta["name"]}
    containers = template["spec"].get("containers", [])
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{meta['name']}-{os.urandom(3).hex()[:5]}",
            "labels": {**(template.get("metadata", {}).get("labels") or {}), **job_label},
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}
            ],
        },
        "spec": copy.deepcopy(template["spec"]),
        "status": {
            "phase": "Running",
            "startTime": timestamp(),
            "containerStatuses": [
                {
                    "name": c["name"],
                    "ready": True,
                    "restartCount": 0,
                    "image": c.get("image", ""),
                    "imageID": "",
                    "state": {"running": {"startedAt": timestamp()}},
                }
                for c in containers
            ],
        },
    }
    store.create(PODS, meta["namespace"], pod)
    job["status"] = {"active": 1, "ready": 1, "startTime": timestamp()}
    store.modified(JOBS, job)
    return pod


def pods_of(store: ObjectStore, job: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods a Job owns."""
    return store.select(PODS, job["metadata"]["namespace"], f"job-name={job['metadata']['name']}")


def _terminate_pods(store: ObjectStore, job: dict[str, Any], phase: str, exit_code: int, reason: str) -> None:
    for pod in pods_of(store, job):
        pod["status"]["phase"] = phase
        for status in pod["status"].get("containerStatuses", []):
            status["ready"] = False
            status["state"] = {
                "terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": timestamp()}
            }
        store.modified(PODS, pod)


def _conclude(store: ObjectStore, job: dict[str, Any], kind: str, reason: str, message: str) -> None:
    now = timestamp()
    conditions = [
        {
            "type": "FailureTarget" if kind == "Failed" else "SuccessCriteriaMet",
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": now,
        }
    ]
    conditions.append(
        {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}
    )
    status = job.setdefault("status", {})
    status.update(active=0, ready=0, conditions=conditions)
    if kind == "Complete":
        status.update(succeeded=1, completionTime=now)
    else:
        status["failed"] = 1
    store.modified(JOBS, job)


def complete(store: ObjectStore, job: dict[str, Any]) -> None:
    """The harness exited 0: pod Succeeded, Job Complete."""
    _terminate_pods(store, job, "Succeeded", 0, "Completed")
    _conclude(store, job, "Complete", "CompletionsReached", "Reached expected number of succeeded pods")


def fail(store: ObjectStore, job: dict[str, Any], reason: str, exit_code: int = 1) -> None:
    """The Job failed: past its deadline, or its pod exited non-zero."""
    if reason == "DeadlineExceeded":
        _terminate_pods(store, job, "Failed", 143, "Error")
        message = "Job was active longer than specified deadline"
    else:
        _terminate_pods(store, job, "Failed", exit_code, "Error")
        message = f"Job has reached the specified backoff limit (exit code {exit_code})"
    _conclude(store, job, "Failed", reason, message)


def evict(store: ObjectStore, job: dict[str, Any]) -> None:
    """The pod was evicted (a disruption): podFailurePolicy fails the Job at once."""
    name = ""
    for pod in pods_of(store, job):
        name = pod["metadata"]["name"]
        pod["status"]["phase"] = "Failed"
        pod["status"]["reason"] = "Evicted"
        pod["status"].setdefault("conditions", []).append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "lastTransitionTime": timestamp(),
            }
        )
        store.modified(PODS, pod)
    namespace = job["metadata"]["namespace"]
    message = f"Pod {namespace}/{name} has condition DisruptionTarget matching FailJob rule at index 0"
    _conclude(store, job, "Failed", "PodFailurePolicy", message)


def oom(store: ObjectStore, job: dict[str, Any]) -> None:
    """The harness container was OOM-killed (exit 137)."""
    _terminate_pods(store, job, "Failed", 137, "OOMKilled")
    _conclude(
        store,
        job,
        "Failed",
        "PodFailurePolicy",
        "Container harness failed with exit code 137 matching FailJob rule at index 1",
    )


def image_pull_error(store: ObjectStore, job: dict[str, Any]) -> None:
    """The image cannot be pulled: the pod waits forever, the Job stays active."""
    for pod in pods_of(store, job):
        pod["status"]["phase"] = "Pending"
        for status in pod["status"].get("containerStatuses", []):
            status["ready"] = False
            status["state"] = {"waiting": {"reason": "ErrImagePull", "message": "pull access denied"}}
        store.modified(PODS, pod)

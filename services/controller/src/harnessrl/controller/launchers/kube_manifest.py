"""The per-episode Kubernetes objects: a hardened Job and the Secret holding the episode key.

Hardening the template always has, whatever a run spec's `job_template` overrides: `backoffLimit: 0`
(the controller retries, as a new attempt), `activeDeadlineSeconds`, `ttlSecondsAfterFinished`, a
`podFailurePolicy` that fails the Job at once on disruptions (so they classify as infra), a restricted
security context (non-root, no privilege escalation, all capabilities dropped, RuntimeDefault seccomp,
read-only root with emptyDir workspace and /tmp), no service account token, requests = limits, and the
episode key only through a `secretKeyRef`. The template itself must pass the allow-list of
`launchers.policy` (checked at submit and again here), and so must every image the pod runs.
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
from collections.abc import Sequence
from typing import Any

from harnessrl.controller.launchers.base import LaunchError, LaunchRequest
from harnessrl.controller.launchers.policy import check_image, check_job_template
from harnessrl.shared.contracts import LauncherSpec
from harnessrl.shared.podpolicy import EPISODE_UID, git_safe_directory, harden_pod
from harnessrl.shared.taskpaths import BaseCommitError, check_base_commit

MANAGED_BY = "harnessrl-controller"
RUN_LABEL = "harnessrl.io/run"
EPISODE_LABEL = "harnessrl.io/episode"
ROLE_LABEL = "harnessrl.io/role"
CONTAINER = "harness"
WORKSPACE = "/workspace"
# The workspace folder is root's and the repository in it the episode user's.
GIT_SAFE_WORKSPACE = git_safe_directory(WORKSPACE)
# The workspace init container: the image's repository copied in ($1 to $2) and left at the base
# commit ($3) and nothing else, as the local launcher leaves it: other refs, the reflog and every
# object they alone reached go, so the harness never sees a later commit (which could be the fix).
# Not `cp -a`: the workspace emptyDir belongs to root (the kubelet's), and setting its times as a
# non-root user fails. The files keep their modes; git rehashes the new times.
WORKSPACE_SCRIPT = """set -e
cp -R "$1/." "$2/"
cd "$2"
if [ -d .git ]; then
  git checkout -q --detach --force "$3"
  git for-each-ref --format='delete %(refname)' | git update-ref --stdin
  rm -f .git/ORIG_HEAD .git/FETCH_HEAD
  git reflog expire --expire=now --all
  git gc -q --prune=now
fi
"""


def job_name(run: str, episode: str) -> str:
    """Deterministic, DNS-safe Job name: the same episode always maps to the same Job."""
    digest = hashlib.sha256(f"{run}\x1f{episode}".encode()).hexdigest()[:12]
    stem = re.sub(r"[^a-z0-9-]", "-", run.lower())[:40].strip("-")
    return f"hrl-{stem}-{digest}"


def secret_name(run: str, episode: str) -> str:
    """Name of the Secret with the episode's key."""
    return f"{job_name(run, episode)}-key"


def labels(run: str, episode: str) -> dict[str, str]:
    """Labels that select a run's (and an episode's) objects."""
    return {"app.kubernetes.io/managed-by": MANAGED_BY, RUN_LABEL: run, EPISODE_LABEL: episode}


def render_secret(request: LaunchRequest, namespace: str) -> dict[str, Any]:
    """The Secret that carries the episode key variables."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(request.run, request.episode),
            "namespace": namespace,
            "labels": labels(request.run, request.episode),
        },
        "type": "Opaque",
        "stringData": dict(request.secret_env),
    }


def render_job(
    request: LaunchRequest, spec: LauncherSpec, *, ttl_s: int, allowed_images: Sequence[str] = ()
) -> dict[str, Any]:
    """The Job of one episode, with the run spec's `job_template` merged in, hardening re-applied.

    Raises `LaunchPolicyError` for a template outside the allow-list or an image outside
    `allowed_images` (empty: any image).
    """
    meta = labels(request.run, request.episode)
    job: dict[str, Any] = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(request.run, request.episode),
            "namespace": spec.namespace,
            "labels": {**meta, "harnessrl.io/attempt": str(request.attempt)},
        },
        "spec": {
            "template": {
                "metadata": {"labels": {**meta, ROLE_LABEL: "episode"}},
                "spec": _pod_spec(request, spec),
            }
        },
    }
    if spec.job_template:
        check_job_template(spec.job_template, allowed_images)
        job = merge(job, spec.job_template)
        job["metadata"]["labels"].update(meta)
        job["spec"]["template"]["metadata"]["labels"].update({**meta, ROLE_LABEL: "episode"})
    _enforce(job, request, ttl_s)
    pod = job["spec"]["template"]["spec"]
    for container in (*pod.get("initContainers", []), *pod["containers"]):
        check_image(str(container.get("image", "")), allowed_images, where=f"image of {container['name']}")
    return job


def _pod_spec(request: LaunchRequest, spec: LauncherSpec) -> dict[str, Any]:
    resources = {"cpu": spec.cpu, "memory": spec.memory}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "harnessrl.controller.episode_runner", "--", *request.command],
        "workingDir": WORKSPACE,
        "resources": {"requests": dict(resources), "limits": dict(resources)},
    }
    pod: dict[str, Any] = {"containers": [container]}
    instance = request.task.instance or {}
    if request.task.kind == "swe" and instance.get("image"):
        source = str(instance.get("workdir", "/testbed")).rstrip("/")
        pod["initContainers"] = [
            {
                "name": "workspace",
                "image": instance["image"],
                "command": ["sh", "-c", WORKSPACE_SCRIPT, "workspace", source, WORKSPACE, _base(instance)],
                "env": [{"name": k, "value": v} for k, v in GIT_SAFE_WORKSPACE.items()],
                "resources": {"requests": dict(resources), "limits": dict(resources)},
            }
        ]
    return pod


def _base(instance: dict[str, Any]) -> str:
    """The base commit to leave the workspace at (HEAD of the image's repository when unnamed)."""
    try:
        return check_base_commit(str(instance.get("base_commit") or "HEAD"))
    except BaseCommitError as exc:
        raise LaunchError(str(exc)) from exc


def _enforce(job: dict[str, Any], request: LaunchRequest, ttl_s: int) -> None:
    name = job["metadata"]["name"]
    spec = job["spec"]
    spec["backoffLimit"] = 0
    spec["activeDeadlineSeconds"] = max(1, math.ceil(request.timeout_s))
    spec["ttlSecondsAfterFinished"] = ttl_s
    spec["podFailurePolicy"] = {
        "rules": [
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]},
            },
        ]
    }
    pod = spec["template"]["spec"]
    pod["volumes"] = [v for v in pod.get("volumes", []) if v.get("name") not in ("workspace", "tmp")] + [
        {"name": "workspace", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [{"name": "workspace", "mountPath": WORKSPACE}, {"name": "tmp", "mountPath": "/tmp"}]  # noqa: S108 - an emptyDir, not the node's /tmp
    harden_pod(pod, EPISODE_UID)
    for container in (*pod.get("initContainers", []), *pod["containers"]):
        limits = container.setdefault("resources", {}).get("limits") or {}
        container["resources"] = {"requests": dict(limits), "limits": dict(limits)}
        container["volumeMounts"] = mounts
    harness = pod["containers"][0]
    harness["env"] = _env(request, name)


def _env(request: LaunchRequest, job: str) -> list[dict[str, Any]]:
    plain = [{"name": k, "value": v} for k, v in sorted(request.env.items())]
    plain.append({"name": "HARNESSRL_WORKDIR", "value": WORKSPACE})
    if request.task.kind == "swe":
        plain += [{"name": k, "value": v} for k, v in GIT_SAFE_WORKSPACE.items()]
    secret = secret_name(request.run, request.episode)
    keyed = [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}}
        for k in sorted(request.secret_env)
    ]
    return plain + keyed


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `override` into a copy of `base` (mappings recursively, lists item by item)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = _merge_value(out.get(key), value)
    return out


def _merge_value(current: Any, value: Any) -> Any:
    if isinstance(current, dict) and isinstance(value, dict):
        return merge(current, value)
    if isinstance(current, list) and isinstance(value, list):
        merged = [_merge_value(c, v) for c, v in zip(current, value, strict=False)]
        longer = current if len(current) > len(value) else value
        return merged + copy.deepcopy(longer[len(merged) :])
    return copy.deepcopy(value)

"""The hardened pod policy of every pod harnessrl creates for untrusted code.

Episode pods (the controller's Jobs, running a harness and the model's commands) and grading pods
(the reward service's Jobs, running a task's tests against the model's patch) both run code nobody
reviewed. Both get the same policy, defined here once: non-root, no privilege escalation, every
capability dropped, RuntimeDefault seccomp, a read-only root file system, no service account token,
no service links, none of the host's namespaces.
"""

from __future__ import annotations

from typing import Any

EPISODE_UID = 65532  # the distroless "nonroot" user: harness images run as it
GRADING_UID = 65534  # "nobody": the grading pod needs no identity at all


def git_safe_directory(path: str) -> dict[str, str]:
    """Environment that lets git work in `path`, a repository its folder's owner does not own.

    A copy the pod's user made in a root-owned emptyDir is such a repository: git refuses it as
    dubiously owned unless protected configuration, as these variables are, names it safe.
    """
    return {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": path}


def container_security(uid: int | None = None) -> dict[str, Any]:
    """A container's `securityContext` (with `runAsUser`/`runAsGroup` when `uid` is given)."""
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if uid is not None:
        context |= {"runAsUser": uid, "runAsGroup": uid}
    return context


def pod_security(uid: int) -> dict[str, Any]:
    """A pod's `securityContext`: every container runs as `uid`, volumes owned by its group."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def harden_pod(pod: dict[str, Any], uid: int) -> dict[str, Any]:
    """Apply the policy to a pod spec in place (over whatever it said) and return it."""
    pod |= {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "securityContext": pod_security(uid),
    }
    for container in (*pod.get("initContainers", []), *pod.get("containers", [])):
        container["securityContext"] = container_security(uid)
    return pod

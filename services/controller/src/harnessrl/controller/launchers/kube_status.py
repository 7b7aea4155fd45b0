"""How a Kubernetes Job (and its pods) ended, as the controller's `ExitStatus`.

Disruptions (eviction, preemption, a lost node), OOM kills and image that cannot be pulled are infra
failures: the episode is retried as a new attempt. `DeadlineExceeded` is a timeout. A harness
container that exited non-zero is the agent's own failure.
"""

from __future__ import annotations

from typing import Any

from harnessrl.controller.launchers.base import ExitStatus

IMAGE_ERRORS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
_INFRA_POD_REASONS = frozenset(
    {"Evicted", "NodeLost", "Shutdown", "Terminated", "NodeAffinity", "Preempting"}
)


def job_condition(job: dict[str, Any]) -> dict[str, Any] | None:
    """The Job's terminal condition (Complete or Failed with status True), if any."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return dict(condition)
    return None


def job_status(job: dict[str, Any], pods: list[dict[str, Any]] | None) -> ExitStatus | None:
    """None while the Job runs; otherwise how it ended (`pods` are read only for failures)."""
    condition = job_condition(job)
    if condition is None:
        return None
    if condition["type"] == "Complete":
        return ExitStatus(outcome="exited", exit_code=0)
    reason, message = condition.get("reason", ""), condition.get("message", "")
    if reason == "DeadlineExceeded":
        return ExitStatus(outcome="timeout", reason="activeDeadlineSeconds reached")
    if "DisruptionTarget" in message:
        return ExitStatus(outcome="infra", reason=f"pod disrupted: {message}")
    return pod_failure(pods or []) or ExitStatus(outcome="infra", reason=f"{reason}: {message}")


def pod_failure(pods: list[dict[str, Any]]) -> ExitStatus | None:
    """Why a Job's pod failed: an infra reason, or the harness's exit code."""
    for pod in pods:
        status = pod.get("status") or {}
        conditions = status.get("conditions") or []
        if status.get("reason") in _INFRA_POD_REASONS or any(
            c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in conditions
        ):
            return ExitStatus(outcome="infra", reason=f"pod {status.get('reason') or 'disrupted'}")
        for container in status.get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated")
            if not terminated or container.get("name") != "harness":
                continue
            if terminated.get("reason") == "OOMKilled":
                return ExitStatus(outcome="infra", exit_code=137, reason="OOMKilled")
            return ExitStatus(outcome="exited", exit_code=int(terminated.get("exitCode", 1)))
    return None


def stuck_reason(pod: dict[str, Any]) -> str | None:
    """An image error that keeps a pod from ever starting (the Job would wait forever)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    statuses += (pod.get("status") or {}).get("initContainerStatuses") or []
    for container in statuses:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_ERRORS:
            return f"{waiting['reason']}: {waiting.get('message', '')}".strip()
    return None

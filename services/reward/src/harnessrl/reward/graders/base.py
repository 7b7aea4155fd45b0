"""What every grader shares: the verdict it returns, what it may know, and its interface.

A grader is a class with `async grade(task, artifact) -> Grade`, registered under the entry point
group `harnessrl.graders` (see `harnessrl.reward.grading`). Graders import only this module and
the `swe`/`settings` modules they need, never the registry, so nothing here imports a grader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from harnessrl.reward.settings import GradingRules, SandboxLimits
from harnessrl.shared.contracts import TaskSpec
from harnessrl.shared.taskpaths import confined

Outcome = Literal[
    "graded",  # the artifact was graded; reward and resolved are meaningful
    "empty-patch",  # nothing to grade: reward 0
    "patch-failed",  # no strategy could apply the patch: reward 0
    "invalid-artifact",  # binary, huge, non-UTF-8 or path-escaping artifact: reward 0
    "inconsistent",  # the test run contradicts itself (exit code vs report vs log): reward 0
    "forgery",  # the test report was forged from inside the run (swe.forgery): reward 0
    "timeout",  # grading ran out of time: not a reward, the episode fails (reward-error)
    "infra-error",  # the sandbox or the pristine repository failed: the episode fails (infra)
    "grader-error",  # no such grader, or it crashed: the episode fails (reward-error)
]
SCORED_OUTCOMES = frozenset(
    {"graded", "empty-patch", "patch-failed", "invalid-artifact", "inconsistent", "forgery"}
)


class Grade(msgspec.Struct, frozen=True, kw_only=True):
    """A grader's verdict: the reward, whether the task is resolved, and why."""

    reward: float
    resolved: bool | None = None
    outcome: Outcome = "graded"
    details: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def scored(self) -> bool:
        """Whether the verdict is a reward (else the episode fails)."""
        return self.outcome in SCORED_OUTCOMES


class GradingContext(msgspec.Struct, frozen=True, kw_only=True):
    """What graders may need from the service's settings."""

    tasks_root: str = "."
    python: str = "python3"
    limits: SandboxLimits = msgspec.field(default_factory=SandboxLimits)
    rules: GradingRules = msgspec.field(default_factory=GradingRules)
    max_artifact_bytes: int = 2 * 1024 * 1024
    work_root: str | None = None
    # "kubernetes" grades SWE tasks in a Job from `instance["image"]`, through `kube_api_url`
    # (empty: in-cluster credentials).
    sandbox: Literal["local", "container", "kubernetes"] = "local"
    container_engine: str = "podman"
    namespace: str = "default"
    kube_api_url: str = ""

    def resolve(self, path: str) -> Path:
        """A task path under `tasks_root`; raises `TaskPathError` for one that leads out of it."""
        return confined(Path(self.tasks_root), path)


class Grader(Protocol):
    """The plug-in interface.

    The registry builds a grader with `cls.from_context(context)` when the class defines that
    classmethod, else with `cls()`.
    """

    async def grade(self, task: TaskSpec, artifact: bytes) -> Grade:
        """Grade one artifact for one task."""
        ...

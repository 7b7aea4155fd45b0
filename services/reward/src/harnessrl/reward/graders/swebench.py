"""The SWE-bench grader: a task of kind "swe" whose instance names its pristine repository."""

from __future__ import annotations

import uuid

from harnessrl.reward.graders.base import Grade, GradingContext
from harnessrl.reward.swe.container import ContainerGrader
from harnessrl.reward.swe.instance import InstanceError, SweInstance
from harnessrl.reward.swe.kube import JobRunner, KubernetesGrader, grade_with_job
from harnessrl.reward.swe.pipeline import grade_patch
from harnessrl.shared.contracts import TaskSpec
from harnessrl.shared.taskpaths import TaskPathError


def _infra(reason: str) -> Grade:
    return Grade(reward=0.0, outcome="infra-error", details={"reason": reason})


class SweBenchGrader:
    """Grades a patch against the instance's pristine repository, locally or in a Job's pod."""

    def __init__(self, context: GradingContext) -> None:
        self.context = context
        self._jobs: JobRunner | None = None

    @classmethod
    def from_context(cls, context: GradingContext) -> SweBenchGrader:
        """Build the grader for the service's settings."""
        return cls(context)

    async def grade(self, task: TaskSpec, artifact: bytes) -> Grade:
        """Grade the agent's diff for `task`."""
        if task.instance is None:
            return _infra("task has no instance")
        try:
            instance = SweInstance.from_row(task.instance)
        except InstanceError as exc:
            return _infra(str(exc))
        if self.context.sandbox != "local":
            if instance.image is None:
                return _infra(f"instance has no image for the {self.context.sandbox} sandbox")
            episode = uuid.uuid4().hex[:12]
            return await grade_with_job(instance, artifact, self.context, self._runner(), episode)
        if instance.official:
            return _infra(
                "the row is graded by its own eval script in its image: set the reward service's "
                "sandbox to `container` (podman or docker on this machine) or `kubernetes`"
            )
        return await self._grade_locally(instance, artifact)

    async def _grade_locally(self, instance: SweInstance, artifact: bytes) -> Grade:
        if instance.repo_path is None:
            return _infra("instance has no repo_path for the local sandbox")
        try:
            pristine = self.context.resolve(instance.repo_path)
        except TaskPathError as exc:
            return _infra(str(exc))
        return await grade_patch(instance, pristine, artifact, self.context)

    def _runner(self) -> JobRunner:
        if self._jobs is None:
            if self.context.sandbox == "container":
                self._jobs = ContainerGrader(self.context.container_engine, self.context.namespace)
            else:
                self._jobs = KubernetesGrader.connect(self.context)
        return self._jobs

"""A reward plug-in: the numeric answer must be right, and shorter answers score higher."""

from harnessrl.reward.graders.base import Grade
from harnessrl.reward.graders.simple import NumericGrader
from harnessrl.shared.contracts import TaskSpec

BUDGET_CHARS = 32


class TokenBudgetGrader:
    """Numeric correctness, minus up to 0.5 for answers longer than the budget."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.numeric = NumericGrader(*args, **kwargs)  # type: ignore[arg-type]

    async def grade(self, task: TaskSpec, artifact: bytes) -> Grade:
        base = await self.numeric.grade(task, artifact)
        overflow = max(0, len(artifact) - BUDGET_CHARS) / BUDGET_CHARS
        penalty = min(0.5, 0.5 * overflow) if base.reward > 0 else 0.0
        return Grade(
            reward=base.reward - penalty,
            resolved=base.resolved,
            outcome=base.outcome,
            details={**base.details, "length_penalty": penalty},
        )

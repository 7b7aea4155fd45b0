"""Grade three answers to "What is 12*34?" with the grader a task names, found as the reward service finds it.

Prints one JSON object: each answer's reward. The lookup is `harnessrl.reward.grading.build_grader`,
the reward service's own: only the `harnessrl.graders` entry points, so this works only once the
plug-in is installed.
"""

import asyncio
import json

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.grading import build_grader
from harnessrl.shared.contracts import TaskSpec

TASK = TaskSpec(task_id="mul-12x34", kind="qa", prompt="What is 12*34?", answer="408", grader="tokenbudget")
ANSWERS = {
    "right, short": "ANSWER 408",
    "right, long": "12*34 is 12*30 + 12*4 = 360 + 48, so: ANSWER 408",
    "wrong": "ANSWER 407",
}


async def main() -> None:
    """Grade each answer and print the rewards."""
    grader = build_grader(TASK.grader, GradingContext())
    rewards = {name: (await grader.grade(TASK, text.encode())).reward for name, text in ANSWERS.items()}
    print(json.dumps(rewards))


if __name__ == "__main__":
    asyncio.run(main())

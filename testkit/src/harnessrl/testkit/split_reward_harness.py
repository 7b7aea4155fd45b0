"""The demo harness with a reward split inside every group, for tests on the untrained tiny model.

It asks the model exactly as the demo harness does (so every episode has spans to train on), then
answers right as the first member of its group and wrong as any other. A random model is all wrong
and its groups have nothing to learn from; these groups always have reward variance, so every step
trains and makes a new weight version.
"""

import os
import re
import sys
from pathlib import Path

import msgspec
from openai import OpenAI

from harnessrl.shared.contracts import RunSpec
from harnessrl.stack.demo.harness import solve

# The harness's command, as a run spec's launcher gives it (a script path, so the controller's fork
# server runs it in a preloaded process).
COMMAND = [sys.executable, str(Path(__file__).resolve())]


def split_rewards(spec: RunSpec) -> RunSpec:
    """`spec` (the demo's run) with this harness, so every step of an untrained model trains."""
    return msgspec.structs.replace(spec, launcher=msgspec.structs.replace(spec.launcher, command=COMMAND))


def main() -> int:
    """Answer the task in HARNESSRL_TASK ("What is A*B?"), right only as member 00 of the group."""
    question = os.environ["HARNESSRL_TASK"]
    solve(OpenAI(max_retries=2, timeout=120), os.environ.get("HARNESSRL_MODEL", "policy"), question, 1.0)
    a, b = (int(number) for number in re.findall(r"\d+", question)[:2])
    member = os.environ["HARNESSRL_EPISODE"].split("-")[2]  # e<batch>-<slot>-<member>-a<attempt>
    answer = a * b if member == "00" else a * b + 1
    Path(os.environ.get("HARNESSRL_WORKDIR", "."), "answer.txt").write_text(str(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())

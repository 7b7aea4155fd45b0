"""The demo harness: an ordinary OpenAI-SDK program that knows nothing about harnessrl.

It reads the question from HARNESSRL_TASK (or argv), talks to whatever OPENAI_BASE_URL points at,
runs the model's `CALC a*b` requests on its calculator, and writes the final reply to
$HARNESSRL_WORKDIR/answer.txt. Exactly like an agent a team would deploy: change the base URL and
key, and it is being trained.
"""

import os
import re
import sys
from pathlib import Path
from typing import Any

from openai import OpenAI

CALC = re.compile(r"^\s*CALC\s+(\d+)\s*\*\s*(\d+)\s*$")
MAX_TURNS = 2


def solve(client: OpenAI, model: str, question: str, temperature: float) -> str:
    """Run one episode; return the model's final reply."""
    messages: list[Any] = [{"role": "user", "content": question}]
    reply = ""
    for _ in range(MAX_TURNS):
        response = client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=temperature
        )
        reply = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        call = CALC.match(reply)
        if call is None:
            break
        messages.append({"role": "user", "content": f"RESULT {int(call[1]) * int(call[2])}"})
    return reply


def main() -> int:
    """Answer the task given in the environment (or on the command line)."""
    question = os.environ.get("HARNESSRL_TASK") or " ".join(sys.argv[1:])
    client = OpenAI(max_retries=2, timeout=120)
    model = os.environ.get("HARNESSRL_MODEL", "policy")
    answer = solve(client, model, question, float(os.environ.get("DEMO_TEMPERATURE", "1.0")))
    workdir = Path(os.environ.get("HARNESSRL_WORKDIR", "."))
    (workdir / "answer.txt").write_text(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())

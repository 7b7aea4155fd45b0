"""Synthetic text the tiny model's tokenizer is trained on.

The corpus covers what tests and the demo send through the tiny model: the multiplication task
(`CALC 12*34`, `RESULT 408`, `ANSWER 408`), shell commands an agent harness runs, short Python
snippets, tool-call JSON and plain chat. It is a pure function of the seed, so a tokenizer trained
on it is reproducible.
"""

from __future__ import annotations

import json
import random

_GREETINGS = (
    "Hello! How can I help you today?",
    "You are a helpful assistant.",
    "Please solve the task below and explain your reasoning.",
    "Sure, here is the answer.",
    "Thanks, that worked.",
    "I will run a command to look at the files first.",
    "The tests pass now. Submitting the final output.",
)
_COMMANDS = (
    "ls -la",
    "cat README.md",
    "grep -rn 'def main' src/",
    "python -m pytest -q tests/",
    "sed -n '1,40p' app.py",
    "git diff",
    "find . -name '*.py' | head",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
    "pip install -e .",
    "cd repo && make test",
)
_CODE = (
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import json\nwith open('data.json') as f:\n    data = json.load(f)\n",
    "if __name__ == '__main__':\n    main()\n",
    "x = [n for n in range(100) if n % 7 == 0]\n",
)


def _multiplication(rng: random.Random) -> str:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    question = f"user\nWhat is {a}*{b}?\n"
    if rng.random() < 0.5:
        return question + f"assistant\nCALC {a}*{b}\nuser\nRESULT {a * b}\nassistant\nANSWER {a * b}\n"
    return question + f"assistant\nANSWER {a * b}\n"


def _shell(rng: random.Random) -> str:
    command = rng.choice(_COMMANDS)
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    output = "\n".join(f"file_{rng.randint(0, 999)}.py" for _ in range(rng.randint(1, 4)))
    return (
        f"system\n{rng.choice(_GREETINGS)}\nassistant\n<tool_call>\n{call}\n</tool_call>\n"
        f"user\n<tool_response>\n{output}\n</tool_response>\n"
    )


def _code(rng: random.Random) -> str:
    return f"user\nWrite some code.\nassistant\n```python\n{rng.choice(_CODE)}```\n"


def _chat(rng: random.Random) -> str:
    number = rng.randint(0, 10**6)
    return f"user\n{rng.choice(_GREETINGS)} {number}\nassistant\n<think>\n{number}\n</think>\n"


def synthetic_corpus(seed: int = 0, size: int = 3000) -> list[str]:
    """Return `size` synthetic chat snippets, identical for identical arguments."""
    rng = random.Random(seed)  # noqa: S311 - reproducible synthetic text, not security
    kinds = (_multiplication, _multiplication, _shell, _code, _chat)
    return [rng.choice(kinds)(rng) for _ in range(size)]

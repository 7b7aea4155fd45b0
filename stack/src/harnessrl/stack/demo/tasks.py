"""Demo task sets: training tasks, fixed held-out tasks and warm-start demonstrations."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

import msgspec

from harnessrl.shared.contracts import TaskSpec

HELDOUT_SEED = 1234
HELDOUT_SIZE = 200
TOOL_SHARE = 0.3


def question(a: int, b: int) -> str:
    """The user turn of one task."""
    return f"What is {a}*{b}?"


def heldout_pairs() -> list[tuple[int, int]]:
    """The 200 fixed held-out pairs, never trained on."""
    rng = random.Random(HELDOUT_SEED)  # noqa: S311 - reproducible task set, not security
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < HELDOUT_SIZE:
        pairs.add((rng.randint(10, 99), rng.randint(10, 99)))
    return sorted(pairs)


def training_pairs(count: int, seed: int) -> list[tuple[int, int]]:
    """`count` distinct random pairs that are not held out (at most 7,900 exist)."""
    rng = random.Random(seed)  # noqa: S311 - reproducible task set, not security
    pool = sorted({(a, b) for a in range(10, 100) for b in range(10, 100)} - set(heldout_pairs()))
    if count > len(pool):
        raise ValueError(f"only {len(pool)} distinct training pairs exist, asked for {count}")
    return rng.sample(pool, count)


def task_spec(a: int, b: int, *, heldout: bool = False) -> TaskSpec:
    """One graded task: the numeric grader compares the last number of the answer with a*b."""
    return TaskSpec(
        task_id=f"mul-{a}x{b}",
        kind="qa",
        prompt=question(a, b),
        answer=str(a * b),
        grader="numeric",
        heldout=heldout,
    )


def write_tasks(path: Path, tasks: Iterable[TaskSpec]) -> Path:
    """Write tasks as JSONL (the controller's task-source format)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(msgspec.json.encode(t) + b"\n" for t in tasks))
    return path


def demonstration(a: int, b: int, use_tool: bool) -> list[dict[str, str]]:
    """A correct episode as chat messages (the warm start imitates these)."""
    messages = [{"role": "user", "content": question(a, b)}]
    if use_tool:
        messages += [
            {"role": "assistant", "content": f"CALC {a}*{b}"},
            {"role": "user", "content": f"RESULT {a * b}"},
        ]
    messages.append({"role": "assistant", "content": f"ANSWER {a * b}"})
    return messages


def demonstrations(count: int, seed: int) -> list[list[dict[str, str]]]:
    """Warm-start data: correct episodes, 30% of them using the calculator."""
    rng = random.Random(seed)  # noqa: S311 - reproducible task set, not security
    held = set(heldout_pairs())
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(count * 2)]
    kept = [p for p in pairs if p not in held][:count]  # repeats are fine for imitation
    return [demonstration(a, b, rng.random() < TOOL_SHARE) for a, b in kept]

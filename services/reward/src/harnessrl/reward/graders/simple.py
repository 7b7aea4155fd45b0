"""Answer graders for question-answer tasks: exact match, regular expression, numeric value.

The artifact is the harness's final answer text. Anything that is not UTF-8 text of bounded size
is an invalid artifact (reward 0), never an exception.
"""

from __future__ import annotations

import asyncio
import math
import re

import regex

from harnessrl.reward.graders.base import Grade
from harnessrl.shared.contracts import TaskSpec

MAX_ANSWER_BYTES = 64 * 1024
# A task's pattern meets a model's text: either can make a backtracking search run for ages. The
# search runs off the event loop (releasing the GIL) and gives up after this long.
PATTERN_TIMEOUT_S = 1.0
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def answer_text(artifact: bytes) -> str | None:
    """The artifact as text, or None when it is too large, binary or not UTF-8."""
    if len(artifact) > MAX_ANSWER_BYTES or b"\x00" in artifact:
        return None
    try:
        return artifact.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _invalid(reason: str) -> Grade:
    return Grade(reward=0.0, resolved=False, outcome="invalid-artifact", details={"reason": reason})


def _verdict(ok: bool, expected: str, got: str | None) -> Grade:
    return Grade(
        reward=1.0 if ok else 0.0,
        resolved=ok,
        details={"expected": expected, "got": got},
    )


def _normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


class ExactGrader:
    """Reward 1 when the answer equals the expected one (case and whitespace runs ignored)."""

    async def grade(self, task: TaskSpec, artifact: bytes) -> Grade:
        """Compare normalised texts."""
        text = answer_text(artifact)
        if text is None:
            return _invalid("answer is not bounded UTF-8 text")
        expected = task.answer or ""
        return _verdict(_normalise(text) == _normalise(expected), expected, text.strip())


class RegexGrader:
    """Reward 1 when the task's answer, a regular expression, matches somewhere in the answer.

    Python's `re` syntax (the `regex` package's compatible mode, which can be stopped); a search
    past `PATTERN_TIMEOUT_S` is the outcome "timeout", and never stalls other gradings.
    """

    async def grade(self, task: TaskSpec, artifact: bytes) -> Grade:
        """Search the answer for the pattern."""
        text = answer_text(artifact)
        if text is None:
            return _invalid("answer is not bounded UTF-8 text")
        pattern = task.answer or ""
        try:
            found = await asyncio.to_thread(
                regex.search, pattern, text, timeout=PATTERN_TIMEOUT_S, concurrent=True
            )
        except regex.error as exc:
            return _invalid(f"task pattern is invalid: {exc}")
        except TimeoutError:
            reason = f"the task's pattern ran past {PATTERN_TIMEOUT_S:g} s on this answer"
            return Grade(reward=0.0, resolved=False, outcome="timeout", details={"reason": reason})
        return _verdict(found is not None, pattern, text.strip())


def last_number(text: str) -> float | None:
    """The last number in `text` (`ANSWER 408` -> 408.0; thousands separators allowed)."""
    matches = _NUMBER.findall(text)
    for raw in reversed(matches):
        try:
            return float(raw.replace(",", ""))
        except ValueError:
            continue
    return None


class NumericGrader:
    """Reward 1 when the last number in the answer equals the expected number (rel. tol. 1e-9)."""

    async def grade(self, task: TaskSpec, artifact: bytes) -> Grade:
        """Extract the last number and compare."""
        text = answer_text(artifact)
        if text is None:
            return _invalid("answer is not bounded UTF-8 text")
        expected_text = task.answer or ""
        expected = last_number(expected_text)
        got = last_number(text)
        ok = (
            expected is not None
            and got is not None
            and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12)
        )
        return _verdict(ok, expected_text, None if got is None else f"{got:g}")

"""Demo task sets: held-out pairs never trained on, distinct training tasks, full-size warm-start data."""

from __future__ import annotations

import pytest

from harnessrl.stack.demo.evaluate import correct
from harnessrl.stack.demo.tasks import demonstrations, heldout_pairs, training_pairs


def test_training_never_sees_heldout_pairs() -> None:
    held = set(heldout_pairs())
    assert len(held) == 200
    pairs = training_pairs(2000, seed=11)
    assert len(set(pairs)) == 2000 and not held & set(pairs)
    demo_questions = {conv[0]["content"] for conv in demonstrations(20_000, seed=7)}
    assert not {f"What is {a}*{b}?" for a, b in held} & demo_questions


def test_demonstrations_use_the_calculator_about_30_percent() -> None:
    demos = demonstrations(20_000, seed=7)
    assert len(demos) == 20_000
    share = sum(len(d) == 4 for d in demos) / len(demos)
    assert 0.27 < share < 0.33


def test_impossible_task_count_is_an_error() -> None:
    with pytest.raises(ValueError, match="distinct"):
        training_pairs(10_000, seed=1)


def test_correct_uses_the_last_number() -> None:
    assert correct("ANSWER 408", 12, 34)
    assert not correct("CALC 12*34", 12, 34)
    assert not correct("ANSWER 407", 12, 34)

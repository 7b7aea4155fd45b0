"""Run spec parsing: the sampling policy."""

from __future__ import annotations

import tomllib

import pytest

from harnessrl.shared.runspec import RunSpecError, parse_run_spec

BASE = 'run = "r"\ntasks = "t.jsonl"\n'
LAUNCHER = '[launcher]\ncommand = ["true"]\n'


def test_sampling_is_read_from_the_spec() -> None:
    spec = parse_run_spec(
        tomllib.loads(BASE + "sampling = { temperature = 1.0, top_p = 0.9, seed = 3 }\n" + LAUNCHER)
    )
    assert spec.sampling == {"temperature": 1.0, "top_p": 0.9, "seed": 3}
    assert parse_run_spec(tomllib.loads(BASE + LAUNCHER)).sampling == {}


def test_a_sampling_value_that_is_not_a_scalar_names_the_field() -> None:
    with pytest.raises(RunSpecError, match="sampling"):
        parse_run_spec(tomllib.loads(BASE + "sampling = { temperature = { low = 1 } }\n" + LAUNCHER))

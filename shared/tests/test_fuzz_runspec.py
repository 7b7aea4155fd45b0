"""Run specs with generated bad input: a `RunSpecError` that names the field, never a crash.

`parse_run_spec` gets 2,000 generated tables (every field of a run spec and of its launcher, each
sometimes of the wrong type, out of range or non-finite, plus unknown keys of any type, as YAML
allows) and `load_run_spec` 500 generated files (random text and bytes, broken TOML and YAML,
deep nesting). A spec that loads must survive a msgpack round trip (it crosses the bus); one that
doesn't raises `RunSpecError` naming the file and a field, or saying what is wrong with the file.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.shared import contracts as c
from harnessrl.shared.runspec import RunSpecError, load_run_spec, parse_run_spec

TABLE_CASES = 2000
FILE_CASES = 500
FUZZ = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
RUN_FIELDS = [f.name for f in msgspec.structs.fields(c.RunSpec)]
LAUNCHER_FIELDS = [f.name for f in msgspec.structs.fields(c.LauncherSpec)]

value = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=12),
        st.sampled_from(["", "sync", "async", "local", "kubernetes", "-1", "1e9", "run1"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
any_key = st.one_of(st.text(max_size=10), st.integers(), st.none(), st.booleans(), st.floats(allow_nan=False))
good_launcher = {"command": ["python", "-c", "pass"]}
launcher = st.one_of(
    st.fixed_dictionaries(
        {
            "command": st.one_of(
                st.just(good_launcher["command"]), st.lists(st.text(max_size=8), max_size=3), value
            )
        },
        optional={name: value for name in LAUNCHER_FIELDS if name != "command"},
    ).flatmap(
        lambda known: st.dictionaries(any_key, value, max_size=1).map(lambda extra: {**extra, **known})
    ),
    value,
)
table = st.fixed_dictionaries(
    {"run": st.one_of(st.just("run1"), value), "tasks": st.one_of(st.just("tasks.jsonl"), value)},
    optional={
        **{name: value for name in RUN_FIELDS if name not in ("run", "tasks", "launcher")},
        "launcher": launcher,
        "group_size": st.one_of(st.integers(-3, 3), st.integers(2**62, 2**66), value),
        "episode_timeout_s": st.one_of(
            st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-9]), value
        ),
    },
).flatmap(lambda known: st.dictionaries(any_key, value, max_size=2).map(lambda extra: {**extra, **known}))
document = st.one_of(table, table, table.map(lambda body: {"run": body}), value)


def _names_a_field(message: str) -> bool:
    """A refusal says where: a backquoted field, a table, or a value path."""
    return "`" in message or "$." in message or "expected a table" in message or "missing required" in message


@given(data=document)
@settings(FUZZ, max_examples=TABLE_CASES)
def test_generated_tables_parse_or_are_refused_naming_the_field(data: Any) -> None:
    try:
        spec = parse_run_spec(data, source="spec.yaml")
    except RunSpecError as exc:
        message = str(exc)
        assert message.startswith("spec.yaml: "), message
        assert _names_a_field(message), message
        return
    assert c.decode(c.encode(spec), c.RunSpec) == spec  # a spec that loads can cross the bus
    assert math.isfinite(spec.episode_timeout_s) and spec.episode_timeout_s > 0


@pytest.fixture(scope="module")
def spec_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("specs")
    (folder / "tasks.jsonl").write_text('{"task_id": "t1", "prompt": "2+2", "answer": "4"}\n')
    return folder


def _file_text(suffix: str, body: Any) -> bytes:
    if suffix == ".toml":
        return (
            b'run = "run1"\ntasks = "tasks.jsonl"\n[launcher]\ncommand = ["python", "-c", "pass"]\n'
            + str(body).encode()
        )
    return yaml.safe_dump(body).encode() if not isinstance(body, bytes) else body


spec_file = st.tuples(
    st.sampled_from([".toml", ".yaml", ".yml", ".json", ".txt"]),
    st.one_of(
        table,
        st.just({"run": "run1", "tasks": "tasks.jsonl", "launcher": good_launcher}),
        st.binary(max_size=64),
        st.text(max_size=40).map(str.encode),
        st.integers(1, 3000).map(lambda depth: b"run: " + b"[" * depth + b"]" * depth),
        st.just(b"\xff\xfe\x00run: x"),
        st.just(b"run = [\n"),
        st.just(b"run: [unclosed"),
    ),
)


def test_generated_files_load_or_are_refused(spec_folder: Path, say: Callable[[str], None]) -> None:
    outcomes: Counter[str] = Counter()

    @given(case=spec_file)
    @settings(FUZZ, max_examples=FILE_CASES)
    def one_file(case: tuple[str, Any]) -> None:
        suffix, body = case
        path = spec_folder / f"spec{suffix}"
        path.write_bytes(_file_text(suffix, body))
        try:
            load_run_spec(path)
        except RunSpecError as exc:
            assert str(path) in str(exc), exc
            outcomes["refused"] += 1
            return
        outcomes["loaded"] += 1

    one_file()
    say(f"fuzz run spec files: {dict(outcomes)}")
    assert sum(outcomes.values()) >= FILE_CASES and outcomes["refused"] > 0 and outcomes["loaded"] > 0

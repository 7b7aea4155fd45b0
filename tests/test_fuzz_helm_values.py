"""Helm values with generated bad input: refused with a message naming the value, or a valid render.

Each of `CASES` generated cases takes the `local-cpu` scenario and changes one to three values
(a leaf of `values.yaml` or an unknown key beside one) to a value of the wrong type, out of range,
empty or nested, then renders with the real helm. Either helm refuses, naming what it refused (the
schema path, the key or the chart's own sentence), or every rendered manifest must pass
kubernetes-validate strictly (CRD kinds: the published schemas). One helm process per case.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import msgspec
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.testkit import crds
from harnessrl.testkit.tools import HELM

CASES = 50
CHART = Path(__file__).resolve().parents[1] / "charts" / "harnessrl"
SCENARIO = ("-f", str(CHART / "ci" / "local-cpu-values.yaml"), "--set", "trainer.run=fuzz")
CRD_KINDS = set(crds.FILES)
Doc = dict[str, Any]


def _leaves(values: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Dotted paths of every leaf (and empty table) of the default values, keys helm `--set` can name."""
    if isinstance(values, dict) and values:
        found = [path] if path else []
        for key, child in values.items():
            if isinstance(key, str) and key.replace("_", "").isalnum():
                found += _leaves(child, (*path, key))
        return found
    return [path]


LEAVES = sorted(_leaves(yaml.safe_load((CHART / "values.yaml").read_text())))
bad_value = st.one_of(
    st.sampled_from(
        [
            "",
            "notanumber",
            "-1",
            "0",
            "true",
            "null",
            " ",
            "a b",
            "UPPER",
            "x" * 300,
            "../../etc",
            "1e400",
            "0x10",
            "${HOME}",
            "{{ .Values }}",
        ]
    ),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.lists(st.sampled_from(["", "x", "1"]), max_size=2),
    st.dictionaries(st.sampled_from(["x", "name", "value"]), st.sampled_from(["", "x", 1]), max_size=2),
)
change = st.tuples(
    st.sampled_from(LEAVES), st.sampled_from(["replace", "replace", "replace", "unknown"]), bad_value
)


def _set_args(changes: list[tuple[tuple[str, ...], str, Any]]) -> list[str]:
    args: list[str] = []
    for path, kind, value in changes:
        key = ".".join(path if kind == "replace" else (*path[:-1], "fuzzUnknownKey"))
        args += ["--set-json", f"{key}={msgspec.json.encode(value).decode()}"]
    return args


def _names_what_it_refused(stderr: str, changes: list[tuple[tuple[str, ...], str, Any]]) -> bool:
    names = {part for path, kind, _ in changes for part in path} | {"fuzzUnknownKey"}
    return any(name in stderr for name in names)


def _validate(docs: list[Doc]) -> None:
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            assert crds.validate(doc) == [], f"{doc['kind']} {doc['metadata']['name']}"
        else:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_chart_has_a_values_schema_and_the_scenario_renders() -> None:
    assert (CHART / "values.schema.json").is_file()
    assert len(LEAVES) > 50
    done = subprocess.run(
        [str(HELM), "template", "hrl", str(CHART), *SCENARIO], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_generated_bad_values_are_refused_or_render_valid_manifests(say: Callable[[str], None]) -> None:
    outcomes: Counter[str] = Counter()

    @given(changes=st.lists(change, min_size=1, max_size=3))
    @settings(
        max_examples=CASES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def one_case(changes: list[tuple[tuple[str, ...], str, Any]]) -> None:
        command = [
            str(HELM),
            "template",
            "hrl",
            str(CHART),
            "--namespace",
            "train",
            *SCENARIO,
            *_set_args(changes),
        ]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            assert "Error: " in done.stderr, done.stderr
            assert _names_what_it_refused(done.stderr, changes), (changes, done.stderr[:2000])
            outcomes["refused"] += 1
            return
        _validate([doc for doc in yaml.safe_load_all(done.stdout) if doc])
        outcomes["rendered"] += 1

    one_case()
    say(f"fuzz helm values: {dict(outcomes)}")
    assert sum(outcomes.values()) >= CASES and outcomes["refused"] > 0


# Found by the fuzz above (helm drops a key set to null, so the schema never sees it): each of
# these renders a manifest Kubernetes rejects (a Service port or a volume size of null).
NULLED_BY_FUZZ = [
    "gateway.port", "metrics.port", "model.storage.size", "nats.storage.size", "trainer.checkpoints.size",
    "trainer.shmSize", "vllm.port", "vllm.shmSize",
]  # fmt: skip


@pytest.mark.parametrize("key", NULLED_BY_FUZZ)
def test_a_required_value_set_to_null_is_refused_not_rendered_invalid(key: str) -> None:
    command = [
        str(HELM),
        "template",
        "hrl",
        str(CHART),
        "--namespace",
        "train",
        *SCENARIO,
        "--set-json",
        f"{key}=null",
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    if done.returncode == 0:
        _validate([doc for doc in yaml.safe_load_all(done.stdout) if doc])
    else:
        assert key.rsplit(".", 1)[-1] in done.stderr, done.stderr

"""SWE-bench-family datasets, each normalised to the one row shape the reward grader reads.

Every flavour turns a row as its dataset ships into `SWE_FIELDS` (the fields
`harnessrl.reward.swe.instance.SweInstance.from_row` reads: `FAIL_TO_PASS` / `PASS_TO_PASS` as
lists, `version` as text, `image` the task image, `repo_dir` where the repository is in it) and
keeps the row's other fields; `flavour` says which rule made it and `ungradable` why the swebench
rules cannot grade it ("" when they can). A row's own `image` always wins over the flavour's naming
rule; `mirrored` then moves any image onto a registry mirror.

What each flavour reads and where its image rule comes from (checked against the sources named):

- `swe-bench` (SWE-bench, Lite, Verified; `princeton-nlp/*` and `SWE-bench/*` on the hub): fields
  `instance_id, repo, base_commit, patch, test_patch, problem_statement, hints_text, created_at,
  version, environment_setup_commit`, `FAIL_TO_PASS` / `PASS_TO_PASS` as JSON-encoded strings (the
  hub's dataset cards: `dtype: string`); 5.x rows also carry `image, eval_script, log_parser,
  eval_type` and lists. Image: `swebench/sweb.eval.x86_64.<instance_id>:latest`, lower-cased, `__`
  spelt `_1776_` (swebench 5.0.2, `swebench/task/checks.py` `expected_image` and
  `swebench/image_builder/image_spec.py` `ImageSpec.name`; also mini-swe-agent's and SWE-agent's
  `from_swe_bench`).
- `swe-bench-multilingual` (`SWE-bench/SWE-bench_Multilingual`): the same fields as 5.x SWE-bench
  (its dataset card lists `image, eval_script, log_parser, eval_type`, lists for the tests) and the
  same image rule (swebench's harness names every dataset's images alike); normalised exactly as
  `swe-bench`, so `auto` reports such rows as `swe-bench`.
- `swe-gym` (`SWE-Gym/SWE-Gym`, `-Lite`): SWE-bench's fields, the tests as lists, no image field.
  Image: `xingyaoww/sweb.eval.x86_64.<instance_id>:latest`, lower-cased, `__` spelt `_s_`
  (OpenHands `evaluation/benchmarks/swe_bench/run_infer.py` `get_instance_docker_image`, prefix
  `xingyaoww/`, also in NVIDIA-NeMo/ProRL-Agent-Server's copy).
- `swe-smith` (`SWE-bench/SWE-smith`): `instance_id` (`<owner>__<repo>.<commit8>.<bug>`),
  `repo` (the mirror, `swesmith/<owner>__<repo>.<commit8>`), `base_commit` (the bug's branch
  head), `patch` (the patch that introduces the bug: SWE-smith grades the gold fix as its reverse),
  `problem_statement`, the tests as lists, `image_name`. Image: the row's `image_name` (OpenHands
  reads it as is), else `swebench/swesmith.x86_64.<owner>_1776_<repo>.<commit8>`, lower-cased
  (SWE-smith `swesmith/profiles/base.py` `RepoProfile.image_name`, namespace `ORG_NAME_DH` in
  `swesmith/constants.py`). Ungradable by the swebench rules: see `SWE_SMITH_UNGRADABLE`.
- `r2e-gym` (`R2E-Gym/R2E-Gym-Subset`, `-Lite`): `repo_name, commit_hash, docker_image,
  problem_statement, parsed_commit_content` (a JSON `ParsedCommit` with `old_commit_hash`),
  `expected_output_json`; no instance id (made `<repo_name>__<commit_hash>`) and no FAIL_TO_PASS /
  PASS_TO_PASS. Image: the row's `docker_image` (R2E-Gym `src/r2egym/agenthub/runtime/docker.py`
  `DockerRuntime`; no naming rule is published, so a row without one lacks a field). Ungradable by
  the swebench rules: see `R2E_GYM_UNGRADABLE`.
- `swe-rebench` (`nebius/SWE-rebench`): SWE-bench's fields with lists, `install_config` (its
  `log_parser` names the swebench parser: SWE-rebench/SWE-bench-fork `swebench/harness/grading.py`)
  and `docker_image`. Image: the row's `docker_image`, else
  `swerebench/sweb.eval.x86_64.<instance_id>:latest`, lower-cased, `__` spelt `_1776_` (the fork's
  `TestSpec.instance_image_key` under the namespace its README evaluates with, `swerebench`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harnessrl.controller.errors import DatasetError

# The row shape every SWE flavour produces (the fields the reward grader reads).
SWE_FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "patch",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "version",
    "image",
    "repo_dir",
    "eval_script",
    "log_parser",
    "eval_type",
)
# Where the repository is in every family's task image.
REPO_DIR = "/testbed"
# What a SWE-bench-shaped row must ship (the rest default to empty).
_SWE_REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
SWE_SMITH_UNGRADABLE = (
    "SWE-smith grades with its repository profile's test command and log parser (swesmith.profiles), "
    "not swebench's; its `patch` introduces the bug (the fix is its reverse), there is no test_patch, "
    "and `base_commit` is the bug branch's head, which the image's clone does not hold"
)
R2E_GYM_UNGRADABLE = (
    "R2E-Gym grades by running the image's /root/run_tests.sh (its hidden r2e_tests) and comparing "
    "every test's status with `expected_output_json`; the row has no FAIL_TO_PASS / PASS_TO_PASS "
    "for swebench's rules"
)

Row = dict[str, Any]


@dataclass(frozen=True)
class Normalised:
    """A row in the grader's shape, and what is wrong with it (empty: nothing)."""

    instance: Row
    problems: tuple[str, ...]


@dataclass(frozen=True)
class Flavour:
    """One dataset family: the fields it must ship and how its rows become `SWE_FIELDS`."""

    name: str
    required: tuple[str, ...]
    shape: Callable[[Row], Row]


class _BadField(ValueError):
    """A field is there but not in a shape the flavour can read."""


def normalise(flavour: Flavour, row: Mapping[str, Any]) -> Normalised:
    """`row` in the grader's shape, with every missing or malformed field named (never raises)."""
    fields = dict(row)
    problems = [f"lacks `{name}`" for name in flavour.required if _absent(fields.get(name))]
    try:
        instance = flavour.shape(fields)
    except _BadField as exc:
        return Normalised({**fields, "flavour": flavour.name}, (*problems, str(exc)))
    return Normalised({**instance, "flavour": flavour.name}, tuple(problems))


def _absent(value: Any) -> bool:
    return value is None or value == ""


def test_ids(row: Row, key: str) -> list[str]:
    """A FAIL_TO_PASS / PASS_TO_PASS field as a list: as shipped, or decoded from its JSON text."""
    value = row.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise _BadField(f"`{key}` is not a JSON list of test ids ({exc.msg})") from exc
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _BadField(f"`{key}` must be a list of test ids, got {type(value).__name__}")
    return value


def _text(row: Row, key: str, default: str = "") -> str:
    value = row.get(key)
    return default if _absent(value) else str(value)


def swe_shape(row: Row, *, image: str, **fields: Any) -> Row:
    """The grader's shape of a SWE-bench-like row: its fields, the lists decoded, the image given."""
    shaped = dict(row)
    shaped.update(
        instance_id=_text(row, "instance_id"),
        repo=_text(row, "repo"),
        base_commit=_text(row, "base_commit"),
        problem_statement=_text(row, "problem_statement"),
        patch=_text(row, "patch"),
        test_patch=_text(row, "test_patch"),
        FAIL_TO_PASS=test_ids(row, "FAIL_TO_PASS"),
        PASS_TO_PASS=test_ids(row, "PASS_TO_PASS"),
        version=_text(row, "version"),
        image=_text(row, "image") or image,
        repo_dir=_text(row, "repo_dir", REPO_DIR),
        eval_script=_text(row, "eval_script"),
        log_parser=_text(row, "log_parser"),
        eval_type=_text(row, "eval_type"),
        ungradable="",
    )
    shaped.update(fields)
    return shaped


# --- image naming rules (sources in the module docstring) -------------------------------------------


def swebench_image(instance_id: str) -> str:
    """SWE-bench's (and Multilingual's) instance image: `swebench/sweb.eval.x86_64.<id>:latest`."""
    return f"swebench/sweb.eval.x86_64.{instance_id}:latest".lower().replace("__", "_1776_")


def swe_gym_image(instance_id: str) -> str:
    """SWE-Gym's instance image: `xingyaoww/sweb.eval.x86_64.<id with __ as _s_>:latest`."""
    return f"xingyaoww/sweb.eval.x86_64.{instance_id.replace('__', '_s_')}:latest".lower()


def swe_rebench_image(instance_id: str) -> str:
    """SWE-rebench's instance image: `swerebench/sweb.eval.x86_64.<id>:latest` (the fork's rule)."""
    return f"swerebench/sweb.eval.x86_64.{instance_id}:latest".lower().replace("__", "_1776_")


def swe_smith_image(instance_id: str) -> str:
    """SWE-smith's repository image: `swebench/swesmith.x86_64.<owner>_1776_<repo>.<commit8>`."""
    repo_name = instance_id.rsplit(".", 1)[0]  # <owner>__<repo>.<commit8>, the profile's repo_name
    return f"swebench/swesmith.x86_64.{repo_name.replace('__', '_1776_')}".lower()


def mirrored(image: str, prefix: str | None) -> str:
    """`image` pulled through the registry `prefix` (a mirror) instead of the registry it names.

    The image's own registry (its first path part, when that has a `.` or `:` or is `localhost`;
    else Docker Hub) is replaced, its repository path and tag kept:
    `swebench/sweb.eval.x86_64.a_1776_b-1:latest` via `mirror.local:5000` is
    `mirror.local:5000/swebench/sweb.eval.x86_64.a_1776_b-1:latest`.
    """
    if not prefix or not image:
        return image
    first, slash, rest = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        image = rest
    return f"{prefix.rstrip('/')}/{image}"


# --- the flavours ----------------------------------------------------------------------------------


def _swe_bench(row: Row) -> Row:
    return swe_shape(row, image=swebench_image(_text(row, "instance_id")))


def _swe_gym(row: Row) -> Row:
    return swe_shape(row, image=swe_gym_image(_text(row, "instance_id")))


def _swe_rebench(row: Row) -> Row:
    image = _text(row, "docker_image") or swe_rebench_image(_text(row, "instance_id"))
    config = row.get("install_config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise _BadField(f"`install_config` is not a JSON object ({exc.msg})") from exc
    parser = config.get("log_parser") if isinstance(config, dict) else None
    return swe_shape(row, image=image, log_parser=_text(row, "log_parser") or str(parser or ""))


def _swe_smith(row: Row) -> Row:
    image = _text(row, "image_name") or swe_smith_image(_text(row, "instance_id"))
    return swe_shape(
        row, image=image, patch="", bug_patch=_text(row, "patch"), ungradable=SWE_SMITH_UNGRADABLE
    )


def _r2e_gym(row: Row) -> Row:
    instance_id = _text(row, "instance_id") or f"{_text(row, 'repo_name')}__{_text(row, 'commit_hash')}"
    base = {
        **row,
        "instance_id": instance_id,
        "repo": _text(row, "repo") or _text(row, "repo_name"),
        "base_commit": _text(row, "base_commit") or _old_commit(row),
    }
    return swe_shape(base, image=_text(row, "docker_image"), ungradable=R2E_GYM_UNGRADABLE)


def _old_commit(row: Row) -> str:
    """The commit before the fix, from R2E-Gym's `parsed_commit_content` (a JSON `ParsedCommit`)."""
    content = row.get("parsed_commit_content")
    try:
        parsed = json.loads(content) if isinstance(content, str) else content
    except json.JSONDecodeError as exc:
        raise _BadField(f"`parsed_commit_content` is not JSON ({exc.msg})") from exc
    return str(parsed.get("old_commit_hash") or "") if isinstance(parsed, dict) else ""


FLAVOURS: dict[str, Flavour] = {
    "swe-bench": Flavour("swe-bench", _SWE_REQUIRED, _swe_bench),
    "swe-bench-multilingual": Flavour("swe-bench-multilingual", _SWE_REQUIRED, _swe_bench),
    "swe-gym": Flavour("swe-gym", _SWE_REQUIRED, _swe_gym),
    "swe-rebench": Flavour("swe-rebench", _SWE_REQUIRED, _swe_rebench),
    "swe-smith": Flavour(
        "swe-smith",
        ("instance_id", "repo", "problem_statement", "patch", "FAIL_TO_PASS", "PASS_TO_PASS"),
        _swe_smith,
    ),
    "r2e-gym": Flavour(
        "r2e-gym",
        ("repo_name", "commit_hash", "docker_image", "problem_statement", "expected_output_json"),
        _r2e_gym,
    ),
}


# --- auto-detection --------------------------------------------------------------------------------


# Fields only one dataset ships, in the order they are looked for.
_DISTINCTIVE = (
    ("r2e-gym", ("expected_output_json",)),
    ("swe-smith", ("image_name",)),
    ("swe-rebench", ("install_config", "docker_image")),
)


def row_flavours(row: Mapping[str, Any]) -> frozenset[str]:
    """The flavours a row's fields fit (`tasks` is ours; the others by their distinctive fields).

    Our own rows are TaskSpecs, or SWE rows with `repo_path` or without the tests SWE-bench ships
    (`FAIL_TO_PASS`). SWE-bench, Multilingual and SWE-Gym ship the same fields: a row with its own
    `image` or `eval_script` (5.x), or with FAIL_TO_PASS as JSON text (how SWE-bench stores it), is
    SWE-bench's (Multilingual normalises identically); one with test lists and no image fits
    SWE-bench and SWE-Gym, whose images are named differently.
    """
    if "repo_path" in row or ("task_id" in row and "instance_id" not in row):
        return frozenset({"tasks"})
    for name, fields in _DISTINCTIVE:
        if any(field in row for field in fields):
            return frozenset({name})
    if "instance_id" not in row:
        return frozenset({"r2e-gym"}) if "repo_name" in row else frozenset()
    if "FAIL_TO_PASS" not in row:
        return frozenset({"tasks"})
    if row.get("image") or row.get("eval_script") or isinstance(row.get("FAIL_TO_PASS"), str):
        return frozenset({"swe-bench"})
    return frozenset({"swe-bench", "swe-gym"})


def detect(rows: Sequence[tuple[str, Mapping[str, Any]]], source: str) -> str:
    """The one flavour every row of `rows` (`(where, fields)`) fits.

    `DatasetError` when a row fits no flavour, when rows fit different ones, or when they fit
    several that name their images differently (SWE-bench and SWE-Gym rows without an image).
    """
    fitting: frozenset[str] | None = None
    first_where = ""
    for where, fields in rows:
        own = row_flavours(fields)
        if not own:
            raise DatasetError(f"{where}: fits no flavour (no `instance_id`, `task_id` or `repo_name`)")
        if fitting is not None and not fitting & own:
            raise DatasetError(
                f"{source}: rows fit different flavours ({first_where}: {_names(fitting)}; "
                f"{where}: {_names(own)}); name one with `dataset.flavour` (--flavour)"
            )
        if fitting is None:
            first_where = where
        fitting = own if fitting is None else fitting & own
    if not fitting:
        raise DatasetError(f"{source}: no rows to detect a flavour from")
    if len(fitting) > 1:
        raise DatasetError(
            f"{source}: the rows fit flavours {_names(fitting)}, which name task images differently "
            "(swebench/... or xingyaoww/...); name one with `dataset.flavour` (--flavour)"
        )
    return next(iter(fitting))


def _names(flavours: frozenset[str]) -> str:
    return " or ".join(sorted(flavours))

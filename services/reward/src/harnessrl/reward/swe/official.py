"""What the official `swebench` package owns, used as it ships: log parsers, log reading, reports.

SWE-bench 5.x rows carry their own `eval_script`, `log_parser` and `eval_type`; older rows and
other datasets name only a repository, whose parser swebench maps (`MAP_REPO_TO_PARSER_*`, Python
and every Multilingual language). Grading an eval script's log goes through swebench's
`get_logs_eval` (markers, failure sentinels, the recorded test exit code) and
`get_eval_tests_report` (FAIL_TO_PASS / PASS_TO_PASS by eval type), so a grade here is the grade
`swebench.harness.grading.get_eval_report` gives on the same log.

`swebench.harness`'s package init imports its Docker and Modal runners (the `docker` and `modal`
clients), which grading never uses and the reward image does not carry: the modules below are
loaded under a bare `swebench.harness` package instead, so its init never runs.
"""

from __future__ import annotations

import functools
import importlib
import sys
import tempfile
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec

from harnessrl.reward.errors import RewardError
from harnessrl.reward.swe.instance import SweInstance

LANGUAGES = ("python", "javascript", "c", "go", "java", "php", "ruby", "rust")
EVAL_TYPES = ("pass_and_fail", "fail_only")
TEST_EXIT_CODE_VAR = "SWEBENCH_TEST_EXIT_CODE"
Resolution = Literal["RESOLVED_FULL", "RESOLVED_PARTIAL", "RESOLVED_NO"]


class TestsReport(msgspec.Struct, frozen=True, kw_only=True):
    """The swebench report: per-list successes and failures, rates, and the resolution."""

    f2p_success: list[str]
    f2p_failure: list[str]
    p2p_success: list[str]
    p2p_failure: list[str]
    f2p_rate: float
    p2p_rate: float
    resolution: Resolution

    @property
    def resolved(self) -> bool:
        """Every FAIL_TO_PASS and PASS_TO_PASS test succeeded."""
        return self.resolution == "RESOLVED_FULL"


class OfficialGradingError(RewardError, ValueError):
    """The row names no parser swebench knows, or an eval type it does not define."""


@functools.cache
def swebench() -> types.SimpleNamespace:
    """The swebench grading modules (see the module docstring for why the package init is skipped)."""
    import swebench as package

    if "swebench.harness" not in sys.modules:
        harness = types.ModuleType("swebench.harness")
        harness.__path__ = [str(Path(package.__file__).parent / "harness")]
        sys.modules["swebench.harness"] = harness
    parsers = importlib.import_module("swebench.harness.log_parsers")
    return types.SimpleNamespace(
        grading=importlib.import_module("swebench.harness.grading"),
        constants=importlib.import_module("swebench.harness.constants"),
        types=importlib.import_module("swebench.types"),
        registry=parsers.PARSER_REGISTRY,
        by_repo=_repository_parsers(parsers.PARSER_REGISTRY),
    )


def _repository_parsers(registry: Mapping[str, Callable[..., Any]]) -> dict[str, str]:
    """Repository -> registry name of its parser, from every language's `MAP_REPO_TO_PARSER_*`.

    A repository mapped to a function the registry lacks (in 5.0.2: cypress, emotion and plotly.js)
    is left out: `get_logs_eval` looks parsers up by registry name, so swebench cannot grade it.
    """
    names: dict[int, str] = {}
    for name, parser in registry.items():
        names.setdefault(id(parser), name)
    by_repo: dict[str, str] = {}
    for language in LANGUAGES:
        module = importlib.import_module(f"swebench.harness.log_parsers.{language}")
        for attribute, mapping in vars(module).items():
            if attribute.startswith("MAP_REPO_TO_PARSER"):
                by_repo.update({r: names[id(p)] for r, p in mapping.items() if id(p) in names})
    return by_repo


def parser_name(row: Mapping[str, Any]) -> str | None:
    """The swebench parser a row is graded with: its `log_parser`, else its repository's; or None."""
    modules = swebench()
    named = row.get("log_parser")
    if named:
        return str(named) if named in modules.registry else None
    by_repo: dict[str, str] = modules.by_repo
    return by_repo.get(str(row.get("repo", "")))


def eval_type(instance: SweInstance) -> str:
    """The row's eval type, else swebench's rule (fail-only for the repositories it lists)."""
    if instance.eval_type:
        if instance.eval_type not in EVAL_TYPES:
            raise OfficialGradingError(
                f"eval_type {instance.eval_type!r} is not one of {', '.join(EVAL_TYPES)}"
            )
        return instance.eval_type
    return "fail_only" if instance.repo in swebench().constants.FAIL_ONLY_REPOS else "pass_and_fail"


def test_spec(instance: SweInstance) -> Any:
    """The swebench `TestSpec` of the row (the parts grading a log reads)."""
    parser = parser_name({"log_parser": instance.log_parser, "repo": instance.repo})
    if parser is None:
        wanted = instance.log_parser or f"a parser for repository {instance.repo!r}"
        raise OfficialGradingError(f"swebench has no log parser {wanted}")
    return swebench().types.TestSpec(
        instance_id=instance.instance_id,
        image=instance.image or "",
        eval_script_list=[],
        repo=instance.repo,
        version=instance.version,
        FAIL_TO_PASS=instance.fail_to_pass,
        PASS_TO_PASS=instance.pass_to_pass,
        log_parser=parser,
        eval_type=eval_type(instance),
    )


def with_test_exit_code(eval_script: str) -> str:
    """The eval script, made to print the test command's own exit status after its end marker.

    The same edit as `swebench.harness.utils.record_test_exit_code` (that module imports the
    `datasets` library at load, which the reward image does not carry); a test checks the two agree.
    """
    constants = swebench().constants
    lines = eval_script.strip().split("\n")
    for index, line in enumerate(lines):
        if constants.END_TEST_OUTPUT in line:
            recorded = [
                f"{TEST_EXIT_CODE_VAR}=$?",
                line,
                f'echo "{constants.TEST_EXIT_CODE}: ${TEST_EXIT_CODE_VAR}"',
            ]
            lines[index : index + 1] = recorded
            break
    return "\n".join(lines) + "\n"


class OfficialResult(NamedTuple):
    """The swebench reading of one eval log: the status map, whether it counts, and the report."""

    statuses: dict[str, str]
    found: bool
    report: TestsReport | None


def grade_log(instance: SweInstance, log: str) -> OfficialResult:
    """Read an eval script's whole log as swebench does and report on FAIL_TO_PASS / PASS_TO_PASS.

    `found` is False (and `report` None) where swebench finds no valid run: a failure sentinel, no
    output markers, no parsed test and no sign the suite ran, or a non-zero test exit code with
    no failing test in the log.
    """
    modules = swebench()
    spec = test_spec(instance)
    with tempfile.NamedTemporaryFile("w", suffix=".log", encoding="utf-8") as file:
        file.write(log)
        file.flush()
        statuses, found = modules.grading.get_logs_eval(spec, file.name)
    if not found:
        return OfficialResult(statuses, False, None)
    report = tests_report(statuses, spec.FAIL_TO_PASS, spec.PASS_TO_PASS, spec.eval_type)
    return OfficialResult(statuses, True, report)


def tests_report(
    statuses: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str], kind: str
) -> TestsReport:
    """The swebench `get_eval_tests_report` and resolution of a status map, as a `TestsReport`."""
    grading = swebench().grading
    gold = {"FAIL_TO_PASS": fail_to_pass, "PASS_TO_PASS": pass_to_pass}
    tests = grading.get_eval_tests_report(statuses, gold, eval_type=swebench().constants.EvalType(kind))
    status: Resolution = grading.get_resolution_status(tests)
    return TestsReport(
        f2p_success=tests["FAIL_TO_PASS"]["success"],
        f2p_failure=tests["FAIL_TO_PASS"]["failure"],
        p2p_success=tests["PASS_TO_PASS"]["success"],
        p2p_failure=tests["PASS_TO_PASS"]["failure"],
        f2p_rate=grading.compute_fail_to_pass(tests),
        p2p_rate=grading.compute_pass_to_pass(tests),
        resolution=status,
    )

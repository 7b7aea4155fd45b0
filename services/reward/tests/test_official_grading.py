"""Recorded eval logs for every swebench log parser, graded by `official` and by swebench itself.

`data/eval_logs/<parser>.json` holds, for each name in swebench's `PARSER_REGISTRY`, eval logs in the
shape the official eval script prints them (`set -x` trace, test patch applied, the runner's own
output between `>>>>> Start Test Output` and `>>>>> End Test Output`, then `>>>>> Test Exit Code`),
each with its FAIL_TO_PASS / PASS_TO_PASS lists and what grading it must give. A case whose log is
not in its parser's format fails `test_case_expectation`: a gold run would not resolve, or a
failure would not be read.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harnessrl.reward.swe import official
from harnessrl.reward.swe.instance import SweInstance

CORPUS = Path(__file__).parent / "data" / "eval_logs"
Case = dict[str, Any]


def _load_corpus() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for path in sorted(CORPUS.glob("*.json")):
        for index, case in enumerate(json.loads(path.read_text(encoding="utf-8"))):
            cases[f"{path.stem}-{index}"] = case
    return cases


CASES = _load_corpus()


def _row(case_id: str, case: Case, *, log_parser: bool = True) -> dict[str, Any]:
    """The dataset row a case stands for; the fields grading ignores are placeholders."""
    repo = str(case["repo"])
    return {
        "instance_id": case.get("instance_id") or f"{repo.replace('/', '__')}-{case_id.rsplit('-', 1)[1]}",
        "repo": repo,
        "base_commit": "0" * 40,
        "test_patch": "",
        "version": case.get("version", ""),
        "log_parser": case["log_parser"] if log_parser else "",
        "eval_type": case.get("eval_type", ""),
        "FAIL_TO_PASS": case["FAIL_TO_PASS"],
        "PASS_TO_PASS": case["PASS_TO_PASS"],
    }


def _instance(case_id: str, *, log_parser: bool = True) -> SweInstance:
    return SweInstance.from_row(_row(case_id, CASES[case_id], log_parser=log_parser))


def _repository_maps() -> dict[str, Callable[..., Any]]:
    """Every `MAP_REPO_TO_PARSER_*` entry of swebench: repository -> parser function."""
    official.swebench()  # registers the bare `swebench.harness` package the parser modules load under
    mapped: dict[str, Callable[..., Any]] = {}
    for language in official.LANGUAGES:
        module = importlib.import_module(f"swebench.harness.log_parsers.{language}")
        for attribute, mapping in vars(module).items():
            if attribute.startswith("MAP_REPO_TO_PARSER"):
                mapped.update(mapping)
    return mapped


MAPPED = _repository_maps()


def _resolved(result: official.OfficialResult) -> bool:
    return result.report is not None and result.report.resolved


def test_every_registry_parser_has_a_corpus_file() -> None:
    registry = set(official.swebench().registry)
    files = {path.stem for path in CORPUS.glob("*.json")}
    missing = sorted(registry - files)
    assert not missing, f"no recorded eval logs for parsers: {', '.join(missing)}"
    unknown = sorted(files - registry)
    assert not unknown, f"corpus files name no registry parser: {', '.join(unknown)}"


@pytest.mark.parametrize("parser", sorted(official.swebench().registry))
def test_each_parser_has_a_gold_and_a_wrong_run(parser: str) -> None:
    cases = [case for case_id, case in CASES.items() if case_id.rsplit("-", 1)[0] == parser]
    assert all(case["log_parser"] == parser for case in cases)
    assert any(case["expect"] == {**case["expect"], "found": True, "resolved": True} for case in cases)
    assert any(case["expect"] == {**case["expect"], "found": True, "resolved": False} for case in cases)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_grade_log_agrees_with_swebench(case_id: str, tmp_path: Path) -> None:
    instance = _instance(case_id)
    log = CASES[case_id]["log"]
    result = official.grade_log(instance, log)

    path = tmp_path / "test_output.txt"
    path.write_text(log, encoding="utf-8")
    grading = official.swebench().grading
    spec = official.test_spec(instance)
    prediction = {"instance_id": instance.instance_id, "model_patch": "x"}
    reports = grading.get_eval_report(spec, prediction, str(path), include_tests_status=True)
    report = reports[instance.instance_id]

    statuses, found = grading.get_logs_eval(spec, str(path))
    assert (result.statuses, result.found) == (statuses, found)
    assert result.found == report["patch_successfully_applied"]
    assert _resolved(result) == report["resolved"]
    if result.report is None:
        assert "tests_status" not in report
        return
    tests = report["tests_status"]
    assert result.report.f2p_success == tests["FAIL_TO_PASS"]["success"]
    assert result.report.f2p_failure == tests["FAIL_TO_PASS"]["failure"]
    assert result.report.p2p_success == tests["PASS_TO_PASS"]["success"]
    assert result.report.p2p_failure == tests["PASS_TO_PASS"]["failure"]


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_case_expectation(case_id: str) -> None:
    expect = CASES[case_id]["expect"]
    result = official.grade_log(_instance(case_id), CASES[case_id]["log"])
    assert result.found is expect["found"]
    assert _resolved(result) is expect["resolved"]
    wanted: dict[str, str] | None = expect.get("statuses")
    if result.found:
        if wanted == {}:
            # A parser that records failures only, on a clean run: found through swebench's evidence
            # that the suite ran; the same file's wrong run shows the parser reads this format.
            assert result.statuses == {}
        else:
            assert result.statuses, "the run counts, yet its parser read no test from the log"
    for name, status in (wanted or {}).items():
        assert result.statuses.get(name) == status, name


# Cases whose repository swebench maps to the very parser the case names: graded the same way
# when the row names only its repository (SWE-bench rows from before 5.x).
BY_REPOSITORY = sorted(
    case_id
    for case_id, case in CASES.items()
    if MAPPED.get(case["repo"]) is official.swebench().registry[case["log_parser"]]
)


@pytest.mark.parametrize("case_id", BY_REPOSITORY)
def test_row_without_log_parser_grades_by_repository(case_id: str) -> None:
    named = official.grade_log(_instance(case_id), CASES[case_id]["log"])
    by_repo = official.grade_log(_instance(case_id, log_parser=False), CASES[case_id]["log"])
    assert by_repo == named


@pytest.mark.parametrize("repo", sorted({case["repo"] for case in CASES.values() if case["repo"] in MAPPED}))
def test_parser_name_of_case_repository(repo: str) -> None:
    name = official.parser_name({"repo": repo})
    assert name is not None
    assert official.swebench().registry[name] is MAPPED[repo]


def test_parser_name_of_every_mapped_repository() -> None:
    registry = official.swebench().registry
    known = {id(parser) for parser in registry.values()}
    for repo, parser in MAPPED.items():
        name = official.parser_name({"repo": repo})
        if id(parser) in known:
            assert name is not None and registry[name] is parser, repo
        else:
            assert name is None, repo


def test_parser_name_unknown() -> None:
    # cypress is mapped to a function the registry lacks: swebench could not grade it by name
    assert "cypress-io/cypress" in MAPPED
    assert official.parser_name({"repo": "cypress-io/cypress"}) is None
    assert official.parser_name({"log_parser": "no_such"}) is None
    assert official.parser_name({"repo": "nobody/nothing"}) is None

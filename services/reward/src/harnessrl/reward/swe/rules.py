"""Resolution over a map of test statuses: swebench's report, with our defaults and checks.

The report is swebench's (`official.tests_report`): a FAIL_TO_PASS test succeeds when PASSED or
XFAIL and fails when FAILED, ERROR, SKIPPED or missing; a PASS_TO_PASS test is maintained when
PASSED, XFAIL or SKIPPED; resolved only when both lists succeed; a rate with no tests counts as
1; truncated parametrised ids match by prefix when unambiguous. Ours on top: an XFAIL
FAIL_TO_PASS test fails by default (`xfail_passes_f2p`), partial credit, and the consistency
checks between the exit code, the JUnit report and the `-rA` log.
"""

from __future__ import annotations

from harnessrl.reward.settings import GradingRules
from harnessrl.reward.swe.official import TestsReport, tests_report
from harnessrl.reward.swe.testlog import ERROR, FAILED, PASSED, XFAIL

PASSING = frozenset({PASSED, XFAIL})  # statuses a test counts as passing with
_FAILING = frozenset({FAILED, ERROR})


def resolve_case(case: str, statuses: dict[str, str]) -> str | None:
    """The status key for `case`, tolerating truncated parametrised ids (SWE-bench issue #290)."""
    if case in statuses:
        return case
    if case.count("[") > case.count("]"):
        matches = [key for key in statuses if key.startswith(case)]
        if matches and len({statuses[key] in PASSING for key in matches}) == 1:
            return matches[0]
    return None


def evaluate(
    statuses: dict[str, str],
    fail_to_pass: list[str],
    pass_to_pass: list[str],
    rules: GradingRules | None = None,
) -> TestsReport:
    """Grade `statuses` against the instance's lists: swebench's report (pass-and-fail).

    Except that an XFAIL FAIL_TO_PASS test fails unless `xfail_passes_f2p`: a test still failing
    as expected did not go from failing to passing.
    """
    rules = rules or GradingRules()
    if not rules.xfail_passes_f2p:
        strict = {resolve_case(case, statuses) for case in fail_to_pass}
        statuses = {
            key: FAILED if key in strict and status == XFAIL else status for key, status in statuses.items()
        }
    return tests_report(statuses, fail_to_pass, pass_to_pass, "pass_and_fail")


def reward_of(report: TestsReport, rules: GradingRules | None = None) -> float:
    """1.0 when resolved; otherwise 0.0, or f2p_rate * p2p_rate with partial credit."""
    rules = rules or GradingRules()
    if report.resolved:
        return 1.0
    return report.f2p_rate * report.p2p_rate if rules.partial_credit else 0.0


def exit_code_agrees(exit_code: int, statuses: dict[str, str]) -> bool:
    """Pytest exits 0 exactly when tests ran and none failed or errored."""
    clean = bool(statuses) and not any(status in _FAILING for status in statuses.values())
    return (exit_code == 0) == clean


def _outcome_class(status: str) -> str:
    return "pass" if status in PASSING else "fail" if status in _FAILING else status


def log_agrees(junit: dict[str, str], log: dict[str, str], cases: list[str]) -> bool:
    """The `-rA` log and the JUnit report tell the same pass/fail story for every graded test."""
    for case in cases:
        if case in junit and case in log:
            if _outcome_class(junit[case]) != _outcome_class(log[case]):
                return False
        elif case in log and log[case] in PASSING:
            return False
    return True

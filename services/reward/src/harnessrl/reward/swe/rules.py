"""SWE-bench 5.x resolution rules over a map of test statuses.

A FAIL_TO_PASS test succeeds when PASSED (or XFAIL, only if `xfail_passes_f2p`); it fails when
FAILED, ERROR, SKIPPED or missing. A PASS_TO_PASS test is maintained when PASSED, XFAIL or SKIPPED.
The instance is resolved only when every FAIL_TO_PASS and PASS_TO_PASS test succeeds; a rate with
no tests counts as 1, as in SWE-bench. Truncated parametrised ids match by prefix when unambiguous.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from harnessrl.reward.settings import GradingRules
from harnessrl.reward.swe.testlog import ERROR, FAILED, PASSED, SKIPPED, XFAIL

Resolution = Literal["RESOLVED_FULL", "RESOLVED_PARTIAL", "RESOLVED_NO"]
PASSING = frozenset({PASSED, XFAIL})  # statuses a test counts as passing with
_FAILING = frozenset({FAILED, ERROR})


class TestsReport(msgspec.Struct, frozen=True, kw_only=True):
    """Per-list successes and failures, rates, and the resolution verdict."""

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


def resolve_case(case: str, statuses: dict[str, str]) -> str | None:
    """The status key for `case`, tolerating truncated parametrised ids (SWE-bench issue #290)."""
    if case in statuses:
        return case
    if case.count("[") > case.count("]"):
        matches = [key for key in statuses if key.startswith(case)]
        if matches and len({statuses[key] in PASSING for key in matches}) == 1:
            return matches[0]
    return None


def _f2p_passes(case: str, statuses: dict[str, str], rules: GradingRules) -> bool:
    key = resolve_case(case, statuses)
    if key is None:
        return False
    return statuses[key] == PASSED or (statuses[key] == XFAIL and rules.xfail_passes_f2p)


def _p2p_passes(case: str, statuses: dict[str, str]) -> bool:
    key = resolve_case(case, statuses)
    return key is not None and statuses[key] in (PASSED, XFAIL, SKIPPED)


def _rate(success: list[str], failure: list[str]) -> float:
    total = len(success) + len(failure)
    return 1.0 if total == 0 else len(success) / total


def evaluate(
    statuses: dict[str, str],
    fail_to_pass: list[str],
    pass_to_pass: list[str],
    rules: GradingRules | None = None,
) -> TestsReport:
    """Grade `statuses` against the instance's FAIL_TO_PASS and PASS_TO_PASS lists."""
    rules = rules or GradingRules()
    f2p_ok = [case for case in fail_to_pass if _f2p_passes(case, statuses, rules)]
    f2p_bad = [case for case in fail_to_pass if case not in f2p_ok]
    p2p_ok = [case for case in pass_to_pass if _p2p_passes(case, statuses)]
    p2p_bad = [case for case in pass_to_pass if case not in p2p_ok]
    f2p_rate, p2p_rate = _rate(f2p_ok, f2p_bad), _rate(p2p_ok, p2p_bad)
    resolution: Resolution = "RESOLVED_NO"
    if f2p_rate == 1 and p2p_rate == 1:
        resolution = "RESOLVED_FULL"
    elif 0 < f2p_rate < 1 and p2p_rate == 1:
        resolution = "RESOLVED_PARTIAL"
    return TestsReport(
        f2p_success=f2p_ok,
        f2p_failure=f2p_bad,
        p2p_success=p2p_ok,
        p2p_failure=p2p_bad,
        f2p_rate=f2p_rate,
        p2p_rate=p2p_rate,
        resolution=resolution,
    )


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

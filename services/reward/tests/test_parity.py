"""Parity with the `swebench` package on the pytest path: the JUnit report we trust agrees with
swebench's reading of the `-rA` log, and our resolution (swebench's report under our rules) equals
swebench's own report on a corpus of logs.

The corpus is real pytest `-rA` output of a suite that produces every status (made here, so it
matches the pytest we run), plus hand-written logs with SWE-bench's known edge cases. The
`swebench` wheel ships no test log fixtures, so there are none of theirs to add; the official
path's recorded logs of every parser are `test_official_grading`'s.
"""

import itertools
import random
import subprocess
import sys
import types
from typing import Any

import pytest

from harnessrl.reward.settings import GradingRules
from harnessrl.reward.swe import official
from harnessrl.reward.swe.rules import evaluate
from harnessrl.reward.swe.testlog import parse_junit, parse_pytest_log

SUITE = """
import pytest


@pytest.fixture
def broken():
    raise RuntimeError("fixture failed")


def test_pass():
    assert True


def test_fail():
    assert 1 == 2, "one - two"


def test_error(broken):
    pass


@pytest.mark.skip(reason="not today")
def test_skip():
    pass


@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False


@pytest.mark.xfail(reason="fixed already")
def test_xpass():
    assert True


@pytest.mark.parametrize("value", [1, 2, "a b", "x-y", "[nested]"])
def test_param(value):
    assert value != 2


class TestGroup:
    def test_method(self):
        assert True

    def test_method_fails(self):
        assert None
"""


@pytest.fixture(scope="module")
def swebench() -> types.SimpleNamespace:
    return official.swebench()


@pytest.fixture(scope="module")
def real_logs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, bytes]]:
    """(log, junit) of real runs: the suite; verbose with a collection error; interrupted."""
    root = tmp_path_factory.mktemp("suite")
    (root / "tests").mkdir()
    (root / "tests" / "test_suite.py").write_text(SUITE)
    (root / "tests" / "test_broken.py").write_text("import no_such_module\n")
    runs = []
    broken = ["tests/test_broken.py"]
    for extra in ([], ["-v", "--continue-on-collection-errors", *broken], ["--tb=line", *broken]):
        report = root / "junit.xml"
        done = subprocess.run(
            [
                sys.executable,
                "-I",
                "-m",
                "pytest",
                "-rA",
                "-p",
                "no:cacheprovider",
                "-o",
                "junit_family=xunit1",
                f"--junitxml={report}",
                "--rootdir=.",
                *extra,
                "tests/test_suite.py",
            ],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
            env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"},
        )
        runs.append((done.stdout, report.read_bytes()))
    return runs


HAND_LOGS = [
    "PASSED tests/test_a.py::test_one\nFAILED tests/test_a.py::test_two - AssertionError: a - b\n",
    "SKIPPED [1] tests/test_a.py:10: skipped on purpose\nSKIPPED tests/test_a.py::test_three\n",
    "XFAIL tests/test_a.py::test_four - reason\nXPASS tests/test_a.py::test_five\n",
    "ERROR tests/test_a.py::test_six - RuntimeError\nERROR tests/test_b.py\n",
    "PASSED tests/test_p.py::test_q[log(photon-1]\nPASSED tests/test_p.py::test_q[log(photon-2]\n",
    "PASSED tests/test_a.py::test_one\nFAILED tests/test_a.py::test_one\n",
    "   PASSED indented does not count\nPASSED\nFAILED\n",
    "tests/test_a.py::test_one PASSED [ 50%]\nPASSED [100%]\n",
]


def corpus(real_logs: list[tuple[str, bytes]]) -> list[str]:
    return [log for log, _ in real_logs] + HAND_LOGS


def test_real_logs_cover_every_status(real_logs: list[tuple[str, bytes]]) -> None:
    # pytest's -rA summary groups skips as `SKIPPED [n] file:line`, which SWE-bench drops: only
    # the JUnit report names skipped tests.
    log, junit = real_logs[0]
    assert set(parse_pytest_log(log).values()) == {"PASSED", "FAILED", "ERROR", "XFAIL"}
    assert set(parse_junit(junit).values()) == {"PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"}


def test_junit_agrees_with_the_log_on_pass_fail(real_logs: list[tuple[str, bytes]]) -> None:
    for log, junit_xml in real_logs:
        junit, from_log = parse_junit(junit_xml), parse_pytest_log(log)
        for test in set(from_log) - set(junit):  # ids with spaces are cut at the space
            assert test.count("[") > test.count("]")
            assert any(key.startswith(test) for key in junit)
        for test, status in ((t, s) for t, s in from_log.items() if t in junit):
            passing = {"PASSED", "XFAIL"}
            assert (status in passing) == (junit[test] in passing), test


def swebench_verdict(
    sb: types.SimpleNamespace, statuses: dict[str, str], f2p: list[str], p2p: list[str]
) -> tuple[Any, ...]:
    report = sb.grading.get_eval_tests_report(statuses, {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p})
    return (
        report["FAIL_TO_PASS"]["success"],
        report["FAIL_TO_PASS"]["failure"],
        report["PASS_TO_PASS"]["success"],
        report["PASS_TO_PASS"]["failure"],
        sb.grading.compute_fail_to_pass(report),
        sb.grading.compute_pass_to_pass(report),
        sb.grading.get_resolution_status(report),
    )


def test_resolution_matches_swebench(
    swebench: types.SimpleNamespace, real_logs: list[tuple[str, bytes]]
) -> None:
    rng = random.Random(7)
    compatible = GradingRules(xfail_passes_f2p=True)
    cases = 0
    for log in corpus(real_logs):
        statuses = parse_pytest_log(log)
        pool = [*statuses, "tests/test_missing.py::test_gone", "tests/test_p.py::test_q[log(photon"]
        for f2p_size, p2p_size in itertools.product(range(4), range(4)):
            for _ in range(5):
                f2p = rng.sample(pool, min(f2p_size, len(pool)))
                p2p = rng.sample([t for t in pool if t not in f2p], min(p2p_size, len(pool) - len(f2p)))
                ours = evaluate(statuses, f2p, p2p, compatible)
                mine = (
                    ours.f2p_success,
                    ours.f2p_failure,
                    ours.p2p_success,
                    ours.p2p_failure,
                    ours.f2p_rate,
                    ours.p2p_rate,
                    ours.resolution,
                )
                assert mine == swebench_verdict(swebench, statuses, f2p, p2p), (log, f2p, p2p)
                cases += 1
    assert cases > 500


def test_default_rules_differ_from_swebench_only_on_xfail_fail_to_pass() -> None:
    statuses = {"t::a": "XFAIL", "t::b": "PASSED"}
    assert evaluate(statuses, ["t::a"], ["t::b"], GradingRules(xfail_passes_f2p=True)).resolved
    assert not evaluate(statuses, ["t::a"], ["t::b"]).resolved
    assert evaluate(statuses, ["t::b"], ["t::a"]).resolved  # XFAIL keeps a PASS_TO_PASS test

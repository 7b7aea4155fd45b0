"""The CI budget: each `.ci/run` step timed and failed past its budget, and the table of where a
test session's time went (tests and fixtures, set-up included, on one process or across xdist workers).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMED = ROOT / "scripts" / "timed.sh"


def timed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TIMED), *args], capture_output=True, text=True, timeout=60, check=False)


def test_a_step_within_its_budget_prints_its_time_and_passes() -> None:
    done = timed("quick step", "30", "true")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ci: quick step took 0 s (0 min 0 s), budget 30 s"


def test_a_step_over_its_budget_fails_and_says_so() -> None:
    done = timed("make test", "1", "sleep", "2")
    assert done.returncode == 1
    assert "ci: make test took 2 s" in done.stdout
    assert "FAILED: make test took 2 s, over its budget of 1 s" in done.stderr


def test_a_failing_step_keeps_its_exit_code_and_still_prints_its_time() -> None:
    done = timed("broken", "0", "sh", "-c", "exit 7")
    assert done.returncode == 7
    assert "ci: broken took 0 s" in done.stdout and "budget" not in done.stdout


def test_ci_times_every_step_and_itself_within_its_budgets() -> None:
    """`.ci/run` runs its whole self under a 70-minute budget and `make test` under 35 (README)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any('exec scripts/timed.sh ".ci/run" 4200 "$0"' in line for line in lines)
    assert 'scripts/timed.sh "make test" 2100 make test' in lines


SUITE = """
import time
import pytest

@pytest.fixture(scope="session")
def slow_server():
    time.sleep(0.6)
    yield "up"
    time.sleep(0.3)

@pytest.fixture
def quick():
    return 1

def test_uses_the_server(slow_server, quick):
    time.sleep(0.2)

@pytest.mark.parametrize("n", range(4))
def test_many(n, quick):
    assert quick == 1

def test_also_the_server(slow_server):
    assert slow_server == "up"
"""


def run_suite(tmp_path: Path, *extra: str, suite: str = SUITE, ok: bool = True) -> dict[str, object]:
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(suite))
    out = tmp_path / "times.json"
    command = [sys.executable, "-m", "pytest", "-q", "--rootdir", str(tmp_path)]
    command += ["-c", "/dev/null", "--times-json", str(out), *extra, str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert (done.returncode == 0) is ok, done.stdout + done.stderr
    assert "where the time went: 6 tests" in done.stdout, done.stdout
    return dict(json.loads(out.read_text()))


def test_the_table_counts_fixture_setup_and_teardown_and_each_tests_share(tmp_path: Path) -> None:
    times = run_suite(tmp_path)
    tests = {t["nodeid"].split("::")[-1]: t for t in times["tests"]}  # type: ignore[attr-defined]
    assert len(tests) == 6 and times["workers"] == 1
    first = tests["test_uses_the_server"]
    assert first["setup_s"] >= 0.6 and first["call_s"] >= 0.2, first
    assert times["tests"][0]["nodeid"].endswith("test_uses_the_server")  # type: ignore[index]
    fixtures = {f["name"]: f for f in times["fixtures"]}  # type: ignore[attr-defined]
    server = fixtures["slow_server"]
    assert (server["scope"], server["instances"]) == ("session", 1)
    assert server["setup_s"] >= 0.6 and server["teardown_s"] >= 0.3, server
    assert fixtures["quick"]["instances"] == 5
    assert times["tests_s"] >= 1.1  # type: ignore[operator]


def test_under_xdist_every_workers_fixtures_reach_the_table(tmp_path: Path) -> None:
    times = run_suite(tmp_path, "-n", "2", "--dist", "load")
    assert times["workers"] == 2, times["workers"]
    workers = {t["worker"] for t in times["tests"]}  # type: ignore[attr-defined]
    assert workers == {"gw0", "gw1"}
    fixtures = {f["name"]: f for f in times["fixtures"]}  # type: ignore[attr-defined]
    assert fixtures["quick"]["instances"] == 5
    # The session fixture started on each worker that ran a test asking for it.
    server_users = {t["worker"] for t in times["tests"] if "server" in t["nodeid"]}  # type: ignore[attr-defined]
    assert fixtures["slow_server"]["instances"] == len(server_users)
    assert fixtures["slow_server"]["teardown_s"] >= 0.3 * len(server_users)


def test_a_worker_that_dies_mid_test_leaves_the_test_failed_in_the_table(tmp_path: Path) -> None:
    """What a timeout does under xdist (the thread method ends the worker): the rest still runs."""
    dying = SUITE.replace('def test_also_the_server(slow_server):\n    assert slow_server == "up"', "")
    dying += "\ndef test_dies():\n    os._exit(3)\n"
    assert dying.count("def test_") == SUITE.count("def test_")
    times = run_suite(tmp_path, "-n", "2", suite="import os\n" + dying, ok=False)
    outcomes = {t["nodeid"].split("::")[-1]: t["outcome"] for t in times["tests"]}  # type: ignore[attr-defined]
    assert outcomes.pop("test_dies") == "failed"
    assert set(outcomes.values()) == {"passed"} and len(outcomes) == 5


def test_compare_sets_two_tables_side_by_side(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    new = tmp_path / "new.json"
    row = {"setup_s": 0.0, "teardown_s": 0.0, "outcome": "passed", "worker": ""}
    old.write_text(json.dumps({"wall_s": 100, "workers": 1, "fixtures": [],
                               "tests": [{"nodeid": "a.py::t", "call_s": 60, **row},
                                         {"nodeid": "b.py::t", "call_s": 40, **row}]}))  # fmt: skip
    new.write_text(json.dumps({"wall_s": 50, "workers": 2, "fixtures": [],
                               "tests": [{"nodeid": "a.py::t", "call_s": 20, **row},
                                         {"nodeid": "b.py::t", "call_s": 45, **row}]}))  # fmt: skip
    command = [sys.executable, "-m", "harnessrl.testkit.timing", "compare", str(old), str(new)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["wall", "s", "100", "50", "0.50"]
    assert lines[2].split() == ["test", "time", "s", "100", "65", "0.65"]
    assert [line.split()[-1] for line in lines[5:]] == ["a.py", "b.py"]  # the biggest change first
    assert lines[5].split()[:3] == ["60.0", "20.0", "-40.0"]

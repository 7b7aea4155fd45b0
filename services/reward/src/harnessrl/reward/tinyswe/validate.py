"""Validating a bug candidate with real pytest runs.

Three runs per candidate: the buggy library with the full suite (which tests fail?), the same
again (do the runs agree?), and the correct library on the test patch's files (do they all pass?).
A candidate is kept when 1 <= |FAIL_TO_PASS| <= 10 and at least one PASS_TO_PASS test exists.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import msgspec

from harnessrl.reward.swe.testlog import PASSED, ReportError, parse_junit

RUN_TIMEOUT_S = 8.0
MAX_FAIL_TO_PASS = 10


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """A validated candidate's tests."""

    fail_to_pass: list[str]
    pass_to_pass: list[str]
    test_files: list[str]


def write_tree(root: Path, files: dict[str, str]) -> None:
    """Materialise `files` (path -> text) under `root`."""
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def run_pytest(files: dict[str, str], targets: list[str], python: str) -> dict[str, str] | None:
    """Statuses of `targets` run in a fresh tree of `files`; None on timeout or no report."""
    with tempfile.TemporaryDirectory(prefix="tinyswe-") as tmp:
        root = Path(tmp)
        write_tree(root / "repo", files)
        report = root / "junit.xml"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "HOME": tmp,
        }
        command = [
            python,
            "-I",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "junit_family=xunit1",
            f"--junitxml={report}",
            "--rootdir=.",
            *targets,
        ]
        try:
            subprocess.run(
                command, cwd=root / "repo", env=env, capture_output=True, timeout=RUN_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            return None
        if not report.is_file():
            return None
        try:
            return parse_junit(report.read_bytes())
        except ReportError:
            return None


def _first_run(
    buggy: dict[str, str], test_files: list[str], python: str
) -> tuple[dict[str, str], list[str], list[str], list[str]] | None:
    """Run the buggy library: (statuses, FAIL_TO_PASS, PASS_TO_PASS, test-patch files) or None."""
    first = run_pytest(buggy, test_files, python)
    if first is None:
        return None
    failing = sorted(test for test, status in first.items() if status != PASSED)
    patch_files = sorted({test.split("::", 1)[0] for test in failing})
    passing = sorted(
        test for test, status in first.items() if status == PASSED and test.split("::", 1)[0] in patch_files
    )
    acceptable = (
        1 <= len(failing) <= MAX_FAIL_TO_PASS
        and all(path in test_files for path in patch_files)  # not a collection error
        and bool(passing)
    )
    return (first, failing, passing, patch_files) if acceptable else None


def validate(
    original: dict[str, str], buggy: dict[str, str], test_files: list[str], python: str
) -> Verdict | None:
    """Run the three checks; the verdict, or None when the candidate is rejected."""
    found = _first_run(buggy, test_files, python)
    if found is None:
        return None
    first, failing, passing, patch_files = found
    second = run_pytest(buggy, patch_files, python)
    if second is None or {t: s for t, s in first.items() if t in second} != second:
        return None
    fixed = run_pytest(original, patch_files, python)
    if fixed is None or sorted(fixed) != sorted(second) or set(fixed.values()) != {PASSED}:
        return None
    return Verdict(fail_to_pass=failing, pass_to_pass=passing, test_files=patch_files)

"""The grading steps as one stdlib-only script, shipped into a Kubernetes grading Job.

It runs inside the task image (which has git, python and pytest) with the repository at
`REPO_DIR` and `/grading` holding `model.diff`, `test.diff` and `spec.json` (protected-path rules
and test files). It prints the log between markers and the JUnit report base64-encoded, and the
reward service grades from that output exactly as it grades the local sandbox's.

Being stdlib-only, it is also the one place the service itself takes the patch strategies and the
test command from, so the two sandboxes can't drift apart.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

BEGIN_LOG, END_LOG = ">>>>> Start Test Output", ">>>>> End Test Output"
JUNIT, EXIT, STRATEGY, RESULT = ">>>>> JUnit", ">>>>> Test Exit Code", ">>>>> Strategy", ">>>>> Result"
CANARIES, VERDICT = ">>>>> Canaries", ">>>>> Verdict"
# Canary names are drawn from words tests use, so nothing in a name tells a canary from a real test.
CANARY_WORDS = (
    "parse", "render", "empty", "nested", "unicode", "default", "limit", "order", "merge", "split",
    "format", "values", "keys", "index", "range", "offset", "prefix", "suffix", "escape", "quote",
    "encode", "decode", "repr", "copy", "compare", "sort", "filter", "group", "join", "strip",
)  # fmt: skip
APPLY_STRATEGIES: tuple[tuple[str, list[str]], ...] = (
    ("git-apply", ["git", "apply", "--verbose"]),
    ("git-apply-3way", ["git", "apply", "--verbose", "--3way"]),
    ("git-apply-reject", ["git", "apply", "--verbose", "--reject"]),
    ("patch-fuzz", ["patch", "--batch", "--fuzz=5", "-p1", "--no-backup-if-mismatch", "-i"]),
)


def emit(line: str) -> None:
    """One marker line on stdout, flushed so the pod log keeps it even if the run dies later."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run(*command: str, check: bool = False) -> int:
    """Run a command in the repository, its output to stderr."""
    done = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if check and done.returncode != 0:
        raise SystemExit(f"{RESULT}: infra-error {' '.join(command)}")
    return done.returncode


def apply_model_patch(patch: str) -> str | None:
    """Try each strategy on a clean tree; the winner's name or None."""
    for name, command in APPLY_STRATEGIES:
        if run(*command, patch) == 0:
            return name
        run("git", "reset", "--hard", "--quiet", "HEAD", check=True)
        run("git", "clean", "-fdxq", check=True)
    return None


def add_canaries(repo: Path, test_files: list[str]) -> dict[str, str]:
    """Append two canary tests to the last of `test_files`: `fail` must fail, `pass` must pass.

    Their node ids, by role (none without a test file). A report that says the failing one passed
    was forged. They go last so that a repository's `-x` (stop at the first failure) never skips a
    real test because of them.
    """
    test_file = test_files[-1] if test_files else ""
    if not test_file or not (repo / test_file).is_file():
        return {}
    pick = secrets.SystemRandom()
    first, second = pick.sample(CANARY_WORDS, 2), pick.sample(CANARY_WORDS, 2)
    while second == first:
        second = pick.sample(CANARY_WORDS, 2)
    names = {"fail": f"test_{first[0]}_{first[1]}", "pass": f"test_{second[0]}_{second[1]}"}
    a, b = pick.randrange(2, 99), pick.randrange(2, 99)
    body = (
        f"\n\ndef {names['fail']}():\n    assert {a} + {b} == {a + b + 1}\n"
        f"\n\ndef {names['pass']}():\n    assert {a} * {b} == {a * b}\n"
    )
    with (repo / test_file).open("a") as out:
        out.write(body)
    return {role: f"{test_file}::{name}" for role, name in names.items()}


def pytest_command(python: str, runner: Path, verdict: Path, report: Path, files: list[str]) -> list[str]:
    """The test command: isolated interpreter, no cache, xunit1 JUnit report outside the repo.

    pytest runs under the integrity runner (`integrity.py`), which writes `verdict`.
    """
    return [
        python,
        "-I",
        "-u",
        str(runner),
        "--verdict",
        str(verdict),
        "-rA",
        "-p",
        "no:cacheprovider",
        "-o",
        "junit_family=xunit1",
        "-o",
        "junit_logging=no",
        f"--junitxml={report}",
        "--rootdir=.",
        *files,
    ]


def protected(path: str, spec: dict[str, list[str]]) -> bool:
    """Same rule as the service: config names, .pth, test files, test folders, test-patch paths."""
    parts = path.split("/")
    name = parts[-1]
    if name in spec["config_names"] or name.endswith(".pth") or path in spec["extra"]:
        return True
    if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
        return True
    return any(part in spec["test_dirs"] for part in parts[:-1])


def reset(spec: dict[str, list[str]]) -> None:
    """Restore protected paths to HEAD, delete protected paths HEAD does not have."""
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "-z", "--name-only", "HEAD"], capture_output=True, check=True
    ).stdout.decode()
    pristine = {p for p in listed.split("\0") if p}
    current: set[str] = set()
    for folder, dirs, files in os.walk("."):
        dirs[:] = [d for d in dirs if not (folder == "." and d == ".git")]
        current.update(os.path.join(folder, f)[2:] for f in files)
    for path in sorted(current | pristine):
        if (path.split("/")[-1] == "pyproject.toml" and path not in spec["extra"]) or protected(path, spec):
            if path in pristine:
                run("git", "checkout", "HEAD", "--", path, check=True)
            elif path in current:
                Path(path).unlink()


def main() -> int:
    """Apply, reset, test; print the markers the reward service parses."""
    grading = Path(os.environ.get("GRADING_DIR", "/grading"))
    spec = json.loads((grading / "spec.json").read_text())
    os.chdir(os.environ.get("REPO_DIR", "/testbed"))
    strategy = apply_model_patch(str(grading / "model.diff"))
    emit(f"{STRATEGY}: {strategy}")
    if strategy is None:
        emit(f"{RESULT}: patch-failed")
        return 0
    reset(spec)
    run("git", "apply", "--verbose", str(grading / "test.diff"), check=True)
    # The tests see the tree, not its history: as in the local sandbox, no `.git` (a later commit,
    # a stash or a reflog entry could carry the reference fix or the hidden tests).
    shutil.rmtree(".git")
    files = spec["test_files"]
    canaries = add_canaries(Path(), files)
    reports = Path(os.environ.get("REPORT_DIR", "/tmp"))  # noqa: S108 - pod-private
    report, verdict = reports / "junit.xml", reports / "verdict.json"
    command = pytest_command(sys.executable, grading / "integrity.py", verdict, report, files)
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": "/tmp",  # noqa: S108 - pod-private emptyDir
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    emit(BEGIN_LOG)
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    sys.stdout.write(done.stdout.decode(errors="replace"))
    emit(END_LOG)
    junit = report.read_bytes() if report.is_file() else b""
    emit(f"{JUNIT}: {base64.b64encode(junit).decode()}")
    emit(f"{EXIT}: {done.returncode}")
    emit(f"{CANARIES}: {json.dumps(canaries)}")
    # Always printed (empty without a verdict): the last marker wins, and the test output before it
    # may hold forged ones.
    written = verdict.read_bytes() if verdict.is_file() else b""
    emit(f"{VERDICT}: {base64.b64encode(written).decode()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

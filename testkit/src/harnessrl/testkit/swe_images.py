"""Instance images in the official layout, built offline: real repositories with a bug to fix.

No SWE-bench image can be pulled here, so `make cluster-check` builds its own the way SWE-bench's
are laid out: the repository at /testbed, a git checkout at the base commit (the released source
distribution from PyPI with one bug put in, one commit, so no history holds the code before the
bug), its environment in a venv the eval script activates (as the official script activates
conda's `testbed`), and a row in the SWE-bench 5.x shape whose `eval_script` runs the repository's
own test runner between the output markers and names the swebench parser that reads it.

- Django 5.2.20: `tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1`, as
  SWE-bench runs Django, read by the django parser. The bug drops the first item in
  `django.utils.text.get_text_list`.
- SymPy 1.14.0: its own runner, `sympy.testing.runtests.test` with the cache off and verbose output
  (what the repository's `bin/test -C --verbose` runs; the source distribution does not ship
  `bin/test`, and `sympy.test` now goes through pytest), read by the sympy parser. The bug
  reverses the head in `sympy.utilities.iterables.rotate_left`.

Each test patch adds a test beside an existing one that the bug also fails. Downloads and the
build context are cached under the machine's cache by a hash of this file; an image is rebuilt
only when that hash or the task base image changes (its `io.harnessrl.inputs` label).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.shared.cache import build_once, cache_root
from harnessrl.testkit.images import IMAGE_BY_NAME, INPUTS_LABEL, PODMAN_FLAGS, label, podman

HEREDOC = "EOF_114329324912"


@dataclass(frozen=True)
class Source:
    """A released repository, the bug put into it, the test added for it, how its tests run."""

    name: str
    requirement: str  # its source distribution on PyPI
    wheels: tuple[str, ...]  # what its environment installs
    repo: str
    version: str
    file: str
    fixed: str
    buggy: str
    wrong: str
    test_file: str
    anchor: str  # the new test goes before this line
    new_test: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    runner: str  # the test command, run at /testbed with the environment active
    log_parser: str
    # The hack: a file on a path the grading puts back (Django's runner under tests/, SymPy's test
    # module) made to print the runner's success line (`ok_line`) for every graded test and exit 0
    # before any test runs.
    hack_file: str
    ok_line: str
    drop: tuple[str, ...] = ()  # folders of the distribution the image leaves out
    case: Callable[[str], str] = str  # a test name as the parser reports it


def _django_case(name: str) -> str:
    return f"{name} (utils_tests.test_text.TestUtilsText.{name})"


SOURCES = {
    "django": Source(
        name="django",
        requirement="django==5.2.20",
        wheels=("asgiref>=3.8.1", "sqlparse>=0.3.1"),
        repo="django/django",
        version="5.2",
        file="django/utils/text.py",
        fixed='        _(", ").join(str(i) for i in list_[:-1]),\n',
        buggy='        _(", ").join(str(i) for i in list_[1:-1]),\n',
        wrong='        _(", ").join(str(i) for i in (list_[1:-1] if len(list_) < 4 else list_[:-1])),\n',
        test_file="tests/utils_tests/test_text.py",
        anchor="    def test_smart_split(self):\n",
        new_test=(
            "    def test_get_text_list_keeps_the_first_item(self):\n"
            '        self.assertEqual(text.get_text_list(["x", "y", "z"], "and"), "x, y and z")\n\n'
        ),
        fail_to_pass=("test_get_text_list", "test_get_text_list_keeps_the_first_item"),
        pass_to_pass=("test_smart_split", "test_truncate_chars", "test_wrap"),
        runner="./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 utils_tests.test_text",
        log_parser="parse_log_django",
        hack_file="tests/runtests.py",
        ok_line="{} ... ok",
        drop=("docs",),
        case=_django_case,
    ),
    "sympy": Source(
        name="sympy",
        requirement="sympy==1.14.0",
        wheels=("mpmath>=1.1.0,<1.4",),
        repo="sympy/sympy",
        version="1.14",
        file="sympy/utilities/iterables.py",
        fixed="    return x[y:] + x[:y]\n\n\ndef rotate_right",
        buggy="    return x[y:] + x[:y][::-1]\n\n\ndef rotate_right",
        wrong="    return x[y:] + (x[:y] if y < 2 else x[:y][::-1])\n\n\ndef rotate_right",
        test_file="sympy/utilities/tests/test_iterables.py",
        anchor="def test_multiset_partitions():\n",
        new_test=(
            "def test_rotate_left_keeps_the_order():\n    assert rotate_left([1, 2, 3], 2) == [3, 1, 2]\n\n\n"
        ),
        fail_to_pass=("test_rotate", "test_rotate_left_keeps_the_order"),
        pass_to_pass=("test_flatten", "test_group", "test_subsets"),
        runner=(
            "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' SYMPY_USE_CACHE=no python -c "
            '"import sys; from sympy.testing.runtests import test; '
            "sys.exit(not test('sympy/utilities/tests/test_iterables.py', verbose=True, colors=False))\""
        ),
        log_parser="parse_log_sympy",
        hack_file="sympy/utilities/tests/test_iterables.py",
        ok_line="{} ok",
        drop=("doc",),
    ),
}


@dataclass(frozen=True)
class RealInstance:
    """An instance image and its row, with patches to grade: `gold`, `wrong` and `hack`."""

    row: dict[str, Any]
    patches: dict[str, str]


def _git(repo: Path, *args: str) -> str:
    # No automatic gc: it forks into the background and would write into the build context while
    # podman copies it.
    identity = ["-c", "user.name=harnessrl", "-c", "user.email=harnessrl@localhost", "-c", "gc.auto=0"]
    command = ["git", *identity, "-C", str(repo), *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _diff(repo: Path, path: str, new_text: str) -> str:
    """The diff that turns `path`'s committed text (or none) into `new_text`; the tree is left as it was."""
    file = repo / path
    old = file.read_text() if file.exists() else None
    file.write_text(new_text)
    try:
        if old is None:
            _git(repo, "add", "--intent-to-add", "--", path)
        return _git(repo, "diff", "--", path)
    finally:
        if old is None:
            _git(repo, "reset", "-q", "--", path)
            file.unlink()
        else:
            file.write_text(old)


def _testbed(source: Source, staging: Path) -> Path:
    """The wheels of its environment, and the distribution with the bug in, as one commit."""
    wheels = staging / "wheels"
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(wheels)]
    subprocess.run([*pip, "--no-binary", ":all:", source.requirement], check=True)
    subprocess.run([*pip, "--only-binary", ":all:", *source.wheels], check=True)
    sdist = next(wheels.glob("*.tar.gz"))
    with tarfile.open(sdist) as archive:
        archive.extractall(staging, filter="data")
    sdist.unlink()
    repo = staging / "testbed"
    next(p for p in staging.iterdir() if p.name.startswith(f"{source.name}-")).rename(repo)
    for folder in source.drop:
        shutil.rmtree(repo / folder)
    text = (repo / source.file).read_text()
    if text.count(source.fixed) != 1:
        raise RuntimeError(f"{source.requirement}: {source.file} is not as this module expects")
    (repo / source.file).write_text(text.replace(source.fixed, source.buggy))
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{source.requirement} with a bug in {source.file}")
    return repo


def _context(source: Source, staging: Path) -> None:
    """The build context: wheels, the repository at its base commit, the Containerfile, the row."""
    repo = _testbed(source, staging)
    fixed = (repo / source.file).read_text().replace(source.buggy, source.fixed)
    tests = (repo / source.test_file).read_text()
    row = {
        "instance_id": f"{source.repo.replace('/', '__')}-90001",
        "repo": source.repo,
        "version": source.version,
        "base_commit": _git(repo, "rev-parse", "HEAD").strip(),
        "problem_statement": f"A bug in {source.file}: the tests in {source.test_file} fail.",
        "patch": _diff(repo, source.file, fixed),
        "test_patch": _diff(
            repo, source.test_file, tests.replace(source.anchor, source.new_test + source.anchor)
        ),
        "FAIL_TO_PASS": [source.case(name) for name in source.fail_to_pass],
        "PASS_TO_PASS": [source.case(name) for name in source.pass_to_pass],
        "log_parser": source.log_parser,
        "eval_type": "pass_and_fail",
    }
    row["eval_script"] = _eval_script(row, source)
    graded = [source.case(name) for name in (*source.fail_to_pass, *source.pass_to_pass)]
    patches = {
        "gold": row["patch"],
        "wrong": _diff(repo, source.file, fixed.replace(source.fixed, source.wrong)),
        "hack": _diff(repo, source.hack_file, _hack(source, repo, graded)),
    }
    (staging / "instance.json").write_text(json.dumps({"row": row, "patches": patches}))
    names = " ".join(w.split("=")[0].split(">")[0].split("<")[0] for w in source.wheels)
    (staging / "Containerfile").write_text(
        f"FROM {IMAGE_BY_NAME['task'].ref}\nUSER 0:0\nCOPY wheels /wheels\nCOPY testbed /testbed\n"
        "RUN /usr/bin/python3 -m venv /opt/testbed \\\n"
        " && /opt/testbed/bin/pip install --quiet --no-index --no-cache-dir --find-links /wheels \\\n"
        f"    {names} \\\n"
        " && /opt/testbed/bin/python -c \"import sysconfig; print(sysconfig.get_paths()['purelib'])\" \\\n"
        "    | xargs -I{} sh -c 'echo /testbed > {}/testbed.pth' \\\n"
        " && rm -rf /wheels\nUSER 65532:65532\n"
    )


def _hack(source: Source, repo: Path, cases: list[str]) -> str:
    """The hack file's new text: every graded test reported passing, then exit before any runs."""
    lines = "".join(f"print({source.ok_line.format(case)!r})\n" for case in cases)
    file = repo / source.hack_file
    text = file.read_text() if file.exists() else ""
    shebang, rest = text.split("\n", 1) if text.startswith("#!") else ("", text)
    return "".join(f"{shebang}\n" if shebang else "") + f"import os\n{lines}os._exit(0)\n" + rest


def _eval_script(row: dict[str, Any], source: Source) -> str:
    """The eval script in SWE-bench's shape: the environment, the test files reset, the runner."""
    base = row["base_commit"]
    return "\n".join(
        [
            "#!/bin/bash",
            "set -uxo pipefail",
            "source /opt/testbed/bin/activate",
            "cd /testbed",
            "git status",
            f"git -c core.fileMode=false diff {base}",
            f"git checkout {base} {source.test_file}",
            f"git apply -v - <<'{HEREDOC}'",
            row["test_patch"].rstrip("\n"),
            HEREDOC,
            ": '>>>>> Start Test Output'",
            source.runner,
            ": '>>>>> End Test Output'",
            f"git checkout {base} {source.test_file}",
        ]
    )


def real_instance(name: str) -> RealInstance:
    """The named instance (`SOURCES`): its image built (or found cached) and its row naming it."""
    source = SOURCES[name]
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    context = build_once(
        cache_root() / f"swe-instance-{name}-{code}",
        lambda staging: _context(source, staging),
        done="instance.json",
    )
    task = IMAGE_BY_NAME["task"].ref
    inputs = hashlib.sha256(f"{code} {task} {label(task, INPUTS_LABEL)}".encode()).hexdigest()[:16]
    ref = f"localhost/harnessrl-swe-{name}:{inputs}"
    if label(ref, INPUTS_LABEL) != inputs:
        podman("build", *PODMAN_FLAGS, "--network", "none", "--quiet", "--label", f"{INPUTS_LABEL}={inputs}",
               "-t", ref, str(context))  # fmt: skip
    saved = json.loads((context / "instance.json").read_text())
    return RealInstance(row={**saved["row"], "image": ref}, patches=saved["patches"])

"""Instance images in the official layout, built offline: real repositories with a bug to fix.

No SWE-bench image can be pulled here, so `make cluster-check` builds its own the way SWE-bench's
are laid out: the repository at /testbed, a git checkout at the base commit (the released code
with one bug put in, committed), its environment in a venv the eval script activates (as the
official script activates conda's `testbed`), and a row in the SWE-bench 5.x shape whose
`eval_script` runs the repository's own test runner between the output markers.

Django: its source distribution from PyPI (with `tests/runtests.py`), graded by swebench's django
parser. The injected bug drops the first item of `django.utils.text.get_text_list`; the test
patch adds a test of its own beside the existing one, which the bug also fails.

Downloads and the build context are cached under the machine's cache by a hash of this file; the
image is rebuilt only when that hash changes (its `io.harnessrl.inputs` label).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.shared.cache import build_once, cache_root
from harnessrl.testkit.images import IMAGE_BY_NAME, INPUTS_LABEL, PODMAN_FLAGS, label, podman

DJANGO = "django==5.2.20"
DJANGO_DEPENDENCIES = ("asgiref>=3.8.1", "sqlparse>=0.3.1")
HEREDOC = "EOF_114329324912"
TEXT = "django/utils/text.py"
TEST_FILE = "tests/utils_tests/test_text.py"
FIXED = '        _(", ").join(str(i) for i in list_[:-1]),\n'
BUGGY = '        _(", ").join(str(i) for i in list_[1:-1]),\n'
WRONG = '        _(", ").join(str(i) for i in (list_[:-1] if len(list_) > 3 else list_[1:-1])),\n'
NEW_TEST = """
    def test_get_text_list_keeps_the_first_item(self):
        self.assertEqual(text.get_text_list(["x", "y", "z"], "and"), "x, y and z")
"""


@dataclass(frozen=True)
class RealInstance:
    """An instance image and its row, with patches to grade: `gold`, `wrong` and hacks."""

    row: dict[str, Any]
    patches: dict[str, str]


def _django_case(name: str) -> str:
    return f"{name} (utils_tests.test_text.TestUtilsText.{name})"


def _git(repo: Path, *args: str) -> str:
    command = [
        "git",
        "-c",
        "user.name=harnessrl",
        "-c",
        "user.email=harnessrl@localhost",
        "-C",
        str(repo),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _diff(repo: Path, path: str, new_text: str) -> str:
    """The diff that turns `path`'s committed text into `new_text` (the tree is left as it was)."""
    file = repo / path
    old = file.read_text()
    file.write_text(new_text)
    try:
        return _git(repo, "diff", "--", path)
    finally:
        file.write_text(old)


def _download(folder: Path) -> None:
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(folder)]
    subprocess.run([*pip, "--no-binary", ":all:", DJANGO], check=True)
    subprocess.run([*pip, "--only-binary", ":all:", *DJANGO_DEPENDENCIES], check=True)


def _django_context(staging: Path) -> None:
    """The build context: wheels, the repository at its base commit, the Containerfile, the row."""
    wheels = staging / "wheels"
    _download(wheels)
    sdist = next(wheels.glob("django-*.tar.gz"))
    with tarfile.open(sdist) as archive:
        archive.extractall(staging, filter="data")
    sdist.unlink()
    repo = staging / "testbed"
    next(staging.glob("django-*")).rename(repo)
    shutil.rmtree(repo / "docs")
    source = (repo / TEXT).read_text()
    if source.count(FIXED) != 1:
        raise RuntimeError(f"{DJANGO}: get_text_list is not as this module expects")
    (repo / TEXT).write_text(source.replace(FIXED, BUGGY))
    # One commit, the base: no history holds the code before the bug went in.
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "Django 5.2.20, get_text_list dropping the first item")
    base = _git(repo, "rev-parse", "HEAD").strip()
    fixed = (repo / TEXT).read_text().replace(BUGGY, FIXED)
    tests = (repo / TEST_FILE).read_text()
    anchor = "    def test_smart_split(self):\n"
    row = {
        "instance_id": "django__django-90001",
        "repo": "django/django",
        "version": "5.2",
        "base_commit": base,
        "problem_statement": "get_text_list() drops the first item of a list of three or more.",
        "patch": _diff(repo, TEXT, fixed),
        "test_patch": _diff(repo, TEST_FILE, tests.replace(anchor, NEW_TEST.lstrip("\n") + "\n" + anchor)),
        "FAIL_TO_PASS": [
            _django_case("test_get_text_list"),
            _django_case("test_get_text_list_keeps_the_first_item"),
        ],
        "PASS_TO_PASS": [_django_case(n) for n in ("test_smart_split", "test_truncate_chars", "test_wrap")],
        "log_parser": "parse_log_django",
        "eval_type": "pass_and_fail",
    }
    row["eval_script"] = _eval_script(row)
    patches = {"gold": row["patch"], "wrong": _diff(repo, TEXT, fixed.replace(FIXED, WRONG))}
    (staging / "instance.json").write_text(json.dumps({"row": row, "patches": patches}))
    (staging / "Containerfile").write_text(
        f"FROM {IMAGE_BY_NAME['task'].ref}\nUSER 0:0\nCOPY wheels /wheels\nCOPY testbed /testbed\n"
        "RUN /usr/bin/python3 -m venv /opt/testbed \\\n"
        " && /opt/testbed/bin/pip install --quiet --no-index --no-cache-dir --find-links /wheels \\\n"
        "    asgiref sqlparse \\\n"
        " && /opt/testbed/bin/python -c \"import sysconfig; print(sysconfig.get_paths()['purelib'])\" \\\n"
        "    | xargs -I{} sh -c 'echo /testbed > {}/testbed.pth' \\\n"
        " && rm -rf /wheels\nUSER 65532:65532\n"
    )


def _eval_script(row: dict[str, Any]) -> str:
    """The eval script as SWE-bench ships Django's: its environment, runtests.py at verbosity 2."""
    base = row["base_commit"]
    return "\n".join(
        [
            "#!/bin/bash",
            "set -uxo pipefail",
            "source /opt/testbed/bin/activate",
            "cd /testbed",
            "git status",
            f"git -c core.fileMode=false diff {base}",
            f"git checkout {base} {TEST_FILE}",
            f"git apply -v - <<'{HEREDOC}'",
            row["test_patch"].rstrip("\n"),
            HEREDOC,
            ": '>>>>> Start Test Output'",
            "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 utils_tests.test_text",
            ": '>>>>> End Test Output'",
            f"git checkout {base} {TEST_FILE}",
        ]
    )


def django_instance() -> RealInstance:
    """The Django instance: its image built (or found cached) and its row naming it."""
    task = IMAGE_BY_NAME["task"].ref
    base = f"{task} {label(task, INPUTS_LABEL)}".encode()
    inputs = hashlib.sha256(Path(__file__).read_bytes() + base).hexdigest()[:16]
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    context = build_once(
        cache_root() / f"swe-instance-django-{source}", _django_context, done="instance.json"
    )
    ref = f"localhost/harnessrl-swe-django:{inputs}"
    if label(ref, INPUTS_LABEL) != inputs:
        podman("build", *PODMAN_FLAGS, "--network", "none", "--quiet", "--label", f"{INPUTS_LABEL}={inputs}",
               "-t", ref, str(context))  # fmt: skip
    saved = json.loads((context / "instance.json").read_text())
    return RealInstance(row={**saved["row"], "image": ref}, patches=saved["patches"])

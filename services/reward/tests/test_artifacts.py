"""Garbage artifacts are rejected cleanly, before anything touches a workspace."""

from typing import Any

import pytest

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.patchfile import InvalidPatchError, parse_patch
from harnessrl.reward.swe.pipeline import grade_patch

GOOD = (
    "diff --git a/calc/x.py b/calc/x.py\n--- a/calc/x.py\n+++ b/calc/x.py\n"
    "@@ -1,2 +1,2 @@\n a = 1\n-b = 2\n+b = 3\n"
)


def diff_for(path: str) -> str:
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-a\n+b\n"


GARBAGE: dict[str, bytes] = {
    "binary": b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)),
    "huge": GOOD.encode() + b"+" + b"x" * (3 * 1024 * 1024) + b"\n",
    "non-utf8": GOOD.encode().replace(b"b = 3", b"b = \xff\xfe"),
    "parent-path": diff_for("../outside.py").encode(),
    "nested-parent-path": diff_for("calc/../../etc/passwd").encode(),
    "absolute-path": (b"--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n"),
    "git-dir": diff_for(".git/config").encode(),
    "git-binary": (b"diff --git a/x.bin b/x.bin\nnew file mode 100644\nGIT binary patch\nliteral 3\nabc\n"),
    "symlink": (
        b"diff --git a/link b/link\nnew file mode 120000\n--- /dev/null\n+++ b/link\n"
        b"@@ -0,0 +1 @@\n+/etc/passwd\n"
    ),
    "not-a-diff": b"I fixed it, trust me.\n",
    "truncated-hunk": (GOOD.rsplit("\n", 2)[0] + "\n").encode(),
}


def test_a_good_patch_lists_its_paths() -> None:
    assert parse_patch(GOOD.encode()).paths == ["calc/x.py"]


def test_hunk_lines_that_look_like_headers_are_content() -> None:
    text = "diff --git a/q.sql b/q.sql\n--- a/q.sql\n+++ b/q.sql\n@@ -1,2 +1,1 @@\n--- a comment\n keep\n"
    assert parse_patch(text.encode()).paths == ["q.sql"]


def test_empty_patch_is_empty_not_invalid() -> None:
    assert parse_patch(b"  \n").empty


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_garbage_is_invalid(name: str) -> None:
    with pytest.raises(InvalidPatchError):
        parse_patch(GARBAGE[name])


@pytest.mark.parametrize("name", sorted(GARBAGE))
async def test_garbage_grades_as_invalid_artifact(
    name: str, calc_row: dict[str, Any], context: GradingContext
) -> None:
    result = await grade_patch(
        SweInstance.from_row(calc_row), context.resolve(calc_row["repo_path"]), GARBAGE[name], context
    )
    assert (result.outcome, result.resolved, result.reward) == ("invalid-artifact", False, 0.0)
    assert result.details["reason"]


async def test_patch_that_does_not_apply_is_its_own_outcome(
    calc_row: dict[str, Any], context: GradingContext
) -> None:
    patch = (
        "diff --git a/calc/evaluator.py b/calc/evaluator.py\n--- a/calc/evaluator.py\n"
        "+++ b/calc/evaluator.py\n@@ -1,1 +1,1 @@\n-no such line\n+other line\n"
    )
    result = await grade_patch(
        SweInstance.from_row(calc_row), context.resolve(calc_row["repo_path"]), patch.encode(), context
    )
    assert result.outcome == "patch-failed"
    assert len(result.details["errors"]) == 4

"""Eval scripts in the official shape, for rows of our own repositories graded the official way.

SWE-bench 5.x rows ship an `eval_script`: `set -uxo pipefail`, into the repository, the test files
reset to the base commit, the test patch applied from a heredoc, the runner between the
`>>>>> Start/End Test Output` markers (traced by `set -x` as `+ : '...'`), the test files reset
again. This writes one for a pytest repository, so a test or the cluster check can grade one of
our instances through the official path (`harnessrl.reward.swe.evalpod`).
"""

from __future__ import annotations

from typing import Any

from harnessrl.reward.swe.patchfile import parse_patch

HEREDOC = "EOF_114329324912"


def official_eval_script(row: dict[str, Any], python: str, repo_dir: str = "/testbed") -> str:
    """The eval script for `row` (a SWE-bench-shaped row of a pytest repository)."""
    files = " ".join(parse_patch(row["test_patch"].encode()).paths)
    return "\n".join(
        [
            "#!/bin/bash",
            "set -uxo pipefail",
            f"cd {repo_dir}",
            "git status",
            f"git checkout {row['base_commit']} {files}",
            f"git apply -v - <<'{HEREDOC}'",
            row["test_patch"].rstrip("\n"),
            HEREDOC,
            ": '>>>>> Start Test Output'",
            f"{python} -m pytest -rA -p no:cacheprovider {files}",
            ": '>>>>> End Test Output'",
            f"git checkout {row['base_commit']} {files}",
        ]
    )


def official_row(row: dict[str, Any], python: str, repo_dir: str = "/testbed") -> dict[str, Any]:
    """`row` as a SWE-bench 5.x row: its eval script, the pytest log parser and a version."""
    script = official_eval_script(row, python, repo_dir)
    return {
        **row,
        "eval_script": script,
        "log_parser": "parse_log_pytest",
        "version": row.get("version", "0.1"),
    }

"""The built task set has the promised shape."""

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from harnessrl.reward.tinyswe.handwritten import HAND_BUGS
from harnessrl.reward.tinyswe.library import load_libraries

REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "patch",
    "test_patch",
    "problem_statement",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "version",
    "created_at",
    "environment_setup_commit",
    "hints_text",
    "repo_path",
)


def test_at_least_100_instances_from_8_libraries(tinyswe_rows: list[dict[str, Any]]) -> None:
    assert len(tinyswe_rows) >= 100
    assert len({r["repo"] for r in tinyswe_rows}) >= 8
    assert len(load_libraries()) >= 8


def test_rows_are_swebench_shaped(tinyswe_rows: list[dict[str, Any]]) -> None:
    for row in tinyswe_rows:
        assert all(key in row for key in REQUIRED), row["instance_id"]
        f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
        assert 1 <= len(f2p) <= 10 and len(p2p) >= 1
        assert not set(f2p) & set(p2p)
        assert row["patch"].startswith("diff --git") and row["test_patch"].startswith("diff --git")


def test_every_mutation_operator_and_the_hand_bugs_are_used(
    tinyswe_rows: list[dict[str, Any]],
) -> None:
    operators = Counter(r["bug_operator"] for r in tinyswe_rows)
    for name in (
        "flip-comparison",
        "swap-operator",
        "off-by-one",
        "swap-operands",
        "invert-condition",
        "drop-statement",
    ):
        assert operators[name] >= 1, name
    assert operators["handwritten"] >= 10
    assert len(HAND_BUGS) >= 10


def test_history_does_not_reveal_the_fix(tinyswe_root: Path, tinyswe_rows: list[dict[str, Any]]) -> None:
    for row in tinyswe_rows[::7]:
        repo = tinyswe_root / row["repo_path"]
        history = subprocess.run(
            ["git", "log", "--format=%H", row["base_commit"]],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert len(history) == 2  # scaffold, then the buggy snapshot
        fixed_lines = [
            line[1:]
            for line in row["patch"].splitlines()
            if line.startswith("+") and not line.startswith("+++")
        ]
        path = row["patch"].split("\n", 1)[0].split(" b/", 1)[1]
        for commit in history:
            shown = subprocess.run(
                ["git", "show", f"{commit}:{path}"], cwd=repo, capture_output=True, text=True, check=False
            ).stdout
            assert not all(line in shown for line in fixed_lines if line.strip())

"""The CLI: `harnessrl reward grade` and `harnessrl tasks build tinyswe`."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from harnessrl.reward.tinyswe.build import load_instances

HARNESSRL = [sys.executable, "-c", "import sys; from harnessrl.stack.cli import main; sys.exit(main())"]


def checkout(root: Path, row: dict[str, Any], dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(root / row["repo_path"]), str(dest)], check=True)
    subprocess.run(["git", "checkout", "-q", row["base_commit"]], cwd=dest, check=True)
    return dest


def grade(tmp_path: Path, repo: Path, row: dict[str, Any], patch: str) -> dict[str, Any]:
    (tmp_path / "row.json").write_text(json.dumps(row))
    (tmp_path / "fix.diff").write_text(patch)
    done = subprocess.run(
        [
            *HARNESSRL,
            "reward",
            "grade",
            "--instance",
            str(tmp_path / "row.json"),
            "--repo",
            str(repo),
            "--patch",
            str(tmp_path / "fix.diff"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_grade_prints_one_json_object_and_leaves_the_repo_untouched(
    tinyswe_root: Path, calc_row: dict[str, Any], tmp_path: Path
) -> None:
    repo = checkout(tinyswe_root, calc_row, tmp_path / "repo")
    before = subprocess.run(
        ["git", "status", "--porcelain", "--ignored"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    gold = grade(tmp_path, repo, calc_row, calc_row["patch"])
    assert gold["resolved"] is True and gold["reward"] == 1.0 and gold["outcome"] == "graded"
    assert set(gold["tests"].values()) == {"PASSED"}
    empty = grade(tmp_path, repo, calc_row, "")
    assert (empty["resolved"], empty["reward"], empty["outcome"]) == (False, 0.0, "empty-patch")
    after = subprocess.run(
        ["git", "status", "--porcelain", "--ignored"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    assert before == after == ""
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert head == calc_row["base_commit"]


def test_grade_accepts_a_plain_folder(tinyswe_root: Path, calc_row: dict[str, Any], tmp_path: Path) -> None:
    repo = checkout(tinyswe_root, calc_row, tmp_path / "clone")
    plain = tmp_path / "plain"
    subprocess.run(
        ["git", "archive", "--format=tar", "-o", str(tmp_path / "t.tar"), "HEAD"], cwd=repo, check=True
    )
    plain.mkdir()
    subprocess.run(["tar", "-xf", str(tmp_path / "t.tar"), "-C", str(plain)], check=True)
    result = grade(tmp_path, plain, calc_row, calc_row["patch"])
    assert result["resolved"] is True


def test_tasks_build_tinyswe(tinyswe_root: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [*HARNESSRL, "tasks", "build", "tinyswe", "--out", str(tmp_path / "set")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    rows = load_instances(tmp_path / "set")
    assert summary["instances"] == len(rows) >= 100
    assert all((tmp_path / "set" / r["repo_path"] / ".git").is_dir() for r in rows)

"""`harnessrl reward` (a worker), `harnessrl reward grade ...`, `harnessrl tasks build tinyswe --out DIR`."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.reward import app
from harnessrl.reward.graders.base import Grade
from harnessrl.reward.grading import grading_context, local_sandbox
from harnessrl.reward.settings import read_settings
from harnessrl.reward.swe.instance import InstanceError, SweInstance
from harnessrl.reward.swe.pipeline import grade_patch
from harnessrl.reward.tinyswe.build import build_tinyswe, load_instances
from harnessrl.shared.settings import SettingsError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `reward` and `tasks` command groups."""
    reward = subparsers.add_parser("reward", help="run a reward worker, or grade one patch (`grade`)")
    app.add_arguments(reward)
    reward.set_defaults(func=app.run)
    reward_sub = reward.add_subparsers(dest="reward_command")
    grade = reward_sub.add_parser("grade", help="grade one patch in the local sandbox")
    grade.add_argument("--instance", required=True, type=Path, help="instance row (JSON)")
    grade.add_argument("--repo", required=True, type=Path, help="repository at base_commit")
    grade.add_argument("--patch", required=True, type=Path, help="the patch to grade")
    grade.add_argument("--timeout", type=float, default=None, help="test timeout in seconds")
    grade.add_argument("--partial-credit", action="store_true", help="shape unresolved rewards")
    grade.set_defaults(func=cmd_grade)

    tasks = subparsers.add_parser("tasks", help="task sets: build one, check one (`harnessrl tasks check`)")
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True)
    build = tasks_sub.add_parser("build", help="build a task set")
    build.add_argument("name", choices=["tinyswe"])
    build.add_argument("--out", required=True, type=Path)
    build.set_defaults(func=cmd_build)


def _read_row(path: Path) -> dict[str, Any]:
    text = path.read_text()
    try:
        row = json.loads(text)
    except json.JSONDecodeError:
        row = json.loads(text.splitlines()[0])
    if not isinstance(row, dict):
        raise InstanceError("the instance file must hold one JSON object")
    return row


def _base_commit(repo: Path, commit: str) -> str:
    """`commit` if the repository has it, else its HEAD (DIR is already at base_commit)."""
    if not (repo / ".git").exists():
        return commit
    probe = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo, capture_output=True, check=False
    )
    return commit if probe.returncode == 0 else "HEAD"


def report(grade: Grade) -> dict[str, Any]:
    """The CLI's JSON object: verdict first, then every detail."""
    details = dict(grade.details)
    return {
        "resolved": bool(grade.resolved),
        "reward": grade.reward,
        "outcome": grade.outcome,
        "tests": details.pop("tests", {}),
        **details,
    }


def cmd_grade(args: argparse.Namespace) -> int:
    """Grade `--patch` for `--instance` on a fresh copy of `--repo`; print one JSON object."""
    overrides: dict[str, Any] = {"log_format": "console"}
    if args.timeout:
        overrides["test_timeout_s"] = args.timeout
    if args.partial_credit:
        overrides["partial_credit"] = True
    try:
        # A grade on this machine: the sandbox it gives, with a warning of what it lacks.
        settings = local_sandbox(read_settings(args.config, **overrides))
        row = _read_row(args.instance)
        row["base_commit"] = _base_commit(args.repo, str(row.get("base_commit", "HEAD")))
        instance = SweInstance.from_row(row)
        artifact = args.patch.read_bytes()
    except (OSError, SettingsError, InstanceError, json.JSONDecodeError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    grade = asyncio.run(grade_patch(instance, args.repo.resolve(), artifact, grading_context(settings)))
    sys.stdout.write(json.dumps(msgspec.to_builtins(report(grade))) + "\n")
    return 0 if grade.scored else 1


def cmd_build(args: argparse.Namespace) -> int:
    """Build tinyswe into `--out` (from this machine's cache when it is already built)."""
    path = build_tinyswe(args.out)
    count = len(load_instances(args.out))
    sys.stdout.write(json.dumps({"instances": count, "path": str(path)}) + "\n")
    return 0

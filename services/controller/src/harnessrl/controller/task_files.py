"""Task files: JSONL rows, either TaskSpec-shaped or SWE-bench-shaped, validated line by line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.controller.errors import ControllerError
from harnessrl.shared.contracts import TaskSpec
from harnessrl.shared.taskpaths import TaskPathError, check_relative

# SWE-bench rows carry these; where the repository comes from is one of `REPOSITORY_SOURCES`.
_SWE_REQUIRED = ("instance_id", "problem_statement")
# Per launcher kind, the instance field an episode's repository comes from: `repo_path` (our
# addition) a pristine checkout the local launcher copies, `image` a task image with the
# repository at `workdir` (/testbed by default) that a Job's init container copies.
REPOSITORY_SOURCES = {"local": "repo_path", "kubernetes": "image"}


class TaskFileError(ControllerError):
    """A task row is malformed; the message names the file and line."""


def load_tasks(path: Path | str) -> list[TaskSpec]:
    """Read every task of a JSONL file; duplicate ids and malformed rows are errors."""
    file = Path(path)
    try:
        lines = file.read_text().splitlines()
    except OSError as exc:
        raise TaskFileError(f"cannot read tasks file {file}: {exc.strerror or exc}") from exc
    tasks: list[TaskSpec] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        task = parse_task_row(line, source=f"{file}:{number}")
        if task.task_id in seen:
            raise TaskFileError(f"{file}:{number}: duplicate task id {task.task_id!r}")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{file}: no tasks")
    return tasks


def parse_task_row(line: str, *, source: str) -> TaskSpec:
    """One JSONL row as a TaskSpec (SWE-bench-shaped rows become kind `swe`)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{source}: not JSON: {exc.msg} (column {exc.colno})") from exc
    if not isinstance(row, dict):
        raise TaskFileError(f"{source}: expected a JSON object, got {type(row).__name__}")
    if "instance_id" in row:
        return _checked_repo_path(_swe_task(row, source), source)
    if "task_id" not in row:
        raise TaskFileError(f"{source}: a task needs `task_id` (or SWE-bench's `instance_id`)")
    try:
        task = msgspec.convert(row, TaskSpec)
    except msgspec.ValidationError as exc:
        raise TaskFileError(f"{source}: {exc}") from exc
    if task.kind == "qa" and not task.prompt:
        raise TaskFileError(f"{source}: task {task.task_id!r} has an empty `prompt`")
    if task.kind == "swe" and not any((task.instance or {}).get(k) for k in REPOSITORY_SOURCES.values()):
        needs = " or ".join(f"`instance.{key}`" for key in REPOSITORY_SOURCES.values())
        raise TaskFileError(f"{source}: swe task {task.task_id!r} needs {needs}")
    return _checked_repo_path(task, source)


def _checked_repo_path(task: TaskSpec, source: str) -> TaskSpec:
    """Refuse a `repo_path` that is absolute or climbs out with `..` (see `harnessrl.shared.taskpaths`)."""
    repo = (task.instance or {}).get("repo_path")
    if repo is not None:
        try:
            check_relative(str(repo))
        except TaskPathError as exc:
            raise TaskFileError(f"{source}: {exc}") from exc
    return task


def check_repository_sources(tasks: list[TaskSpec], launcher: str, source: str) -> None:
    """Every SWE task has the repository source this launcher copies (else it would see none)."""
    field = REPOSITORY_SOURCES[launcher]
    lacking = [t.task_id for t in tasks if t.kind == "swe" and not (t.instance or {}).get(field)]
    if lacking:
        raise TaskFileError(
            f"{source}: {len(lacking)} swe task(s) lack `instance.{field}`, which the {launcher} "
            f"launcher copies the repository from (first: {lacking[0]!r})"
        )


def _swe_task(row: dict[str, Any], source: str) -> TaskSpec:
    missing = [key for key in _SWE_REQUIRED if not row.get(key)]
    if not any(row.get(key) for key in REPOSITORY_SOURCES.values()):
        missing.append(" or ".join(REPOSITORY_SOURCES.values()))
    if missing:
        raise TaskFileError(f"{source}: SWE-bench row lacks {', '.join(missing)}")
    if not isinstance(row["instance_id"], str) or not isinstance(row["problem_statement"], str):
        raise TaskFileError(f"{source}: `instance_id` and `problem_statement` must be strings")
    return TaskSpec(
        task_id=row["instance_id"],
        kind="swe",
        prompt=row["problem_statement"],
        grader="swebench",
        instance=row,
        heldout=bool(row.get("heldout", False)),
    )


def harness_view(task: TaskSpec) -> dict[str, Any]:
    """What the harness may see of a task: never the answer, tests or grading data."""
    view: dict[str, Any] = {"task_id": task.task_id, "kind": task.kind, "prompt": task.prompt}
    if task.instance:
        for key in ("repo", "base_commit", "instance_id"):
            if key in task.instance:
                view[key] = task.instance[key]
    return view

"""Task files: our own task rows or a SWE dataset as it ships, validated row by row.

`load_tasks(path, dataset)` reads `path` (a JSONL or Parquet file or a dataset folder, see
`datasets.py`) as the run's `DatasetSpec` says. Without one it reads our own rows (flavour `tasks`):
TaskSpec-shaped rows, or SWE-bench-shaped ones (`instance_id`, `problem_statement`, and `repo_path`
or `image`) kept as they are. A SWE flavour (`dataset_flavours.py`) normalises each row to the shape
the reward grader reads and makes it `TaskSpec(task_id=instance_id, kind="swe",
prompt=problem_statement, grader="swebench", instance=<that row>)`. Then the rows are filtered
(instance-id globs, repositories) and cut to `limit`. Any malformed row, or a duplicate id, is an
error naming the file and line (or row) and the field; `read_task_rows` keeps every row's problems
instead, for `harnessrl tasks check`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.controller.dataset_flavours import FLAVOURS, detect, mirrored, normalise
from harnessrl.controller.datasets import SourceRow, read_source
from harnessrl.controller.errors import TaskFileError
from harnessrl.shared.contracts import TaskSpec
from harnessrl.shared.datasetspec import DatasetSpec
from harnessrl.shared.taskpaths import TaskPathError, check_relative

__all__ = [
    "REPOSITORY_SOURCES",
    "TaskFileError",
    "TaskRow",
    "TaskRows",
    "check_repository_sources",
    "harness_view",
    "load_tasks",
    "read_task_rows",
]

# Our own SWE-bench-shaped rows carry these; where the repository comes from is one of `REPOSITORY_SOURCES`.
_SWE_REQUIRED = ("instance_id", "problem_statement")
# Per launcher kind, the instance field an episode's repository comes from: `repo_path` (our
# addition) a pristine checkout the local launcher copies, `image` a task image with the
# repository at `workdir` (/testbed by default) that a Job's init container copies.
REPOSITORY_SOURCES = {"local": "repo_path", "kubernetes": "image"}
# How a run without a `dataset` reads its tasks: our own rows, every row, as before datasets.
OWN_ROWS = DatasetSpec(flavour="tasks")


class _RowProblem(TaskFileError):
    """What is wrong with one row, without where it is (the caller adds that)."""


@dataclass(frozen=True)
class TaskRow:
    """One row as loaded: its task (None when the row is unusable) and every problem found."""

    where: str
    task_id: str
    repo: str
    task: TaskSpec | None
    problems: tuple[str, ...]


@dataclass(frozen=True)
class TaskRows:
    """The rows of one read: which flavour and split they were read as, and the splits there are."""

    source: Path
    flavour: str
    split: str | None
    splits: tuple[str, ...]
    rows: list[TaskRow]


def load_tasks(path: Path | str, dataset: DatasetSpec | None = None) -> list[TaskSpec]:
    """Every task `dataset` selects from `path`; a malformed row or a duplicate id is an error."""
    loaded = read_task_rows(path, dataset)
    for row in loaded.rows:
        if row.problems:
            raise TaskFileError(f"{row.where}: {row.problems[0]}")
    tasks = [row.task for row in loaded.rows if row.task is not None]
    if not tasks:
        raise TaskFileError(f"{path}: no tasks")
    return tasks


def read_task_rows(path: Path | str, dataset: DatasetSpec | None = None) -> TaskRows:
    """Every row `dataset` selects from `path`, each with its task or its problems.

    Only what stops the whole read raises (`DatasetError`): an unreadable file, a split that is not
    there, rows that fit no single flavour under `auto`.
    """
    spec = dataset or OWN_ROWS
    source = read_source(path, spec.split)
    flavour: str = spec.flavour
    if flavour == "auto":
        flavour = detect([(r.where, r.fields) for r in source.rows if r.error is None], str(source.path))
    rows = [_task_row(row, flavour, spec.image_prefix) for row in source.rows]
    kept = [row for row in rows if _selected(row, spec)]
    if spec.limit is not None:
        kept = kept[: spec.limit]
    return TaskRows(source.path, flavour, source.split, source.splits, _with_duplicates(kept))


def _task_row(row: SourceRow, flavour: str, image_prefix: str | None) -> TaskRow:
    if row.error is not None:
        return TaskRow(row.where, "", "", None, (row.error,))
    fields = row.fields
    if flavour == "tasks":
        return _own_row(row.where, fields, image_prefix)
    normalised = normalise(FLAVOURS[flavour], fields)
    instance = normalised.instance
    instance["image"] = mirrored(str(instance.get("image") or ""), image_prefix)
    problems = list(normalised.problems)
    problems += _repo_path_problems(instance)
    task_id, repo = str(instance.get("instance_id") or ""), str(instance.get("repo") or "")
    if problems:
        return TaskRow(row.where, task_id, repo, None, tuple(problems))
    task = TaskSpec(
        task_id=task_id,
        kind="swe",
        prompt=str(instance["problem_statement"]),
        grader="swebench",
        instance=instance,
        heldout=bool(fields.get("heldout", False)),
    )
    return TaskRow(row.where, task_id, repo, task, ())


def _own_row(where: str, fields: dict[str, Any], image_prefix: str | None) -> TaskRow:
    """One of our own rows (flavour `tasks`): a TaskSpec, or a SWE-bench row kept as it is."""
    task_id = str(fields.get("task_id") or fields.get("instance_id") or "")
    nested = fields.get("instance")
    repo = str((nested if isinstance(nested, dict) else fields).get("repo") or "")
    try:
        task = _own_task(fields)
    except _RowProblem as exc:
        return TaskRow(where, task_id, repo, None, (str(exc),))
    if image_prefix and task.instance and task.instance.get("image"):
        image = mirrored(str(task.instance["image"]), image_prefix)
        task = msgspec.structs.replace(task, instance={**task.instance, "image": image})
    return TaskRow(where, task.task_id, repo, task, ())


def _own_task(row: dict[str, Any]) -> TaskSpec:
    """One of our own rows as a TaskSpec (SWE-bench-shaped rows become kind `swe`)."""
    if "instance_id" in row:
        return _checked_repo_path(_swe_task(row))
    if "task_id" not in row:
        raise _RowProblem("a task needs `task_id` (or SWE-bench's `instance_id`)")
    try:
        task = msgspec.convert(row, TaskSpec)
    except msgspec.ValidationError as exc:
        raise _RowProblem(str(exc)) from exc
    if task.kind == "qa" and not task.prompt:
        raise _RowProblem(f"task {task.task_id!r} has an empty `prompt`")
    if task.kind == "swe" and not any((task.instance or {}).get(k) for k in REPOSITORY_SOURCES.values()):
        needs = " or ".join(f"`instance.{key}`" for key in REPOSITORY_SOURCES.values())
        raise _RowProblem(f"swe task {task.task_id!r} needs {needs}")
    return _checked_repo_path(task)


def _checked_repo_path(task: TaskSpec) -> TaskSpec:
    """Refuse a `repo_path` that is absolute or climbs out with `..` (see `harnessrl.shared.taskpaths`)."""
    problems = _repo_path_problems(task.instance or {})
    if problems:
        raise _RowProblem(problems[0])
    return task


def _repo_path_problems(instance: dict[str, Any]) -> list[str]:
    repo = instance.get("repo_path")
    if repo is None:
        return []
    try:
        check_relative(str(repo))
    except TaskPathError as exc:
        return [str(exc)]
    return []


def _swe_task(row: dict[str, Any]) -> TaskSpec:
    missing = [key for key in _SWE_REQUIRED if not row.get(key)]
    if not any(row.get(key) for key in REPOSITORY_SOURCES.values()):
        missing.append(" or ".join(REPOSITORY_SOURCES.values()))
    if missing:
        raise _RowProblem(f"SWE-bench row lacks {', '.join(missing)}")
    if not isinstance(row["instance_id"], str) or not isinstance(row["problem_statement"], str):
        raise _RowProblem("`instance_id` and `problem_statement` must be strings")
    return TaskSpec(
        task_id=row["instance_id"],
        kind="swe",
        prompt=row["problem_statement"],
        grader="swebench",
        instance=row,
        heldout=bool(row.get("heldout", False)),
    )


def _selected(row: TaskRow, spec: DatasetSpec) -> bool:
    """Whether the filters keep `row` (a row unreadable enough to have no id is always kept)."""
    if not row.task_id:
        return True
    if spec.instances and not any(fnmatch.fnmatchcase(row.task_id, glob) for glob in spec.instances):
        return False
    return not spec.repos or row.repo in spec.repos


def _with_duplicates(rows: list[TaskRow]) -> list[TaskRow]:
    """`rows`, a second row with an id already seen carrying that as a problem (and no task)."""
    first: dict[str, str] = {}
    checked: list[TaskRow] = []
    for row in rows:
        if row.task_id and row.task_id in first:
            problem = f"duplicate task id {row.task_id!r} (first at {first[row.task_id]})"
            checked.append(TaskRow(row.where, row.task_id, row.repo, None, (*row.problems, problem)))
            continue
        if row.task_id:
            first[row.task_id] = row.where
        checked.append(row)
    return checked


def check_repository_sources(tasks: list[TaskSpec], launcher: str, source: str) -> None:
    """Every SWE task has the repository source this launcher copies (else it would see none)."""
    field = REPOSITORY_SOURCES[launcher]
    lacking = [t.task_id for t in tasks if t.kind == "swe" and not (t.instance or {}).get(field)]
    if lacking:
        raise TaskFileError(
            f"{source}: {len(lacking)} swe task(s) lack `instance.{field}`, which the {launcher} "
            f"launcher copies the repository from (first: {lacking[0]!r})"
        )


def harness_view(task: TaskSpec) -> dict[str, Any]:
    """What the harness may see of a task: never the answer, tests or grading data."""
    view: dict[str, Any] = {"task_id": task.task_id, "kind": task.kind, "prompt": task.prompt}
    if task.instance:
        for key in ("repo", "base_commit", "instance_id"):
            if key in task.instance:
                view[key] = task.instance[key]
    return view

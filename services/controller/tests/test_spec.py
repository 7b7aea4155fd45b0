"""Run specs and task files: good ones load, bad ones fail with a sentence naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.controller.task_files import (
    TaskFileError,
    check_repository_sources,
    harness_view,
    load_tasks,
)
from harnessrl.shared.runspec import RunSpecError, load_run_spec

GOOD = """
run = "demo-1"
tasks = "tasks.jsonl"
group_size = 4
mode = "async"
staleness = 2
[launcher]
kind = "local"
command = ["python", "harness.py"]
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def tasks_file(tmp_path: Path) -> Path:
    rows = [
        {"task_id": "m1", "prompt": "What is 12*13?", "answer": "156"},
        {"instance_id": "repo__x-1", "problem_statement": "Fix it", "repo_path": "repos/x"},
    ]
    write(tmp_path, "harness.py", "print('hi')\n")
    return write(tmp_path, "tasks.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")


def test_toml_and_yaml_specs_load_with_tasks_resolved(tmp_path: Path, tasks_file: Path) -> None:
    spec = load_run_spec(write(tmp_path, "run.toml", GOOD))
    assert (spec.run, spec.group_size, spec.mode, spec.staleness) == ("demo-1", 4, "async", 2)
    assert spec.tasks == str(tasks_file.resolve())
    assert spec.launcher.command == ["python", str(tmp_path / "harness.py")]
    yaml_spec = load_run_spec(
        write(tmp_path, "run.yaml", "run: y1\ntasks: tasks.jsonl\nlauncher:\n  command: [sh, -c, 'true']\n")
    )
    assert yaml_spec.launcher.command == ["sh", "-c", "true"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD.replace("group_size = 4", "group_size = 0"), "`group_size` >= 1"),
        (GOOD.replace("group_size = 4", 'group_size = "four"'), "$.group_size"),
        (GOOD.replace('mode = "async"', 'mode = "fast"'), "$.mode"),
        (GOOD.replace("staleness = 2", "stalenes = 2"), "unknown field(s) `stalenes`"),
        (GOOD.replace('kind = "local"', 'kind = "local"\nimage_tag = "x"'), "`launcher.image_tag`"),
        (GOOD.replace('run = "demo-1"', 'run = "Demo.1"'), "`run` must be"),
        (GOOD.replace('command = ["python", "harness.py"]', "command = []"), "launcher.command"),
        (GOOD.replace('kind = "local"', 'kind = "kubernetes"'), "launcher.image"),
        (GOOD.replace('"tasks.jsonl"', '"missing.jsonl"'), "does not exist"),
        (GOOD.replace('"harness.py"', '"missing.py"'), "`launcher.command[1]`: script missing.py"),
        ("run = [", "not valid TOML"),
    ],
)
def test_bad_specs_name_the_problem(tmp_path: Path, tasks_file: Path, text: str, message: str) -> None:
    with pytest.raises(RunSpecError) as caught:
        load_run_spec(write(tmp_path, "run.toml", text))
    assert message in str(caught.value)
    assert "Traceback" not in str(caught.value)


def test_spec_file_missing_or_wrong_suffix(tmp_path: Path) -> None:
    with pytest.raises(RunSpecError, match="cannot read run spec"):
        load_run_spec(tmp_path / "nope.toml")
    with pytest.raises(RunSpecError, match=r"\.toml, \.yaml"):
        load_run_spec(write(tmp_path, "run.ini", "x"))


def test_task_rows_of_both_shapes(tasks_file: Path) -> None:
    qa, swe = load_tasks(tasks_file)
    assert (qa.kind, qa.answer) == ("qa", "156")
    assert (swe.task_id, swe.kind, swe.prompt) == ("repo__x-1", "swe", "Fix it")
    assert "answer" not in harness_view(qa)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", ":1: not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt": "x"}', "needs `task_id`"),
        ('{"task_id": "a", "prompt": ""}', "empty `prompt`"),
        ('{"task_id": "a", "prompt": "x", "kind": "essay"}', "$.kind"),
        ('{"instance_id": "i", "problem_statement": "p"}', "lacks repo_path or image"),
        ('{"task_id": "i", "kind": "swe", "prompt": "p"}', "needs `instance.repo_path` or `instance.image`"),
        ('{"task_id": "a", "prompt": "x"}\n{"task_id": "a", "prompt": "y"}', ":2: duplicate task id"),
        ('{"instance_id": "i", "problem_statement": "p", "repo_path": "/root"}', ":1: repo_path '/root'"),
        ('{"instance_id": "i", "problem_statement": "p", "repo_path": "r/../../x"}', "without '..'"),
        ('{"task_id": "i", "kind": "swe", "prompt": "p", "instance": {"repo_path": "/"}}', "relative path"),
        ("", "no tasks"),
    ],
)
def test_bad_task_rows_name_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    with pytest.raises(TaskFileError) as caught:
        load_tasks(write(tmp_path, "t.jsonl", row + "\n"))
    assert message in str(caught.value)


def test_each_launcher_needs_the_repository_source_it_copies(tmp_path: Path) -> None:
    """A checkout for local episodes, a task image for Jobs: without it an episode sees no repo."""
    rows = [
        {"instance_id": "a__1", "problem_statement": "Fix", "repo_path": "repos/a"},
        {"instance_id": "b__2", "problem_statement": "Fix", "image": "registry.local/task:b-2"},
    ]
    tasks = load_tasks(write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n"))
    with pytest.raises(TaskFileError, match=r"lack `instance.repo_path`.*local launcher.*'b__2'"):
        check_repository_sources(tasks, "local", "run r")
    with pytest.raises(TaskFileError, match=r"lack `instance.image`.*kubernetes launcher.*'a__1'"):
        check_repository_sources(tasks, "kubernetes", "run r")
    check_repository_sources(tasks[:1], "local", "run r")
    check_repository_sources(tasks[1:], "kubernetes", "run r")

"""A task's repo_path stays inside its task folder: absolute paths, `..` and links out are refused."""

from pathlib import Path

import pytest

from harnessrl.shared.taskpaths import TaskPathError, check_relative, confined


@pytest.mark.parametrize("path", ["/etc", "", "repos/../../secret", "..", "repos/a/../../../x"])
def test_absolute_empty_and_climbing_paths_are_refused(tmp_path: Path, path: str) -> None:
    with pytest.raises(TaskPathError, match=repr(path)):
        confined(tmp_path, path)
    with pytest.raises(TaskPathError):
        check_relative(path)


def test_a_symlink_out_of_the_task_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "repo").mkdir(parents=True)
    tasks = tmp_path / "tasks"
    (tasks / "repos").mkdir(parents=True)
    (tasks / "repos" / "escape").symlink_to(outside / "repo")
    (tasks / "repos" / "up").symlink_to(outside)
    for path in ("repos/escape", "repos/up/repo"):
        with pytest.raises(TaskPathError, match="leads out of the task folder"):
            confined(tasks, path)


def test_paths_inside_resolve_there_links_within_included(tmp_path: Path) -> None:
    (tmp_path / "repos" / "a").mkdir(parents=True)
    (tmp_path / "repos" / "alias").symlink_to(tmp_path / "repos" / "a")
    assert confined(tmp_path, "repos/a") == (tmp_path / "repos" / "a").resolve()
    assert confined(tmp_path, "repos/alias") == (tmp_path / "repos" / "a").resolve()
    assert confined(tmp_path, "./repos/a") == (tmp_path / "repos" / "a").resolve()

"""Where a task's repository may be: inside the task root, never out of it.

A task file is a tenant's input. Its `repo_path` is copied into episodes (which run model-written
code) and graded by a service that runs as root, so a path that is absolute, climbs out with `..`
or leads out through a symlink would hand them any folder of the machine.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

COMMIT_ID = re.compile(r"[0-9a-f]{7,40}")


class TaskPathError(ValueError):
    """A task path is absolute or leads out of its task root; the message says which."""


def check_relative(path: str) -> None:
    """Refuse an empty or absolute `path` or one with a `..` part (no file system needed)."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or Path(path).is_absolute() or ".." in pure.parts:
        raise TaskPathError(f"repo_path {path!r} must be a relative path in the task folder, without '..'")


class BaseCommitError(ValueError):
    """A task's base commit is not a commit id; the message says so."""


def check_base_commit(value: str) -> str:
    """`value` if it is a commit id (7 to 40 lowercase hex digits) or `HEAD`.

    A base commit reaches `git checkout` and a pod's shell script: an option (`--orphan=x`), a
    shell word or a revision expression is refused before either sees it.
    """
    if value != "HEAD" and not COMMIT_ID.fullmatch(value):
        raise BaseCommitError(f"base_commit {value!r} is not a commit id (7 to 40 lowercase hex digits)")
    return value


def confined(root: Path, path: str) -> Path:
    """`path` under `root`, resolved: refused unless it stays inside `root` (symlinks followed)."""
    check_relative(path)
    real_root = root.resolve()
    target = (real_root / path).resolve()
    if target != real_root and real_root not in target.parents:
        raise TaskPathError(f"repo_path {path!r} leads out of the task folder {root} (through a symlink)")
    return target

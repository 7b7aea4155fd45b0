"""Where a task's repository may be: inside the task root, never out of it.

A task file is a tenant's input. Its `repo_path` is copied into episodes (which run model-written
code) and graded by a service that runs as root, so a path that is absolute, climbs out with `..`
or leads out through a symlink would hand them any folder of the machine.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath


class TaskPathError(ValueError):
    """A task path is absolute or leads out of its task root; the message says which."""


def check_relative(path: str) -> None:
    """Refuse an empty or absolute `path` or one with a `..` part (no file system needed)."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or Path(path).is_absolute() or ".." in pure.parts:
        raise TaskPathError(f"repo_path {path!r} must be a relative path in the task folder, without '..'")


def confined(root: Path, path: str) -> Path:
    """`path` under `root`, resolved: refused unless it stays inside `root` (symlinks followed)."""
    check_relative(path)
    real_root = root.resolve()
    target = (real_root / path).resolve()
    if target != real_root and real_root not in target.parents:
        raise TaskPathError(f"repo_path {path!r} leads out of the task folder {root} (through a symlink)")
    return target

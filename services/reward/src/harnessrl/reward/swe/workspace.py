"""A grading workspace: a fresh clone, the agent's patch, then the pristine test setup restored.

Everything that decides how tests run is put back to the pristine tree before the test patch goes on.

Patch application follows SWE-bench: `git apply`, then `git apply --3way`, then `--reject`, then
`patch --fuzz=5`, resetting the tree between tries. The reset walks the file system (not
`git status`, which a patched `.gitignore` could blind) and restores or deletes every protected
path.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tomllib
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from harnessrl.reward.errors import RewardError
from harnessrl.reward.swe.podrunner import APPLY_STRATEGIES

CONFIG_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "setup.cfg",
        "tox.ini",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
TEST_DIRS = frozenset({"tests", "test", "testing"})
_PYTEST_TABLE = re.compile(r"^\s*\[+\s*tool\.pytest\b")
_ANY_TABLE = re.compile(r"^\s*\[")
SYMLINK_MODE = "120000 "


class WorkspaceError(RewardError, RuntimeError):
    """The pristine repository could not be copied or reset (an infrastructure problem)."""


async def git(repo: Path, *args: str, check: bool = True, stdin: bytes | None = None) -> bytes:
    """Run git in `repo`; raises `WorkspaceError` when `check` and it fails."""
    process = await asyncio.create_subprocess_exec(
        "git",
        "-c",
        "core.hooksPath=/dev/null",
        # The workspace may belong to the grading's user by now (the patch is applied as that user).
        "-c",
        "safe.directory=*",
        "-c",
        "user.name=harnessrl",
        "-c",
        "user.email=harnessrl@localhost",
        *args,
        cwd=repo,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate(stdin)
    if check and process.returncode != 0:
        raise WorkspaceError(f"git {' '.join(args)} failed: {err.decode(errors='replace')[-500:]}")
    return out


def is_protected(path: str) -> bool:
    """Whether `path` decides how tests run: test files, test folders and test configuration."""
    pure = PurePosixPath(path)
    name = pure.name
    if name in CONFIG_NAMES or name.endswith(".pth"):
        return True
    if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
        return True
    return any(part in TEST_DIRS for part in pure.parts[:-1])


async def clone_pristine(pristine: Path, base_commit: str, dest: Path) -> str:
    """Make `dest` a fresh checkout of `base_commit` without writing to `pristine`.

    A plain folder (no git) is copied and committed as is. Returns the commit checked out.
    """
    if (pristine / ".git").exists() or (pristine / "HEAD").is_file():
        await git(
            dest.parent, "clone", "--quiet", "--no-hardlinks", "--no-checkout", str(pristine), dest.name
        )
        await git(dest, "checkout", "--quiet", "--detach", base_commit)
    else:
        shutil.copytree(pristine, dest, symlinks=True)
        await git(dest, "init", "--quiet")
        await git(dest, "add", "--all", "--force")
        await git(dest, "commit", "--quiet", "--no-verify", "--allow-empty", "-m", "pristine")
    return (await git(dest, "rev-parse", "HEAD")).decode().strip()


async def _reset_hard(repo: Path) -> None:
    await git(repo, "reset", "--hard", "--quiet", "HEAD")
    await git(repo, "clean", "-fdxq")


async def apply_patch(
    repo: Path, patch_file: Path, confined: Sequence[str] = (), env: dict[str, str] | None = None
) -> tuple[str | None, list[str]]:
    """Try each strategy on a clean tree; the winning strategy's name (or None) and the errors.

    Each strategy runs behind `confined` (no network, the grading's user: the model's patch is
    hostile input to `git apply` and `patch`), in `env`.
    """
    errors: list[str] = []
    for name, command in APPLY_STRATEGIES:
        process = await asyncio.create_subprocess_exec(
            *confined,
            *command,
            str(patch_file),
            cwd=repo,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await process.communicate()
        if process.returncode == 0:
            return name, errors
        errors.append(f"{name}: {out.decode(errors='replace')[-300:]}")
        await _reset_hard(repo)
    return None, errors


async def _pristine_files(repo: Path, commit: str) -> set[str]:
    """The files of `commit`, symlinks left out.

    A protected path is never restored as a link: the grader runs as root, and a link committed
    in a task repository may point anywhere.
    """
    out = await git(repo, "ls-tree", "-r", "-z", commit)
    entries = (entry.split("\t", 1) for entry in out.decode().split("\x00") if entry)
    return {path for meta, path in entries if not meta.startswith(SYMLINK_MODE)}


def _real_folders(repo: Path, path: str) -> None:
    """Remove whatever stands in for a folder on the way to `path` (a symlink, a file).

    Then nothing deleted or written at `path` lands outside `repo` through a link.
    """
    folder = repo
    for part in PurePosixPath(path).parts[:-1]:
        folder = folder / part
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            folder.unlink()


def _working_files(repo: Path) -> set[str]:
    found: set[str] = set()
    for path in repo.rglob("*"):
        relative = path.relative_to(repo).as_posix()
        if relative == ".git" or relative.startswith(".git/"):
            continue
        if path.is_file() or path.is_symlink():
            found.add(relative)
    return found


def pytest_tables(text: str) -> tuple[str, str]:
    """Split TOML text into (everything but the `[tool.pytest...]` tables, those tables)."""
    rest: list[str] = []
    tables: list[str] = []
    target = rest
    for line in text.splitlines(keepends=True):
        if _ANY_TABLE.match(line):
            target = tables if _PYTEST_TABLE.match(line) else rest
        target.append(line)
    return "".join(rest), "".join(tables)


async def _show(repo: Path, commit: str, path: str) -> bytes:
    return await git(repo, "show", f"{commit}:{path}")


async def restore_protected(repo: Path, commit: str, extra: list[str]) -> list[str]:
    """Put protected paths (and `extra`, the test patch's paths) back as in `commit`.

    Returns the paths that were restored or deleted. `pyproject.toml` keeps the agent's edits
    except its pytest tables, which are replaced by the pristine ones.
    """
    pristine = await _pristine_files(repo, commit)
    current = _working_files(repo)
    extra_set = set(extra)
    changed: list[str] = []
    for path in sorted(current | extra_set | {p for p in pristine if is_protected(p)}):
        if PurePosixPath(path).name == "pyproject.toml" and path not in extra_set:
            if await _reset_pyproject(repo, commit, path, path in pristine):
                changed.append(path)
            continue
        if not (is_protected(path) or path in extra_set):
            continue
        if await _restore_one(repo, commit, path, path in pristine):
            changed.append(path)
    return changed


def _remove(target: Path) -> bool:
    """Delete a file, symlink or folder at `target`; whether anything was there."""
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
        return True
    if target.is_symlink() or target.exists():
        target.unlink()
        return True
    return False


async def _restore_one(repo: Path, commit: str, path: str, in_pristine: bool) -> bool:
    _real_folders(repo, path)
    target = repo / path
    if not in_pristine:
        return _remove(target)
    original = await _show(repo, commit, path)
    if target.is_file() and not target.is_symlink() and target.read_bytes() == original:
        return False
    _remove(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(original)
    return True


def _pytest_config(text: str) -> object:
    """The pytest configuration a TOML text holds, however it is spelled (None if unparsable)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None
    tool = data.get("tool", {})
    return tool.get("pytest") if isinstance(tool, dict) else None


def merged_pyproject(current: str, original: str) -> str:
    """The agent's pyproject with its pytest configuration put back to the pristine one."""
    rest, _ = pytest_tables(current)
    _, pristine_tables = pytest_tables(original)
    merged = rest if not pristine_tables else rest.rstrip("\n") + "\n\n" + pristine_tables
    if _pytest_config(merged) != _pytest_config(original):
        return original  # pytest options hidden in dotted keys or inline tables: take no chances
    return merged


async def _reset_pyproject(repo: Path, commit: str, path: str, in_pristine: bool) -> bool:
    _real_folders(repo, path)
    target = repo / path
    if target.is_symlink() or not target.is_file():
        return await _restore_one(repo, commit, path, in_pristine)
    current = target.read_text(errors="replace")
    original = (await _show(repo, commit, path)).decode(errors="replace") if in_pristine else ""
    merged = merged_pyproject(current, original)
    if merged == current:
        return False
    if not merged.strip() and not in_pristine:
        target.unlink()
    else:
        target.write_text(merged)
    return True


async def apply_test_patch(repo: Path, patch_file: Path) -> None:
    """Apply the instance's test patch to the reset tree; failure is infrastructure's fault."""
    process = await asyncio.create_subprocess_exec(
        "git",
        "apply",
        "--verbose",
        str(patch_file),
        cwd=repo,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise WorkspaceError(f"test patch does not apply: {out.decode(errors='replace')[-300:]}")

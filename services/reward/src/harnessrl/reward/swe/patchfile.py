"""Checking an agent's patch before it touches a workspace.

The patch is the only thing from the episode we use, so it is checked as hostile input: bounded
size, UTF-8 text without NUL bytes, a unified diff, no binary hunks, no symlinks, and every path
relative, inside the repository and outside `.git`.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

import msgspec

from harnessrl.reward.errors import RewardError

MAX_PATCH_BYTES = 2 * 1024 * 1024
_DIFF_GIT = re.compile(r"^diff --git (\"?a/.+?\"?) (\"?b/.+\"?)$")
_FILE_HEADER = re.compile(r"^(?:---|\+\+\+) (\S.*?)(?:\t.*)?$")
_RENAME = re.compile(r"^(?:rename|copy) (?:from|to) (.+)$")
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_BAD_MODE = re.compile(r"^(?:new file mode|new mode|old mode|deleted file mode) 120000")


class InvalidPatchError(RewardError, ValueError):
    """The artifact is not an acceptable patch; the message says why."""


class Patch(msgspec.Struct, frozen=True, kw_only=True):
    """A checked patch: its text and the repository paths it touches."""

    text: str
    paths: list[str]

    @property
    def empty(self) -> bool:
        """Whether the patch changes nothing."""
        return not self.text.strip()


def _unquote(path: str) -> str:
    if path.startswith('"') and path.endswith('"'):
        inner = path[1:-1]
        if "\\" in inner:
            raise InvalidPatchError(f"escaped path in patch: {path!r}")
        return inner
    return path


def _strip_prefix(path: str) -> str | None:
    path = _unquote(path.strip())
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        return path[2:]
    return path


def check_path(path: str) -> str:
    """Return `path` normalised, or raise when it is absolute, escapes or touches `.git`."""
    if not path or "\x00" in path or "\\" in path:
        raise InvalidPatchError(f"bad path in patch: {path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise InvalidPatchError(f"absolute path in patch: {path}")
    if any(part in ("..", ".git") for part in pure.parts):
        raise InvalidPatchError(f"path outside the repository in patch: {path}")
    return str(pure)


def _header_paths(line: str) -> list[str]:
    found: list[str] = []
    if match := _DIFF_GIT.match(line):
        found = [match.group(1), match.group(2)]
    elif (match := _FILE_HEADER.match(line)) and line[:4] in ("--- ", "+++ "):
        found = [match.group(1)]
    elif match := _RENAME.match(line):
        found = ["a/" + match.group(1)]
    return [p for p in (_strip_prefix(raw) for raw in found) if p is not None]


def _decode(data: bytes, limit: int) -> str:
    if len(data) > limit:
        raise InvalidPatchError(f"patch is {len(data)} bytes, over the {limit}-byte limit")
    if b"\x00" in data:
        raise InvalidPatchError("patch contains NUL bytes (binary data)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidPatchError(f"patch is not UTF-8: {exc.reason} at byte {exc.start}") from exc


def _hunk_sizes(line: str) -> tuple[int, int] | None:
    match = _HUNK.match(line)
    if match is None:
        return None
    old = int(match.group(1)) if match.group(1) is not None else 1
    new = int(match.group(2)) if match.group(2) is not None else 1
    return old, new


def _scan(text: str) -> set[str]:
    """Walk headers and hunks, collecting checked paths; hunk bodies are counted, not parsed."""
    paths: set[str] = set()
    old_left = new_left = 0
    for line in text.splitlines():
        if old_left > 0 or new_left > 0:
            tag = line[:1]
            if tag in (" ", ""):
                old_left, new_left = old_left - 1, new_left - 1
            elif tag == "-":
                old_left -= 1
            elif tag == "+":
                new_left -= 1
            elif tag != "\\":
                raise InvalidPatchError("malformed diff: hunk shorter than its header says")
            continue
        if line.startswith(("GIT binary patch", "Binary files ")):
            raise InvalidPatchError("binary patches are not accepted")
        if _BAD_MODE.match(line):
            raise InvalidPatchError("symlinks are not accepted in patches")
        if (sizes := _hunk_sizes(line)) is not None:
            old_left, new_left = sizes
        else:
            paths.update(check_path(p) for p in _header_paths(line))
    if old_left > 0 or new_left > 0:
        raise InvalidPatchError("malformed diff: truncated hunk")
    return paths


def parse_patch(data: bytes, *, limit: int = MAX_PATCH_BYTES) -> Patch:
    """Check an artifact and list the paths it touches; raises `InvalidPatchError`."""
    text = _decode(data, limit)
    if not text.strip():
        return Patch(text="", paths=[])
    paths = _scan(text)
    if not paths:
        raise InvalidPatchError("not a unified diff: no file headers found")
    if not text.endswith("\n"):
        text += "\n"
    return Patch(text=text, paths=sorted(paths))

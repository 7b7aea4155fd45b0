"""Writing a library's git repository with `git fast-import`.

History: one root commit with the project scaffold (branch `main`), and per instance one commit
on top of it holding the buggy library and the tests minus the FAIL_TO_PASS ones, tagged with the
instance id. No commit contains the fix, so no base commit's history reveals it. Dates are fixed,
so the same input always gives the same commit ids.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec

_AUTHOR = "tinyswe <tinyswe@localhost>"
_EPOCH = 1_700_000_000


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One commit to write: the tag it gets, its message and its whole tree."""

    tag: str
    message: str
    files: dict[str, str]


def _data(text: str) -> bytes:
    raw = text.encode()
    return b"data %d\n" % len(raw) + raw + b"\n"


def _commit(ref: str, mark: int, when: int, message: str, files: dict[str, str], parent: int | None) -> bytes:
    out = [f"commit {ref}\nmark :{mark}\n".encode()]
    out.append(f"author {_AUTHOR} {when} +0000\ncommitter {_AUTHOR} {when} +0000\n".encode())
    out.append(_data(message))
    if parent is not None:
        out.append(f"from :{parent}\n".encode())
    out.append(b"deleteall\n")
    for path in sorted(files):
        out.append(f"M 100644 inline {path}\n".encode() + _data(files[path]))
    return b"".join(out) + b"\n"


def write_repository(
    dest: Path, scaffold: dict[str, str], snapshots: list[Snapshot]
) -> tuple[str, dict[str, str]]:
    """Create the repository at `dest`; returns (root commit, tag -> commit)."""
    dest.mkdir(parents=True)
    subprocess.run(["git", "init", "--quiet", "--initial-branch=main", str(dest)], check=True)
    stream = [_commit("refs/heads/main", 1, _EPOCH, "Initial project layout\n", scaffold, None)]
    for offset, snapshot in enumerate(snapshots):
        ref = f"refs/tags/{snapshot.tag}"
        stream.append(
            _commit(ref, offset + 2, _EPOCH + 3600 * (offset + 1), snapshot.message, snapshot.files, 1)
        )
    subprocess.run(["git", "fast-import", "--quiet"], cwd=dest, input=b"".join(stream), check=True)
    subprocess.run(["git", "reset", "--hard", "--quiet", "main"], cwd=dest, check=True)
    refs = subprocess.run(["git", "show-ref"], cwd=dest, capture_output=True, text=True, check=True).stdout
    commits: dict[str, str] = {}
    for line in refs.splitlines():
        sha, ref = line.split()
        commits[ref.removeprefix("refs/tags/").removeprefix("refs/heads/")] = sha
    return commits.pop("main"), commits

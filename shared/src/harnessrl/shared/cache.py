"""This machine's build cache: `$HARNESSRL_CACHE` (default `~/.cache/harnessrl`), filled once per key.

Slow things (the tiny model, the tinyswe task set, warm-started policies) are built once per machine
into a folder whose name carries a digest of everything that decides the result.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Where builds are cached on this machine."""
    return Path(os.environ.get("HARNESSRL_CACHE", Path.home() / ".cache" / "harnessrl"))


def build_once(target: Path, build: Callable[[Path], object], *, done: str) -> Path:
    """`target`, built by `build(staging)` unless its file `done` already exists.

    `build` fills an empty staging folder that is renamed to `target` only when complete, so nobody
    ever sees half a build; concurrent builders of one target take turns on a lock file, so it is
    built once.
    """
    if (target / done).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f"{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / done).exists():
            return target
        staging = target.parent / f"{target.name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            build(staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target

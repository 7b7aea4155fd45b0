"""The suite on several pytest-xdist workers (`make test` runs `--dist loadfile`).

A unit of work is a test file: every test in it runs on one worker, one after another, so its module
fixtures (a vLLM on its own model, a local stack, a warm start) start once and no two of its tests
race. Files start costliest first (longest-processing-time order, from `tests/file-times.json`,
which `python -m harnessrl.testkit.timing files` writes from a measured table), so no long file
starts last while the other workers idle; a file the table does not know counts as the median.

(xdist's `loadgroup` would let files share a worker, but its group never reaches the scheduler
under pytest 9: it rewrites `item._nodeid`, which pytest 9's `nodeid` no longer reads.)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

FILE_TIMES = Path("tests") / "file-times.json"


def file_of(item: pytest.Item) -> str:
    """The test file an item belongs to (its unit of work under `--dist loadfile`)."""
    return item.nodeid.split("::")[0]


def file_times(root: Path) -> dict[str, float]:
    """Measured seconds per test file (empty when the repository has no table)."""
    path = root / FILE_TIMES
    return {str(k): float(v) for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def costliest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """Items ordered by their file's time, costliest file first (stable within a file)."""
    default = statistics.median(seconds.values()) if seconds else 0.0
    return sorted(items, key=lambda item: -seconds.get(file_of(item), default))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: costliest files first (the scheduler hands out files in this order).

    Every worker orders the same collection the same way, as xdist requires.
    """
    if hasattr(config, "workerinput"):
        items[:] = costliest_first(items, file_times(config.rootpath))

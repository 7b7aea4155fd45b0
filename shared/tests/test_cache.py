"""The build cache: a build runs once, even with builders racing, and never shows half a result."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from harnessrl.shared.cache import build_once


def test_racing_builders_build_once(tmp_path: Path) -> None:
    builds: list[Path] = []

    def build(staging: Path) -> None:
        builds.append(staging)
        time.sleep(0.2)  # long enough for the other builders to arrive mid-build
        (staging / "part").write_text("half")
        (staging / "done").write_text("whole")

    target = tmp_path / "cache" / "thing-1234"
    results: list[Path] = []
    racers = [
        threading.Thread(target=lambda: results.append(build_once(target, build, done="done")))
        for _ in range(4)
    ]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert len(builds) == 1 and results == [target] * 4
    assert (target / "done").read_text() == "whole"
    assert sorted(p.name for p in target.parent.iterdir()) == ["thing-1234", "thing-1234.lock"]


def test_a_failed_build_leaves_nothing_and_is_retried(tmp_path: Path) -> None:
    target = tmp_path / "thing"

    def broken(staging: Path) -> None:
        (staging / "part").write_text("half")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        build_once(target, broken, done="done")
    assert not target.exists() and not (tmp_path / "thing.tmp").exists()
    assert build_once(target, lambda staging: (staging / "done").touch(), done="done") == target

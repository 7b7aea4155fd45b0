"""`make analytics-check`, as CI runs it: every tap on one short real run agrees with the stream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(1500)
def test_every_tap_sees_the_whole_run_exactly_once(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "harnessrl.benchmarks.analytics_check", "--home", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1400, check=False)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, json.dumps(result) + "\n" + done.stderr[-3000:]
    assert result["stream_spans"] > 0
    assert result["parquet_spans"] == result["otlp_spans"] == result["stream_spans"]
    assert result["duplicates"] == 0 and result["missing"] == 0
    assert result["export_parts_before_kill"] >= 2  # the kill came mid-way, with parts committed
    assert result["services_reporting"] == ["controller", "gateway", "reward", "trainer"]
    assert result["dashboard_rendered"] is True
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000

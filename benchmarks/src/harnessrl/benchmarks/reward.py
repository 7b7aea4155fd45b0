"""`make bench-reward`: local-sandbox grading of every tinyswe gold patch with one worker.

The last stdout line is one JSON object: graded_per_min, p50_grade_s, instances (and more).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.settings import SandboxLimits
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.pipeline import grade_patch
from harnessrl.reward.swe.sandbox import available_limits
from harnessrl.reward.tinyswe.build import ensure_tinyswe, load_instances


async def _run() -> dict[str, float | int]:
    root = ensure_tinyswe(sys.executable)
    rows = load_instances(root)
    # What this machine's sandbox gives (it refuses to run weaker than asked).
    limits = available_limits(SandboxLimits(), sys.executable)
    context = GradingContext(tasks_root=str(root), python=sys.executable, limits=limits)
    durations: list[float] = []
    resolved = 0
    started = time.monotonic()
    for row in rows:
        began = time.monotonic()
        grade = await grade_patch(
            SweInstance.from_row(row), context.resolve(row["repo_path"]), row["patch"].encode(), context
        )
        durations.append(time.monotonic() - began)
        resolved += int(bool(grade.resolved))
    elapsed = time.monotonic() - started
    ordered = sorted(durations)
    return {
        "graded_per_min": round(len(rows) / elapsed * 60, 1),
        "p50_grade_s": round(statistics.median(ordered), 3),
        "p95_grade_s": round(ordered[int(0.95 * (len(ordered) - 1))], 3),
        "instances": len(rows),
        "resolved": resolved,
    }


def main() -> None:
    """Run the benchmark and print its JSON line."""
    result = asyncio.run(_run())
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

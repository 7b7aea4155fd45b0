"""Scripted agents over all of tinyswe: gold resolves every instance, empty and wrong none."""

import asyncio
import subprocess
from pathlib import Path
from typing import Any

from harnessrl.reward.graders.base import Grade, GradingContext
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.pipeline import grade_patch

WORKERS = 2


def wrong_fix(root: Path, row: dict[str, Any]) -> str:
    """A plausible edit of the buggy file that leaves the bug in place."""
    path = row["patch"].split("\n", 1)[0].split(" b/", 1)[1]
    text = subprocess.run(
        ["git", "show", f"{row['base_commit']}:{path}"],
        cwd=root / row["repo_path"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = text.splitlines(keepends=True)
    context = "".join(" " + line for line in lines[:3])
    return (
        f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
        f"@@ -1,3 +1,4 @@\n{context}+# Checked the edge cases here.\n"
    )


async def grade_all(rows: list[dict[str, Any]], patches: list[bytes], context: GradingContext) -> list[Grade]:
    gate = asyncio.Semaphore(WORKERS)

    async def one(row: dict[str, Any], patch: bytes) -> Grade:
        async with gate:
            return await grade_patch(
                SweInstance.from_row(row), context.resolve(row["repo_path"]), patch, context
            )

    return await asyncio.gather(*(one(r, p) for r, p in zip(rows, patches, strict=True)))


async def test_gold_patches_resolve_every_instance(
    tinyswe_rows: list[dict[str, Any]], context: GradingContext
) -> None:
    grades = await grade_all(tinyswe_rows, [r["patch"].encode() for r in tinyswe_rows], context)
    failed = [
        (r["instance_id"], g.outcome, g.details.get("reason"))
        for r, g in zip(tinyswe_rows, grades, strict=True)
        if not g.resolved
    ]
    assert failed == []
    assert all(g.reward == 1.0 and g.outcome == "graded" for g in grades)


async def test_empty_patches_resolve_nothing(
    tinyswe_rows: list[dict[str, Any]], context: GradingContext
) -> None:
    grades = await grade_all(tinyswe_rows, [b""] * len(tinyswe_rows), context)
    assert {(g.outcome, g.resolved, g.reward) for g in grades} == {("empty-patch", False, 0.0)}


async def test_wrong_fixes_resolve_nothing(
    tinyswe_root: Path, tinyswe_rows: list[dict[str, Any]], context: GradingContext
) -> None:
    patches = [wrong_fix(tinyswe_root, r).encode() for r in tinyswe_rows]
    grades = await grade_all(tinyswe_rows, patches, context)
    assert [g.outcome for g in grades] == ["graded"] * len(grades)
    assert not any(g.resolved for g in grades)
    assert sum(g.reward for g in grades) == 0.0
    assert all(g.details["FAIL_TO_PASS"]["failure"] for g in grades)

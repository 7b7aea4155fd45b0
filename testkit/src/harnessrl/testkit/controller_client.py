"""Talking to controllers from tests and benchmarks: start one as a process, ask it over the control API.

`ask` retries while no controller answers (one starting, or a standby taking over), so callers
can use it as "wait until a controller serves, then ask".
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus import Bus, BusError


async def start_controller(env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    """`python -m harnessrl.controller` with `env`, its output appended to `log`."""
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harnessrl.controller", env=env, stdout=out, stderr=out
        )


async def ask(bus: Bus, verb: str, payload: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    """The controller's JSON reply to `verb`, retried while no controller serves the control API."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                raw = await bus.request(control_api.subject(verb), json.dumps(payload).encode(), timeout=5)
            except BusError:
                await asyncio.sleep(0.1)
                continue
            reply: dict[str, Any] = json.loads(raw)
            return reply


async def completed(bus: Bus, run: str) -> int:
    """How many of the run's episodes have completed (their `completed` events on EPISODES)."""
    return len(await bus.replay(subjects.EPISODES.name, subjects.episode_events_of_run(run, "completed")))

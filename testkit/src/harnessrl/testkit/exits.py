"""Test aids for launchers: a recorder of exit callbacks and a ready-made launch request."""

from __future__ import annotations

import asyncio

from harnessrl.controller.launchers import ExitStatus, LaunchRequest
from harnessrl.shared.contracts import TaskSpec


def launch_request(
    episode: str, command: list[str], *, timeout_s: float = 30.0, run: str = "r1"
) -> LaunchRequest:
    """A launch request for a simple question task with a fake key."""
    return LaunchRequest(
        run=run,
        episode=episode,
        task=TaskSpec(task_id="t1", prompt="What is 2+2?"),
        command=command,
        env={"HARNESSRL_TASK": "What is 2+2?"},
        secret_env={"HARNESSRL_EPISODE_KEY": "hrl_secret-key"},
        timeout_s=timeout_s,
    )


class ExitRecorder:
    """Collects a launcher's exit callbacks; `wait` returns an episode's first one."""

    def __init__(self) -> None:
        self.seen: dict[str, list[ExitStatus]] = {}
        self._changed = asyncio.Event()

    async def __call__(self, episode: str, status: ExitStatus) -> None:
        """The exit callback."""
        self.seen.setdefault(episode, []).append(status)
        self._changed.set()

    async def wait(self, episode: str, timeout: float = 30.0) -> ExitStatus:
        """Wait until `episode` was reported."""
        async with asyncio.timeout(timeout):
            while episode not in self.seen:
                self._changed.clear()
                await self._changed.wait()
        return self.seen[episode][0]

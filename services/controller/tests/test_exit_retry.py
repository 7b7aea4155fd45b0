"""An episode's end reaches the run's book even when recording it fails for a while.

Seen under `make chaos`: a NATS node restarting made the end's artifact read time out, which ended
the launcher's watcher task silently and left the episode "started" forever.
"""

from __future__ import annotations

import pytest

from harnessrl.controller import run_driver
from harnessrl.controller.launchers import ExitStatus
from harnessrl.controller.run_driver import RunDriver
from harnessrl.shared.log import get_logger


class FlakyEpisodes:
    """`exited` that times out `failures` times, then records."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    async def exited(self, episode: str, status: ExitStatus) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise TimeoutError("nats: timeout")


async def test_a_failed_record_of_an_end_is_retried_until_it_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_driver, "EXIT_RETRY_FIRST_S", 0.01)
    driver = RunDriver.__new__(RunDriver)  # only the retry is under test: no bus, store or launcher
    episodes = FlakyEpisodes(failures=3)
    driver.episodes, driver._log = episodes, get_logger(__name__)  # type: ignore[assignment]
    await driver._exited_until_recorded("e1", ExitStatus(outcome="exited", exit_code=0))
    assert episodes.calls == 4

"""Bring-your-own episodes: harnesses started outside the scheduler (CI, a notebook, a script).

`open` creates an episode record in a run (phase started, launcher "byo") and hands back the base
URLs and a signed key; `close` (authorised by that key) stores the optional artifact and ends the
episode exactly as a launcher would, so reward, rollouts and training treat it like any other. An
episode nobody closes fails with `timeout` at the run's episode deadline, also across restarts.
"""

from __future__ import annotations

import asyncio
import time

from harnessrl.controller.errors import RequestRefusedError
from harnessrl.controller.launchers import ExitStatus
from harnessrl.controller.records import EpisodeRecord
from harnessrl.controller.run_driver import RunDriver
from harnessrl.controller.settings import ControllerSettings
from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.ids import new_id
from harnessrl.shared.keys import EpisodeKeyError, verify_episode_key


class ExternalEpisodes:
    """Opens and closes bring-your-own episodes of the controller's runs."""

    def __init__(self, bus: Bus, settings: ControllerSettings, runs: dict[str, RunDriver]) -> None:
        self._bus, self._settings, self._runs = bus, settings, runs
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._counter = 0

    async def open(self, request: control_api.OpenRequest) -> bytes:
        """Handle `episode open`: a new started episode and its key."""
        driver = self._driver(request.run)
        task = self._task(driver, request.task)
        episode = new_id("byo")
        record = EpisodeRecord(
            run=driver.spec.run,
            episode=episode,
            task=task,
            group=episode,
            byo=True,
            expected_version=driver.version,
        )
        async with driver.episodes.lock(episode):
            await driver.episodes.add(record)
            await driver.episodes.started(episode, "byo")
        timeout = driver.spec.episode_timeout_s
        self._arm(driver, episode, time.time() + timeout)
        gateway = self._settings.gateway_url.rstrip("/")
        spec = driver.episodes.task_of(record)
        return control_api.reply(
            run=driver.spec.run,
            episode=episode,
            task=task,
            prompt=spec.prompt if spec else "",
            base_url=f"{gateway}/v1",
            anthropic_base_url=gateway,
            gateway_url=gateway,
            key=driver.key_for(episode, timeout),
            expires_at=time.time() + timeout,
        )

    async def close(self, request: control_api.CloseRequest) -> bytes:
        """Handle `episode close`: store the artifact, then end the episode like a launcher."""
        try:
            claims = verify_episode_key(self._settings.secret, request.key)
        except EpisodeKeyError as exc:
            raise RequestRefusedError(f"episode key refused: {exc}") from exc
        driver = self._driver(claims.run)
        record = driver.episodes.records.get(claims.episode)
        if record is None or not record.byo:
            raise RequestRefusedError(f"no bring-your-own episode {claims.episode!r} in {claims.run!r}")
        if record.phase != "started":
            raise RequestRefusedError(f"episode {claims.episode!r} is already {record.phase}")
        data = request.artifact()
        if data:
            name = subjects.artifact_object(claims.run, claims.episode, request.kind)
            await self._bus.put_object(subjects.ARTIFACTS_BUCKET, name, data)
        self._disarm(claims.episode)
        await driver.episodes.exited(
            claims.episode, ExitStatus(outcome="exited", exit_code=request.exit_code)
        )
        return control_api.reply(
            run=claims.run, episode=claims.episode, phase=driver.episodes.records[claims.episode].phase
        )

    async def resume(self, driver: RunDriver) -> None:
        """Re-arm the deadlines of a resumed run's open BYO episodes."""
        for record in driver.episodes.records.values():
            if record.byo and record.phase == "started":
                self._arm(driver, record.episode, record.created_at + driver.spec.episode_timeout_s)

    async def stop(self) -> None:
        """Cancel every deadline timer."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _driver(self, run: str) -> RunDriver:
        driver = self._runs.get(run)
        if driver is None:
            raise RequestRefusedError(f"unknown run {run!r} (submit it first: harnessrl run submit)")
        return driver

    def _task(self, driver: RunDriver, task: str | None) -> str:
        if task is None:
            self._counter += 1
            pool = [t for t in driver.episodes.tasks.values() if not t.heldout] or list(
                driver.episodes.tasks.values()
            )
            return pool[self._counter % len(pool)].task_id
        if task not in driver.episodes.tasks:
            raise RequestRefusedError(f"run {driver.spec.run!r} has no task {task!r}")
        return task

    def _arm(self, driver: RunDriver, episode: str, deadline: float) -> None:
        status = ExitStatus(outcome="timeout", reason="bring-your-own episode was never closed")

        def expire() -> None:
            self._timers.pop(episode, None)
            driver.spawn(driver.episodes.exited(episode, status))

        loop = asyncio.get_running_loop()
        self._timers[episode] = loop.call_later(max(0.0, deadline - time.time()), expire)

    def _disarm(self, episode: str) -> None:
        timer = self._timers.pop(episode, None)
        if timer is not None:
            timer.cancel()

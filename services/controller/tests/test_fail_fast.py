"""Fail fast against a real nats-server and real harness processes: a run whose first group all
failed the same way stops at once, says why, stays stopped after a restart; anything else runs on.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from harnessrl.controller.fail_fast import FailFast
from harnessrl.controller.records import EpisodeRecord
from harnessrl.controller.run_driver import RunDriver
from harnessrl.controller.service import Controller
from harnessrl.controller.settings import ControllerSettings
from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import LauncherSpec, RunSpec, RunStopped, decode, decode_event
from harnessrl.testkit.artifact_sink import ArtifactSink
from harnessrl.testkit.reward_stub import StubReward

SECRET = "fail-fast-secret"
BOOM = "echo boom >&2; exit 3"


class Deployment:
    """A controller, a stub reward and an artifact sink for one run; the controller can restart."""

    def __init__(self, bus: NatsBus, tmp_path: Path) -> None:
        self.bus, self.tmp_path = bus, tmp_path
        self.run = f"ff-{os.urandom(3).hex()}"
        self.sink = ArtifactSink(bus, SECRET.encode())
        self.reward = StubReward(bus, self.run)
        self.controller: Controller | None = None

    async def start_controller(self) -> Controller:
        settings = ControllerSettings(
            key_secret=SECRET,
            gateway_url=self.sink.url,
            state_dir=str(self.tmp_path / "state"),
            kill_grace_s=0.5,
            runs=[self.run],
        )
        self.controller = Controller(self.bus, settings)
        await self.controller.start()
        return self.controller

    async def submit(self, script: str, **fields: Any) -> RunDriver:
        tasks = self.tmp_path / "tasks.jsonl"
        tasks.write_text(json.dumps({"task_id": "add", "prompt": "What is 2+2?", "answer": "4"}) + "\n")
        launcher = LauncherSpec(command=["sh", "-c", script])
        spec = RunSpec(run=self.run, tasks=str(tasks), launcher=launcher, mode="async", **fields)
        assert self.controller is not None
        return await self.controller.submit(spec)

    async def stops(self) -> list[RunStopped]:
        found = await self.bus.replay(subjects.RUNS.name, subjects.run_event(self.run, "stopped"))
        return [decode(d.data, RunStopped) for d in found]

    async def scheduled(self) -> set[str]:
        found = await self.bus.replay(subjects.EPISODES.name, subjects.episode_events_of_run(self.run))
        return {e.episode for e in map(decode_event, (d.data for d in found))}

    async def status(self) -> dict[str, Any]:
        raw = await self.bus.request(
            control_api.subject("status"), json.dumps({"run": self.run}).encode(), timeout=10
        )
        reply: dict[str, Any] = json.loads(raw)
        return reply


@pytest.fixture
async def deployment(bus: NatsBus, tmp_path: Path) -> AsyncIterator[Deployment]:
    made = Deployment(bus, tmp_path)
    await made.sink.start()
    await made.reward.start()
    await made.start_controller()
    yield made
    if made.controller is not None:
        await made.controller.stop()
    await made.reward.stop()
    await made.sink.stop()


async def wait_stopped(deployment: Deployment, timeout_s: float = 60.0) -> list[RunStopped]:
    async with asyncio.timeout(timeout_s):
        while not (stops := await deployment.stops()):
            await asyncio.sleep(0.1)
    return stops


async def test_first_group_failing_alike_stops_the_run_and_a_restart_leaves_it(
    deployment: Deployment,
) -> None:
    # Three groups, all admitted (async, staleness 5); one group at a time runs (max_concurrent).
    driver = await deployment.submit(
        BOOM, group_size=3, batch_tasks=1, max_steps=3, staleness=5, max_concurrent=3
    )
    started = asyncio.get_running_loop().time()
    (stopped,) = await wait_stopped(deployment)
    assert asyncio.get_running_loop().time() - started < 60
    assert (stopped.cause, stopped.reason, stopped.episodes) == ("agent", "harness exited with 3", 3)
    assert "boom" in stopped.detail and Path(stopped.logs).is_dir()
    # The harness's last words only: the episode runner's own lines go to runner.log.
    assert (
        "artifact." not in stopped.detail and "artifact." in (Path(stopped.logs) / "runner.log").read_text()
    )
    assert (Path(stopped.logs) / "stderr.log").exists()
    await asyncio.sleep(1.0)  # the second group would have started by now
    assert {r.batch for r in driver.episodes.records.values()} == {0}
    assert all(e.startswith("e0000-") for e in await deployment.scheduled())
    status = (await deployment.status())["runs"][deployment.run]
    assert status["state"] == "stopped" and status["stopped"]["reason"] == "harness exited with 3"
    assert status["failures"] == {"agent": 3}

    assert deployment.controller is not None
    await deployment.controller.stop()
    again = await deployment.start_controller()
    assert deployment.run not in again.runs  # a stopped run is not resumed
    record = await again.store.run(deployment.run)
    assert record is not None and record.state == "stopped" and record.stop_published
    status = (await deployment.status())["runs"][deployment.run]
    assert status["state"] == "stopped" and "boom" in status["stopped"]["detail"]
    await asyncio.sleep(1.0)
    assert len(await deployment.stops()) == 1
    assert all(e.startswith("e0000-") for e in await deployment.scheduled())


@pytest.mark.parametrize(
    ("script", "fields"),
    [
        # Different reasons: exit 3 and exit 4.
        ('case "$HARNESSRL_EPISODE" in *-00-a0) echo boom >&2; exit 3;; *) exit 4;; esac', {}),
        # Different causes: an agent failure and a timeout.
        ('case "$HARNESSRL_EPISODE" in *-00-a0) exit 3;; *) sleep 30;; esac', {"episode_timeout_s": 1.5}),
        # One success among failures.
        ('case "$HARNESSRL_EPISODE" in *-00-a0) echo 4 > answer.txt;; *) exit 3;; esac', {}),
        # All failing alike, but fail fast is off.
        (BOOM, {"fail_fast_groups": 0}),
    ],
    ids=["two-reasons", "two-causes", "one-success", "off"],
)
async def test_anything_but_one_shared_failure_runs_on(
    deployment: Deployment, script: str, fields: dict[str, Any]
) -> None:
    driver = await deployment.submit(
        script, group_size=2, batch_tasks=1, max_steps=2, staleness=2, max_concurrent=2, **fields
    )
    await asyncio.wait_for(driver.done.wait(), 60)
    assert {r.batch for r in driver.episodes.records.values()} == {0, 1}
    assert driver.stopped is None and await deployment.stops() == []


async def test_two_fail_fast_groups_wait_for_both(deployment: Deployment) -> None:
    driver = await deployment.submit(
        BOOM, group_size=1, batch_tasks=1, max_steps=3, staleness=5, max_concurrent=1, fail_fast_groups=2
    )
    (stopped,) = await wait_stopped(deployment)
    assert stopped.episodes == 2
    assert {r.batch for r in driver.episodes.records.values()} == {0, 1}


def record(member: int, attempt: int, **fields: Any) -> EpisodeRecord:
    episode = f"e0000-000-{member:02d}-a{attempt}"
    return EpisodeRecord(
        run="r", episode=episode, task="t", group="g0000-000", member=member, attempt=attempt, **fields
    )


def test_only_each_members_final_attempt_counts() -> None:
    spec = RunSpec(run="r", tasks="t.jsonl", group_size=2, launcher=LauncherSpec(command=["true"]))
    gate = FailFast(spec)
    lost = {"phase": "failed", "cause": "infra", "reason": "harness lost"}
    agent = {"phase": "failed", "cause": "agent", "reason": "harness exited with 3", "detail": "boom"}
    records = [record(0, 0, **lost, retried_as="e0000-000-00-a1"), record(0, 1), record(1, 0, **agent)]
    assert gate.verdict(records) is None and not gate.settled  # member 0's retry still runs
    records[1] = record(0, 1, **agent, logs="/x")
    stopped = gate.verdict(records)
    assert stopped is not None and (stopped.cause, stopped.episodes, stopped.detail) == ("agent", 2, "boom")
    assert gate.settled and gate.verdict(records) is None  # decided once

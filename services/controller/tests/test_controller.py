"""The controller against a real nats-server: lifecycle, retries, admission, reward errors, BYO."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from harnessrl.controller.launchers.kube_manifest import job_name
from harnessrl.controller.records import EpisodeRecord
from harnessrl.controller.run_driver import RunDriver
from harnessrl.controller.service import Controller
from harnessrl.controller.settings import ControllerSettings
from harnessrl.controller.store import EpisodeStore
from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus import BusError, NatsBus
from harnessrl.shared.contracts import (
    LauncherSpec,
    RolloutComplete,
    RunSpec,
    WeightVersion,
    decode,
    decode_event,
)
from harnessrl.testkit.artifact_sink import ArtifactSink
from harnessrl.testkit.fake_kube import FakeKubeServer
from harnessrl.testkit.reward_stub import StubReward

SECRET = "controller-test-secret"
HARNESS = 'echo "$HARNESSRL_TASK" > seen.txt; case "$HARNESSRL_TASK" in *2+2*) echo 4 > answer.txt;; esac'


def unique(prefix: str) -> str:
    return f"{prefix}-{os.urandom(3).hex()}"


def write_tasks(tmp_path: Path) -> Path:
    rows = [
        {"task_id": "add", "prompt": "What is 2+2?", "answer": "4"},
        {"task_id": "mul", "prompt": "What is 3*3?", "answer": "9"},
        {"task_id": "held", "prompt": "What is 5*5?", "answer": "25", "heldout": True},
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Harness:
    """A controller, a stub reward and an artifact sink on one bus, for one run."""

    def __init__(self, bus: NatsBus, tmp_path: Path, run: str, kube_url: str = "") -> None:
        self.bus, self.tmp_path, self.run = bus, tmp_path, run
        self.sink = ArtifactSink(bus, SECRET.encode())
        self.reward = StubReward(bus, run, reward_errors=frozenset({"mul"}) if "rerr" in run else frozenset())
        self.kube_url = kube_url
        self.controller: Controller | None = None

    async def start(self) -> None:
        await self.sink.start()
        await self.reward.start()
        await self.start_controller()

    async def start_controller(self) -> None:
        """A controller for the run (a second call: the next controller, on the same bus and state)."""
        settings = ControllerSettings(
            key_secret=SECRET,
            gateway_url=self.sink.url,
            state_dir=str(self.tmp_path / "state"),
            kube_api_url=self.kube_url,
            kube_watch_timeout_s=5,
            kill_grace_s=0.5,
            runs=[self.run],
        )
        self.controller = Controller(self.bus, settings)
        await self.controller.start()

    async def submit(self, **fields: Any) -> RunDriver:
        assert self.controller is not None
        launcher = fields.pop("launcher", LauncherSpec(command=["sh", "-c", HARNESS]))
        spec = RunSpec(run=self.run, tasks=str(write_tasks(self.tmp_path)), launcher=launcher, **fields)
        return await self.controller.submit(spec)

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
        await self.reward.stop()
        await self.sink.stop()

    async def events(self) -> list[Any]:
        found = await self.bus.replay(subjects.EPISODES.name, f"hrl.episode.{self.run}.>")
        return [decode_event(d.data) for d in found]

    async def rollouts(self) -> list[RolloutComplete]:
        found = await self.bus.replay(subjects.ROLLOUTS.name, subjects.rollout(self.run))
        return [decode(d.data, RolloutComplete) for d in found]


@pytest.fixture
async def harness(bus: NatsBus, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    kube: FakeKubeServer | None = None
    if "kube" in request.node.name:
        kube = FakeKubeServer()
        await kube.start()
    made = Harness(
        bus,
        tmp_path,
        unique("rerr" if "reward_error" in request.node.name else "run"),
        kube.url if kube else "",
    )
    made.kube = kube  # type: ignore[attr-defined]
    await made.start()
    yield made
    await made.stop()
    if kube is not None:
        await kube.stop()


def kind(event: Any) -> str:
    return str(event.__struct_config__.tag)


def terminal_counts(events: list[Any]) -> Counter[str]:
    return Counter(e.episode for e in events if kind(e) in ("completed", "failed"))


async def test_run_completes_with_rewards_rollouts_and_one_terminal_each(harness: Harness) -> None:
    driver = await harness.submit(
        group_size=2, batch_tasks=2, max_steps=1, sampling={"temperature": 0.7}, token_in=True
    )
    await asyncio.wait_for(driver.done.wait(), 60)
    events = await harness.events()
    kinds = Counter(kind(e) for e in events)
    assert kinds == {"scheduled": 4, "started": 4, "agent_exited": 4, "scored": 4, "completed": 4}
    # The run's sampling policy and token-in choice travel with each schedule, for the gateway.
    scheduled = [e for e in events if kind(e) == "scheduled"]
    assert [(e.sampling, e.token_in) for e in scheduled] == [({"temperature": 0.7}, True)] * 4
    assert set(terminal_counts(events).values()) == {1}
    exited = [e for e in events if kind(e) == "agent_exited"]
    assert all(e.task_spec is not None and e.task_spec.task_id == e.task for e in exited)
    assert {e.artifact.object_name for e in exited if e.task == "add"} == {
        f"{harness.run}/{e.episode}/answer" for e in exited if e.task == "add"
    }
    rollouts = await harness.rollouts()
    assert sorted((r.task, r.reward, r.failure) for r in rollouts) == [
        ("add", 1.0, None),
        ("add", 1.0, None),
        ("mul", 0.0, None),
        ("mul", 0.0, None),
    ]
    assert all(r.group_size == 2 and r.last_seq == -1 and r.span_count == 0 for r in rollouts)
    assert "held" not in {r.task for r in rollouts}  # held-out tasks are never trained on


async def test_agent_failure_and_timeout_are_terminal_not_retried(harness: Harness) -> None:
    script = 'case "$HARNESSRL_TASK" in *2+2*) exit 3;; *) sleep 30;; esac'
    driver = await harness.submit(
        group_size=1,
        batch_tasks=2,
        max_steps=1,
        episode_timeout_s=1.5,
        launcher=LauncherSpec(command=["sh", "-c", script]),
        fail_fast_groups=0,  # the first group fails: this run must still go on
    )
    await asyncio.wait_for(driver.done.wait(), 60)
    rollouts = {r.task: r for r in await harness.rollouts()}
    assert (rollouts["add"].failure, rollouts["mul"].failure) == ("agent", "timeout")
    events = await harness.events()
    assert not [e for e in events if kind(e) == "retried"]
    assert set(terminal_counts(events).values()) == {1}


async def test_reward_error_is_the_reward_services_terminal_event(harness: Harness) -> None:
    driver = await harness.submit(group_size=1, batch_tasks=2, max_steps=1)
    await asyncio.wait_for(driver.done.wait(), 60)
    events = await harness.events()
    assert set(terminal_counts(events).values()) == {1}
    failed = [e for e in events if kind(e) == "failed"]
    assert [(e.task, e.cause) for e in failed] == [("mul", "reward-error")]
    rollouts = {r.task: r.failure for r in await harness.rollouts()}
    assert rollouts == {"add": None, "mul": "reward-error"}


async def test_sync_mode_waits_for_the_next_weight_version(harness: Harness) -> None:
    driver = await harness.submit(group_size=2, batch_tasks=1, max_steps=2, mode="sync")
    async with asyncio.timeout(60):
        while len([r for r in driver.episodes.records.values() if r.terminal]) < 2:
            await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    assert {r.batch for r in driver.episodes.records.values()} == {0}  # batch 1 is held back
    version = WeightVersion(run=harness.run, version=1, step=1)
    await harness.bus.publish(subjects.weights(harness.run), version, msg_id=f"{harness.run}:v1")
    await asyncio.wait_for(driver.done.wait(), 60)
    assert {r.batch for r in driver.episodes.records.values()} == {0, 1}
    scheduled = [e for e in await harness.events() if kind(e) == "scheduled"]
    assert {e.expected_version for e in scheduled if e.episode.startswith("e0001")} == {1}


async def test_a_step_that_trained_nothing_still_admits_the_next_batch(harness: Harness) -> None:
    driver = await harness.submit(group_size=1, batch_tasks=1, max_steps=2, mode="sync")
    async with asyncio.timeout(60):
        while not all(r.terminal for r in driver.episodes.records.values()):
            await asyncio.sleep(0.1)
    assert not driver.admitted(1)
    # The trainer skipped its step: same weights (version 0), but step 1 is done.
    carried = WeightVersion(run=harness.run, version=0, step=1, carries_previous=True)
    await harness.bus.publish(subjects.weights(harness.run), carried, msg_id=f"{harness.run}:s1")
    await asyncio.wait_for(driver.done.wait(), 60)
    assert {r.batch for r in driver.episodes.records.values()} == {0, 1}
    assert (driver.version, driver.steps) == (0, 1)
    scheduled = [e for e in await harness.events() if kind(e) == "scheduled"]
    assert {e.expected_version for e in scheduled if e.episode.startswith("e0001")} == {0}


async def test_a_local_harness_this_machine_cannot_start_is_refused_at_submit(
    harness: Harness, tmp_path: Path
) -> None:
    gone = tmp_path / "gone.py"
    for command, message in (
        (["nosuch-harness-bin", "-y"], "program nosuch-harness-bin is not on the controller's PATH"),
        (["python3", str(gone)], f"script {gone} does not exist"),
        (["python3", "agent.py"], "script agent.py is a relative path"),
    ):
        spec = {
            "run": harness.run,
            "tasks": str(write_tasks(tmp_path)),
            "launcher": {"command": command},
        }
        raw = await harness.bus.request(control_api.subject("submit"), json.dumps({"spec": spec}).encode())
        reply = json.loads(raw)
        assert not reply["ok"] and "`launcher.command[" in reply["error"] and message in reply["error"]
    assert harness.controller is not None and harness.run not in harness.controller.runs
    assert await harness.controller.store.run(harness.run) is None  # nothing was recorded
    assert await harness.events() == []  # no episode started
    raw = await harness.bus.request(control_api.subject("status"), b"{}")
    assert json.loads(raw)["refused"] == {harness.run: 3}


async def test_async_mode_admits_within_the_staleness_bound(harness: Harness) -> None:
    driver = await harness.submit(group_size=1, batch_tasks=1, max_steps=4, mode="async", staleness=2)
    async with asyncio.timeout(60):
        while len([r for r in driver.episodes.records.values() if r.terminal]) < 3:
            await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    assert {r.batch for r in driver.episodes.records.values()} == {0, 1, 2}  # version 0 + staleness 2
    assert driver.admitted(2) and not driver.admitted(3)


async def test_kube_eviction_is_retried_as_a_new_attempt(harness: Harness) -> None:
    kube: FakeKubeServer = harness.kube  # type: ignore[attr-defined]
    driver = await harness.submit(
        group_size=1,
        batch_tasks=1,
        max_steps=1,
        infra_retries=1,
        launcher=LauncherSpec(kind="kubernetes", command=["true"], image="h:1"),
    )
    first, retry = "e0000-000-00-a0", "e0000-000-00-a1"
    store = kube.api.store
    async with asyncio.timeout(30):
        while ("jobs", "default", job_name(harness.run, first)) not in store.objects:
            await asyncio.sleep(0.05)
    from harnessrl.testkit import kube_jobs

    kube_jobs.evict(store, store.get("jobs", "default", job_name(harness.run, first)))
    async with asyncio.timeout(30):
        while ("jobs", "default", job_name(harness.run, retry)) not in store.objects:
            await asyncio.sleep(0.05)
    kube_jobs.complete(store, store.get("jobs", "default", job_name(harness.run, retry)))
    await asyncio.wait_for(driver.done.wait(), 60)
    events = await harness.events()
    assert [(kind(e), e.cause, e.logs) for e in events if e.episode == first and kind(e) == "failed"] == [
        ("failed", "infra", f"default/{job_name(harness.run, first)}")
    ]
    assert [e.new_episode for e in events if kind(e) == "retried"] == [retry]
    rollouts = await harness.rollouts()
    assert [(r.episode, r.attempt, r.failure) for r in rollouts] == [(retry, 1, None)]


async def test_bring_your_own_episode_over_the_bus(harness: Harness) -> None:
    driver = await harness.submit(group_size=1, batch_tasks=1, max_steps=1)
    await asyncio.wait_for(driver.done.wait(), 60)
    bus = harness.bus
    opened = json.loads(
        await bus.request(
            control_api.subject("open"), json.dumps({"run": harness.run, "task": "add"}).encode()
        )
    )
    assert (
        opened["ok"] and opened["base_url"] == f"{harness.sink.url}/v1" and opened["key"].startswith("hrl_")
    )
    refused = json.loads(await bus.request(control_api.subject("open"), json.dumps({"run": "nope"}).encode()))
    assert refused == {"ok": False, "error": "unknown run 'nope' (submit it first: harnessrl run submit)"}
    import base64

    close = {"key": opened["key"], "artifact_b64": base64.b64encode(b"4\n").decode()}
    closed = json.loads(await bus.request(control_api.subject("close"), json.dumps(close).encode()))
    assert closed["ok"] and closed["phase"] == "exited"
    again = json.loads(await bus.request(control_api.subject("close"), json.dumps(close).encode()))
    assert not again["ok"] and "already" in again["error"]
    async with asyncio.timeout(30):
        while not driver.episodes.records[opened["episode"]].terminal:
            await asyncio.sleep(0.05)
    rollout = [r for r in await harness.rollouts() if r.episode == opened["episode"]]
    assert [(r.task, r.reward) for r in rollout] == [("add", 1.0)]


def fail_creation(monkeypatch: pytest.MonkeyPatch, member: str, how: Any) -> list[str]:
    """Make `EpisodeStore.create_episode` of the episode `member` (e.g. "-01-a0") call `how` once."""
    original, seen = EpisodeStore.create_episode, []

    async def create(store: EpisodeStore, record: EpisodeRecord) -> bool:
        seen.append(record.episode)
        if record.episode.endswith(member) and seen.count(record.episode) == 1:
            await how()
        return await original(store, record)

    monkeypatch.setattr(EpisodeStore, "create_episode", create)
    return seen


async def test_a_scheduling_pass_that_fails_is_retried(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen under `make chaos`: a bus error while a group was being recorded ended the scheduler,
    so the members already recorded were never launched and the run stalled."""

    async def unreachable() -> None:
        raise BusError("KV write not answered in 30 s")

    seen = fail_creation(monkeypatch, "-01-a0", unreachable)
    driver = await harness.submit(group_size=2, batch_tasks=2, max_steps=1)
    await asyncio.wait_for(driver.done.wait(), 60)
    events = await harness.events()
    assert Counter(kind(e) for e in events)["completed"] == 4
    assert set(terminal_counts(events).values()) == {1}
    assert seen.count("e0000-000-01-a0") == 2  # the failed creation, then the retried pass


async def test_a_group_left_half_recorded_by_a_dead_controller_is_completed(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller that dies while recording a group's members leaves the group short; the
    next one records the missing members, so the group is whole and the run ends."""
    hang = asyncio.Event()
    fail_creation(monkeypatch, "-01-a0", hang.wait)  # never set: the controller "dies" here
    await harness.submit(group_size=2, batch_tasks=1, max_steps=1)
    async with asyncio.timeout(30):
        while "scheduled" not in {kind(e) for e in await harness.events()}:
            await asyncio.sleep(0.05)
    assert harness.controller is not None
    await harness.controller.stop()
    monkeypatch.undo()
    await harness.start_controller()
    assert harness.controller is not None
    driver = harness.controller.runs[harness.run]
    await asyncio.wait_for(driver.done.wait(), 60)
    events = await harness.events()
    completed = sorted(e.episode for e in events if kind(e) == "completed")
    assert completed == ["e0000-000-00-a0", "e0000-000-01-a0"]
    assert set(terminal_counts(events).values()) == {1}
    rollouts = await harness.rollouts()
    assert sorted(r.episode for r in rollouts) == completed

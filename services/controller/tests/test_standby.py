"""Two controllers, one active through the lease: a standby takes over, a fenced one stops acting."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.controller.lease import LeaseRecord, lease_key
from harnessrl.controller.standby import EXIT_LEASE_LOST
from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import RolloutComplete, decode, decode_event
from harnessrl.testkit import kube_jobs
from harnessrl.testkit.artifact_sink import ArtifactSink
from harnessrl.testkit.controller_client import ask, completed, start_controller
from harnessrl.testkit.fake_kube import FakeKubeServer
from harnessrl.testkit.reward_stub import StubReward

SECRET = "standby-test-secret"
GROUPS, GROUP_SIZE = 6, 3
# The failover bound the default settings promise (lease_ttl_s = 10: about 12 s, plus the start).
TAKEOVER_BOUND_S = 15.0


def unique(prefix: str) -> str:
    return f"{prefix}-{os.urandom(3).hex()}"


async def wait_for_line(log: Path, text: str, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not log.exists() or text not in log.read_text():
            await asyncio.sleep(0.1)


def controller_env(
    nats_url: str, sink: ArtifactSink, tmp_path: Path, run: str, **extra: str
) -> dict[str, str]:
    return {
        **os.environ,
        "HRL_CONTROLLER_NATS_URL": nats_url,
        "HRL_CONTROLLER_KEY_SECRET": SECRET,
        "HRL_CONTROLLER_GATEWAY_URL": sink.url,
        "HRL_CONTROLLER_STATE_DIR": str(tmp_path / "state"),
        "HRL_CONTROLLER_RUNS": json.dumps([run]),
        **{f"HRL_CONTROLLER_{name.upper()}": value for name, value in extra.items()},
    }


def running_jobs(kube: FakeKubeServer) -> list[dict[str, Any]]:
    jobs = kube.api.store.select("jobs", "default", "")
    return [job for job in jobs if not job.get("status", {}).get("conditions")]


async def jobs_keep_running(kube: FakeKubeServer) -> bool:
    """Whether Jobs are running past the auto-completion delay (created after `auto` was cleared)."""
    if not running_jobs(kube):
        return False
    await asyncio.sleep(kube.api.auto_delay_s + 0.5)  # Jobs created before then have ended by now
    return bool(running_jobs(kube))


def write_tasks(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    rows = (json.dumps({"task_id": f"t{i}", "prompt": f"q{i}", "answer": "a"}) for i in range(3))
    tasks.write_text("".join(row + "\n" for row in rows))
    return tasks


async def test_standby_takes_over_after_kill_9_of_the_active_controller(
    bus: NatsBus, nats_server: Any, tmp_path: Path
) -> None:
    run = unique("standby")
    kube = FakeKubeServer()
    await kube.start()
    kube.api.auto, kube.api.auto_delay_s = "complete", 0.5
    sink = ArtifactSink(bus, SECRET.encode())
    await sink.start()
    reward = StubReward(bus, run)
    await reward.start()
    env = controller_env(
        nats_server.url, sink, tmp_path, run, kube_api_url=kube.url, kube_watch_timeout_s="5"
    )  # the default lease_ttl_s: the bound measured is the one a deployment gets
    active_log, standby_log = tmp_path / "active.log", tmp_path / "standby.log"
    active = await start_controller(env, active_log)
    standby: asyncio.subprocess.Process | None = None
    try:
        await ask(bus, "status", {})
        standby = await start_controller(env, standby_log)
        await wait_for_line(standby_log, "controller.standby")
        spec = {
            "run": run,
            "tasks": str(write_tasks(tmp_path)),
            "group_size": GROUP_SIZE,
            "batch_tasks": GROUPS,
            "max_steps": 1,
            "max_concurrent": 6,
            "launcher": {"kind": "kubernetes", "command": ["true"], "image": "h:1"},
        }
        submitted = await ask(bus, "submit", {"spec": spec})
        assert submitted["ok"], submitted
        async with asyncio.timeout(60):
            while await completed(bus, run) < 4:
                await asyncio.sleep(0.1)
        kube.api.auto = None  # the Jobs created from now on run until the test ends them
        async with asyncio.timeout(30):
            while not await jobs_keep_running(kube):
                await asyncio.sleep(0.05)
        assert "controller.ready" not in standby_log.read_text()  # it never served while standing by
        active.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        await active.wait()
        kube.api.auto = "complete"  # Jobs the new controller creates end by themselves
        await ask(bus, "status", {"run": run}, timeout_s=60)
        failover_s = time.monotonic() - killed_at
        logging.getLogger(__name__).warning("failover took %.2f s", failover_s)
        assert failover_s <= TAKEOVER_BOUND_S, failover_s
        adopted = running_jobs(kube)
        for job in adopted:  # Jobs that ran through the takeover end now, seen by the new controller
            kube_jobs.complete(kube.api.store, job)
        async with asyncio.timeout(120):
            while (await ask(bus, "status", {"run": run}))["runs"][run]["state"] != "done":
                await asyncio.sleep(0.3)
    finally:
        for process in (active, standby):
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await process.wait()
        await reward.stop()
        await sink.stop()
        stats = {"creates": dict(kube.api.store.creates)}
        await kube.stop()

    assert adopted, "no Job was running through the takeover"
    total = GROUPS * GROUP_SIZE
    created = {k: v for k, v in stats["creates"].items() if not k.startswith("pods/")}
    assert len(created) == 2 * total  # one Job and one Secret per episode, nothing else
    assert set(created.values()) == {1}, stats  # no Job or Secret was ever created twice
    events = [decode_event(d.data) for d in await bus.replay(subjects.EPISODES.name, f"hrl.episode.{run}.>")]
    kinds = Counter((e.episode, e.__struct_config__.tag) for e in events)
    episodes = {e.episode for e in events}
    assert len(episodes) == total  # no lost episode, no extra attempt
    for episode in episodes:
        assert kinds[(episode, "completed")] + kinds[(episode, "failed")] == 1, (episode, kinds)
        assert kinds[(episode, "scheduled")] == kinds[(episode, "agent_exited")] == 1
    stored = await bus.replay(subjects.ROLLOUTS.name, subjects.rollout(run))
    rollouts = [decode(d.data, RolloutComplete) for d in stored]
    assert sorted(r.episode for r in rollouts) == sorted(episodes)
    log = standby_log.read_text()
    assert log.index("controller.standby") < log.index("lease.acquired") < log.index("run.reconciled")


async def test_a_controller_whose_lease_is_taken_exits_at_its_next_renewal(
    bus: NatsBus, nats_server: Any, tmp_path: Path
) -> None:
    run = unique("fenced")
    sink = ArtifactSink(bus, SECRET.encode())
    await sink.start()
    ttl = 3.0
    log = tmp_path / "controller.log"
    controller = await start_controller(
        controller_env(nats_server.url, sink, tmp_path, run, lease_ttl_s=str(ttl)), log
    )
    try:
        await ask(bus, "status", {})
        kv = await bus.kv(subjects.CONTROLLER_LEASE)
        key = lease_key("", [run])
        entry = await kv.get(key)
        assert entry is not None
        thief = msgspec.json.encode(LeaseRecord(holder="thief", ttl_s=ttl))
        await kv.update(key, thief, entry.revision)
        taken_at = time.monotonic()
        async with asyncio.timeout(ttl):
            code = await controller.wait()
        exited_s = time.monotonic() - taken_at
    finally:
        if controller.returncode is None:
            controller.kill()
            await controller.wait()
        await sink.stop()
    assert code == EXIT_LEASE_LOST
    assert exited_s < ttl / 3 + 0.5  # at its next renewal, long before the thief's lease could lapse
    assert "lease.lost" in log.read_text()


async def test_a_stopped_controller_hands_the_lease_to_its_standby_at_once(
    bus: NatsBus, nats_server: Any, tmp_path: Path
) -> None:
    run = unique("handover")
    sink = ArtifactSink(bus, SECRET.encode())
    await sink.start()
    ttl = 5.0
    env = controller_env(nats_server.url, sink, tmp_path, run, lease_ttl_s=str(ttl))
    active_log, standby_log = tmp_path / "active.log", tmp_path / "standby.log"
    active = await start_controller(env, active_log)
    standby: asyncio.subprocess.Process | None = None
    try:
        await ask(bus, "status", {})
        standby = await start_controller(env, standby_log)
        await wait_for_line(standby_log, "controller.standby")
        assert "controller.ready" not in standby_log.read_text()  # a standby serves nothing
        active.send_signal(signal.SIGTERM)  # a stop: the controller stops, then hands the lease back
        stopped_at = time.monotonic()
        assert await active.wait() == 0
        await wait_for_line(standby_log, "controller.ready", timeout_s=ttl)
        handover_s = time.monotonic() - stopped_at
    finally:
        for process in (active, standby):
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await process.wait()
        await sink.stop()
    assert "lease.released" in active_log.read_text()
    assert handover_s < ttl / 2  # the standby's next poll (a tenth of the TTL), not a TTL later

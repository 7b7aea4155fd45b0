"""Kill -9 the controller mid-run and restart it: no duplicate Job, no lost episode, one terminal each."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import RolloutComplete, decode, decode_event
from harnessrl.testkit.artifact_sink import ArtifactSink
from harnessrl.testkit.controller_client import ask, completed, start_controller
from harnessrl.testkit.fake_kube import FakeKubeServer
from harnessrl.testkit.reward_stub import StubReward

SECRET = "restart-test-secret"
GROUPS, GROUP_SIZE = 6, 3


async def test_kill_9_and_restart_mid_run(bus: NatsBus, nats_server: Any, tmp_path: Path) -> None:
    run = f"restart-{os.urandom(3).hex()}"
    kube = FakeKubeServer()
    await kube.start()
    kube.api.auto, kube.api.auto_delay_s = "complete", 1.0
    sink = ArtifactSink(bus, SECRET.encode())
    await sink.start()
    reward = StubReward(bus, run)
    await reward.start()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"task_id": f"t{i}", "prompt": f"q{i}", "answer": "a"}) + "\n" for i in range(3))
    )
    env = {
        **os.environ,
        "HRL_CONTROLLER_NATS_URL": nats_server.url,
        "HRL_CONTROLLER_KEY_SECRET": SECRET,
        "HRL_CONTROLLER_GATEWAY_URL": sink.url,
        "HRL_CONTROLLER_KUBE_API_URL": kube.url,
        "HRL_CONTROLLER_KUBE_WATCH_TIMEOUT_S": "5",
        "HRL_CONTROLLER_STATE_DIR": str(tmp_path / "state"),
        "HRL_CONTROLLER_RUNS": json.dumps([run]),
        # The restarted controller waits out the lease of the one it replaces: keep that short here.
        "HRL_CONTROLLER_LEASE_TTL_S": "3",
    }
    log = tmp_path / "controller.log"
    first = await start_controller(env, log)
    try:
        spec = {
            "run": run,
            "tasks": str(tasks),
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
        first.send_signal(signal.SIGKILL)  # mid-run: Jobs running, others scheduled, some done
        await first.wait()
        second = await start_controller(env, log)
        try:
            async with asyncio.timeout(120):
                while (await ask(bus, "status", {"run": run}))["runs"][run]["state"] != "done":
                    await asyncio.sleep(0.3)
        finally:
            second.send_signal(signal.SIGTERM)
            await second.wait()
    finally:
        if first.returncode is None:
            first.kill()
        await reward.stop()
        await sink.stop()
        async with aiohttp.ClientSession() as session, session.get(f"{kube.url}/fake/v1/stats") as r:
            stats = await r.json()
        await kube.stop()

    total = GROUPS * GROUP_SIZE
    created = {k: v for k, v in stats["creates"].items() if not k.startswith("pods/")}
    assert len(created) == 2 * total  # one Job and one Secret per episode, nothing else
    assert set(created.values()) == {1}, stats  # no Job or Secret was ever created twice
    events = [decode_event(d.data) for d in await bus.replay(subjects.EPISODES.name, f"hrl.episode.{run}.>")]
    kinds = Counter((e.episode, e.__struct_config__.tag) for e in events)
    episodes = {e.episode for e in events}
    assert len(episodes) == total  # no lost episode, no extra attempt
    for episode in episodes:
        terminal = kinds[(episode, "completed")] + kinds[(episode, "failed")]
        assert terminal == 1, (episode, kinds)
        assert kinds[(episode, "scheduled")] == kinds[(episode, "agent_exited")] == 1
    rollouts = [
        decode(d.data, RolloutComplete)
        for d in await bus.replay(subjects.ROLLOUTS.name, subjects.rollout(run))
    ]
    assert sorted(r.episode for r in rollouts) == sorted(episodes)
    assert "reconciled" in log.read_text()

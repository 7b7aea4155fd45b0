"""The controller's metrics: `app.serve` against a real nats-server, scraped over HTTP and read on METRICS."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from harnessrl.controller import app
from harnessrl.controller.lease import lease_key
from harnessrl.controller.settings import ControllerSettings
from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import ServiceMetrics
from harnessrl.shared.net import free_port
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.artifact_sink import ArtifactSink
from harnessrl.testkit.controller_client import ask
from harnessrl.testkit.prometheus import scrape
from harnessrl.testkit.reward_stub import StubReward

SECRET = "prometheus-test-secret"
# `add` answers (and is scored), `mul` fails as an agent error.
HARNESS = 'case "$HARNESSRL_TASK" in *2+2*) echo 4 > answer.txt;; *) exit 3;; esac'


def write_tasks(tmp_path: Path) -> Path:
    rows = [{"task_id": "add", "prompt": "What is 2+2?", "answer": "4"}, {"task_id": "mul", "prompt": "3*3?"}]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


async def test_lease_runs_episodes_failures_and_launches_are_served_and_summarised(
    bus: NatsBus, nats_server: NatsServer, tmp_path: Path
) -> None:
    run = f"prom-{os.urandom(3).hex()}"
    sink, reward = ArtifactSink(bus, SECRET.encode()), StubReward(bus, run)
    await sink.start()
    await reward.start()
    settings = ControllerSettings(
        nats_url=nats_server.url, key_secret=SECRET, gateway_url=sink.url, state_dir=str(tmp_path / "state"),
        runs=[run], kill_grace_s=0.5, log_format="console", metrics_port=free_port(), metrics_interval_s=0.2,
    )  # fmt: skip
    url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
    stop = asyncio.Event()
    served = asyncio.create_task(app.serve(settings, stop))
    try:
        spec = {
            "run": run, "tasks": str(write_tasks(tmp_path)), "launcher": {"command": ["sh", "-c", HARNESS]},
            "group_size": 2, "batch_tasks": 2, "max_steps": 1,
        }  # fmt: skip
        assert (await ask(bus, "submit", {"spec": spec}))["ok"]
        assert not (await ask(bus, "submit", {"spec": {**spec, "run": "Not A Run"}}))["ok"]
        async with asyncio.timeout(60):
            while (await scrape(url)).get(("harnessrl_controller_runs", (("state", "done"),))) != 1.0:
                await asyncio.sleep(0.2)
        samples = await scrape(url)
        summary = await summary_with(bus, 'harnessrl_controller_runs{state="done"}', 1.0)
    finally:
        stop.set()
        await asyncio.wait_for(served, 30)
        await reward.stop()
        await sink.stop()

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("harnessrl_controller_lease_held", lease=lease_key("", [run])) == 1.0
    assert value("harnessrl_controller_episodes", run=run, phase="completed") == 2.0
    assert value("harnessrl_controller_episodes", run=run, phase="failed") == 2.0
    assert value("harnessrl_controller_episodes", run=run, phase="scheduled") == 0.0
    assert value("harnessrl_controller_episode_failures_total", run=run, cause="agent") == 2.0
    assert value("harnessrl_controller_episode_retries_total", run=run) == 0.0
    assert value("harnessrl_controller_episodes_in_flight", run=run) == 0.0
    assert value("harnessrl_controller_groups_unscheduled", run=run) == 0.0
    assert value("harnessrl_controller_launches_total", kind="local", outcome="launched") == 4.0
    assert value("harnessrl_controller_run_submissions_refused_total") == 1.0
    assert summary.service == "controller"
    assert summary.values[f'harnessrl_controller_episodes{{phase="completed",run="{run}"}}'] == 2.0


async def summary_with(bus: NatsBus, key: str, want: float) -> ServiceMetrics:
    """The newest controller summary, once one shows `key` at `want`."""
    async with asyncio.timeout(30):
        while True:
            stored = await bus.replay(subjects.METRICS.name, subjects.service_metrics("controller"))
            summaries = [item.decode(ServiceMetrics) for item in stored]
            if summaries and summaries[-1].values.get(key) == want:
                return summaries[-1]
            await asyncio.sleep(0.1)

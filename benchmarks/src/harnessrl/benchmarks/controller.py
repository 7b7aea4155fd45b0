"""`make bench-controller`: 1,000 episodes through the controller against the fake Kubernetes API.

A real nats-server, the fake API server (its own process, Jobs complete at once), the controller as
its own process (`python -m harnessrl.controller`) and a stub reward publisher. The last stdout line
is one JSON object: episodes, episodes_per_s, duplicate_jobs, lost_episodes, terminal_exactly_once,
controller_cpu_s.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import decode_event
from harnessrl.shared.net import free_port
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.controller_client import ask
from harnessrl.testkit.reward_stub import StubReward

EPISODES, GROUP_SIZE, CONCURRENCY = 1000, 8, 256


def _http(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")  # noqa: S310 - local fake API
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_http(url: str) -> None:
    for _ in range(200):
        try:
            _http(url)
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


async def _measure(home: Path, nats: NatsServer) -> dict[str, Any]:
    port = free_port()
    kube = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "harnessrl.testkit.fake_kube",
        "--port",
        str(port),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    kube_url = f"http://127.0.0.1:{port}"
    await _wait_http(f"{kube_url}/fake/v1/stats")
    _http(f"{kube_url}/fake/v1/config", {"auto": "complete", "auto_delay_s": 0.0})
    run = "bench"
    (home / "tasks.jsonl").write_text(
        "".join(json.dumps({"task_id": f"t{i}", "prompt": f"q{i}", "answer": "a"}) + "\n" for i in range(50))
    )
    env = {
        **os.environ,
        "HRL_CONTROLLER_NATS_URL": nats.url,
        "HRL_CONTROLLER_KEY_SECRET": "bench-secret",
        "HRL_CONTROLLER_KUBE_API_URL": kube_url,
        "HRL_CONTROLLER_STATE_DIR": str(home / "state"),
        "HRL_CONTROLLER_LOG_LEVEL": "WARNING",
    }
    log = (home / "controller.log").open("wb")
    controller = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harnessrl.controller", env=env, stdout=log, stderr=log
    )
    bus = NatsBus(nats.url)
    await bus.connect()
    await bus.ensure_streams()
    reward = StubReward(bus, run)
    try:
        await reward.start()
        await ask(bus, "status", {})
        cpu_before = _cpu_seconds(controller.pid)
        spec = {
            "run": run,
            "tasks": str(home / "tasks.jsonl"),
            "group_size": GROUP_SIZE,
            "batch_tasks": EPISODES // GROUP_SIZE,
            "max_steps": 1,
            "max_concurrent": CONCURRENCY,
            "launcher": {"kind": "kubernetes", "command": ["true"], "image": "harness:bench"},
        }
        began = time.monotonic()
        submitted = await ask(bus, "submit", {"spec": spec})
        if not submitted.get("ok"):
            raise RuntimeError(submitted.get("error"))
        while (status := await ask(bus, "status", {"run": run}))["runs"][run]["state"] != "done":
            sys.stderr.write(json.dumps(status["runs"][run]["phases"]) + "\n")
            await asyncio.sleep(1.0)
        elapsed = time.monotonic() - began
        cpu = _cpu_seconds(controller.pid) - cpu_before
        stats = _http(f"{kube_url}/fake/v1/stats")
        events = [
            decode_event(d.data) for d in await bus.replay(subjects.EPISODES.name, f"hrl.episode.{run}.>")
        ]
    finally:
        await reward.stop()
        await bus.close()
        for process in (controller, kube):
            process.send_signal(signal.SIGTERM)
            await process.wait()
        log.close()
    jobs = {name: n for name, n in stats["creates"].items() if name.startswith("jobs/")}
    terminal = Counter(e.episode for e in events if e.__struct_config__.tag in ("completed", "failed"))
    scheduled = {e.episode for e in events if e.__struct_config__.tag == "scheduled"}
    return {
        "episodes": len(scheduled),
        "episodes_per_s": round(len(scheduled) / elapsed, 1),
        "duplicate_jobs": sum(n - 1 for n in jobs.values()) + max(0, len(jobs) - len(scheduled)),
        "lost_episodes": len(scheduled - set(terminal)),
        "terminal_exactly_once": bool(terminal) and set(terminal.values()) == {1},
        "controller_cpu_s": round(cpu, 2),
        "wall_s": round(elapsed, 2),
    }


def main() -> None:
    """Run the benchmark; the last stdout line is the JSON result."""
    with tempfile.TemporaryDirectory(prefix="hrl-bench-controller-") as tmp:
        home = Path(tmp)
        nats = NatsServer(home / "nats")
        nats.start()
        try:
            result = asyncio.run(_measure(home, nats))
        finally:
            nats.stop()
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

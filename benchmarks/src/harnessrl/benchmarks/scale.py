"""`make bench-scale`: the whole system scaled out on loopback, with a NATS node and the controller killed.

Real processes: a 3-node NATS cluster (R3 streams), three gateway replicas (`python -m
harnessrl.gateway`) behind HAProxy (round-robin per request, no affinity), two controllers (active and
standby behind the lease), two reward workers and a canned upstream registered with every gateway.
A run of scripted OpenAI-SDK harnesses (local launcher, several calls each through the load balancer
with the episode's key) goes through it while the SPANS stream's leader node and then the active
controller are killed -9 and restarted. Then the bus is checked: every episode's seqs are 0..n-1, every
answered call has its span, one terminal event per episode, a rollout for each completed episode whose
spans the trainer's `spans_complete` accepts. Last, a fixed load of chat calls (one episode per
connection) measures requests per second through the load balancer over one replica, over three
round-robin, and (for comparison) over three with each episode's key hashed to one replica.

The last stdout line is one JSON object; the exit code is 1 when any correctness figure is off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from harnessrl.benchmarks.reconcile import claimed, read_bus, verify
from harnessrl.benchmarks.scaled_stack import (
    SECRET,
    SPAN_HEADER,
    Deployment,
    Frontend,
    active_controller,
    run_spec,
    start_upstream,
    wait_for_line,
)
from harnessrl.controller.settings import ControllerSettings
from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.keys import sign_episode_key
from harnessrl.testkit.controller_client import ask

RUN = "scale"
GATEWAYS, NATS_NODES, REWARD_WORKERS = 3, 3, 2
GROUPS, GROUP_SIZE, CALLS, THINK_S, CONCURRENT = 16, 4, 5, 0.2, 8
NATS_DOWN_S = 5.0  # the cluster serves on two nodes meanwhile
LOAD_CONNECTIONS, WARMUP_S, LOAD_S = 32, 1.0, 5.0
LOAD_BODY = json.dumps({
    "model": "canned", "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}],
}).encode()  # fmt: skip
CHAT = "/v1/chat/completions"

# Frontends of the load balancer: round-robin per request over every replica (what the run goes
# through), over the first replica alone, and pinned by the episode key (for comparison only).
FRONTENDS = {"round_robin": Frontend("roundrobin"), "one_replica": Frontend("roundrobin", replicas=1),
             "by_key": Frontend("hdr(Authorization)\n    hash-type consistent")}  # fmt: skip
LAYOUT = {"tasks": GROUPS, "calls": CALLS, "think_s": THINK_S, "group_size": GROUP_SIZE,
          "batch_tasks": GROUPS, "max_steps": 1, "max_concurrent": CONCURRENT, "mode": "sync",
          "staleness": 1}  # fmt: skip


async def _completed(bus: NatsBus, at_least: int) -> None:
    async with asyncio.timeout(180):
        while True:
            done = await bus.replay(subjects.EPISODES.name, subjects.episode_events_of_run(RUN, "completed"))
            if len(done) >= at_least:
                return
            await asyncio.sleep(0.3)


async def _episodes(deployment: Deployment) -> dict[str, Any]:
    """Submit the run, kill the SPANS leader node and then the active controller, wait until done."""
    bus = NatsBus(deployment.cluster.url)
    await bus.connect()
    try:
        deployment.start_controller()
        deployment.start_rewards()
        await ask(bus, "status", {})
        await wait_for_line(deployment.logs[deployment.start_controller()], "controller.standby")
        submitted = await ask(bus, "submit", {"spec": run_spec(deployment.home, RUN, LAYOUT)})
        if not submitted.get("ok"):
            raise RuntimeError(f"run refused: {submitted.get('error')}")
        total = GROUPS * GROUP_SIZE
        await _completed(bus, total // 4)
        killed_node = await _kill_spans_leader(deployment, bus)
        await _completed(bus, total // 2)
        revived = len([name for name in deployment.relaunch_exited() if name.startswith("controller-")])
        failover_s = await _fail_over(deployment, bus)
        await _finished(bus)
    finally:
        await bus.close()
    return {
        "nats_node_killed": killed_node,
        "controllers_lost_lease_in_nats_kill": revived,
        "controller_failover_s": round(failover_s, 2),
    }


async def _finished(bus: NatsBus) -> None:
    async with asyncio.timeout(300):
        while True:
            if (await ask(bus, "status", {"run": RUN}))["runs"][RUN]["state"] == "done":
                return
            await asyncio.sleep(0.5)


async def _kill_spans_leader(deployment: Deployment, bus: NatsBus) -> str:
    """Kill -9 the node leading the SPANS stream, restart it after `NATS_DOWN_S`."""
    info = await bus.js.stream_info(subjects.SPANS.name)
    leader = info.cluster.leader if info.cluster is not None else None
    node = deployment.cluster.node(leader) if leader else deployment.cluster.nodes[0]
    node.kill()
    await asyncio.sleep(NATS_DOWN_S)
    await asyncio.to_thread(node.restart, 30.0)
    return node.name


async def _fail_over(deployment: Deployment, bus: NatsBus) -> float:
    """Kill -9 the active controller; seconds until the standby answers; the killed one restarts."""
    active = await active_controller(deployment, bus)
    deployment.kill(active)
    killed_at = time.monotonic()
    await ask(bus, "status", {"run": RUN}, timeout_s=60)
    failover_s = time.monotonic() - killed_at
    deployment.relaunch(active)
    return failover_s


class LoadRun(msgspec.Struct, kw_only=True):
    """One fixed load: answers inside the measured window, failures, every answered span id."""

    ok: int = 0
    failed: int = 0
    spans: list[str] = msgspec.field(default_factory=list)


async def _drive(url: str, keys: list[str], duration_s: float, into: LoadRun) -> float:
    """One connection per episode key, each calling back-to-back for `duration_s`; returns req/s."""
    ok_before = into.ok
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(keys))) as http:
        deadline = time.perf_counter() + duration_s

        async def worker(key: str) -> None:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
            while time.perf_counter() < deadline:
                with contextlib.suppress(aiohttp.ClientError):  # a refused call counts as failed
                    async with http.post(url + CHAT, data=LOAD_BODY, headers=headers) as response:
                        await response.read()
                        if response.status == 200:
                            into.ok += 1
                            into.spans.append(response.headers.get(SPAN_HEADER, ""))
                            continue
                into.failed += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(key) for key in keys))
        return (into.ok - ok_before) / (time.perf_counter() - started)


async def _load(url: str, run: str) -> tuple[float, LoadRun]:
    keys = [sign_episode_key(SECRET.encode(), run, f"load-{i}", 3600) for i in range(LOAD_CONNECTIONS)]
    result = LoadRun()
    await _drive(url, keys, WARMUP_S, result)
    return await _drive(url, keys, LOAD_S, result), result


def _metric(lines: list[str], name: str, label: str = "") -> int:
    """The sum of a Prometheus counter's samples (those with `label`, when given)."""
    samples = (line for line in lines if line.startswith(name) and label in line)
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in samples)


def _counters(gateways: list[str]) -> list[tuple[int, int]]:
    """(chat calls answered 200, span seq conflicts) of each gateway so far, from its /metrics."""
    counts = []
    for url in gateways:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:  # noqa: S310 - loopback
            lines = response.read().decode().splitlines()
        answered = _metric(lines, "harnessrl_gateway_requests_total", 'code="200"')
        counts.append((answered, _metric(lines, "harnessrl_gateway_span_seq_conflicts_total")))
    return counts


def _rps(deployment: Deployment) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Requests per second through each frontend of the load balancer, one after the other."""
    figures: dict[str, Any] = {}
    spans: dict[str, list[str]] = {}
    for frontend, label in (("one_replica", "1_replica"), ("round_robin", "3_replicas"),
                            ("by_key", "3_replicas_key_affinity")):  # fmt: skip
        before = _counters(deployment.gateways)
        rps, result = asyncio.run(_load(deployment.lb[frontend], f"load-{frontend}"))
        after = _counters(deployment.gateways)
        figures[f"rps_{label}"] = round(rps, 1)
        figures[f"load_per_replica_{label}"] = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        figures[f"seq_conflicts_{label}"] = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        figures["load_failed"] = figures.get("load_failed", 0) + result.failed
        spans[f"load-{frontend}"] = result.spans
    return figures | {"load_connections": LOAD_CONNECTIONS, "load_generator": "python-aiohttp"}, spans


def measure(home: Path, deployment: Deployment) -> dict[str, Any]:
    """Start everything, run the episodes with the faults, then the loads; check the bus."""
    began = time.monotonic()
    upstream = start_upstream(deployment.procs)
    deployment.start(upstream, FRONTENDS)
    _progress(
        f"{GATEWAYS} gateways behind HAProxy, {NATS_NODES} NATS nodes: up in {time.monotonic() - began:.1f} s"
    )
    faults = asyncio.run(_episodes(deployment))
    _progress(f"run done with faults injected: {json.dumps(faults)}")
    # Controllers and reward workers play no part in a call: their CPU goes to the load now.
    deployment.stop_services(*deployment.controllers, *(f"reward-{i}" for i in range(REWARD_WORKERS)))
    load, load_spans = _rps(deployment)
    _progress(f"loads done: {json.dumps({k: v for k, v in load.items() if k.startswith('rps_')})}")
    record = asyncio.run(read_bus(deployment.cluster.url, RUN, list(load_spans)))
    checked = verify(record, claimed(home / "calls"), [s for ids in load_spans.values() for s in ids])
    return {
        "gateway_replicas": GATEWAYS,
        "nats_nodes": NATS_NODES,
        **checked,
        **faults,
        **load,
        "lease_ttl_s": ControllerSettings().lease_ttl_s,
        "wall_s": round(time.monotonic() - began, 1),
    }


def _progress(line: str) -> None:
    print(line, flush=True)  # noqa: T201 - the benchmark reports on stdout


CORRECT = {"seq_gaps": 0, "seq_duplicates": 0, "spans_missing": 0, "rollouts_dropped": 0,
           "rollouts_incomplete": 0, "terminal_exactly_once": True}  # fmt: skip


def main() -> None:
    """Run the benchmark; the last stdout line is the JSON report, exit 1 when a check failed."""
    with tempfile.TemporaryDirectory(prefix="harnessrl-bench-scale-") as tmp:
        deployment = Deployment(
            Path(tmp), gateways=GATEWAYS, nats_nodes=NATS_NODES, reward_workers=REWARD_WORKERS
        )
        try:
            report = measure(Path(tmp), deployment)
        finally:
            deployment.stop()
    print(json.dumps(report), flush=True)  # noqa: T201 - the benchmark's result line
    if any(report[name] != value for name, value in CORRECT.items()):
        sys.exit(1)

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
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from harnessrl.benchmarks.gateway import Processes
from harnessrl.benchmarks.litellm_proxy import wait_http
from harnessrl.controller.lease import LeaseRecord, lease_key
from harnessrl.controller.settings import ControllerSettings
from harnessrl.gateway.settings import GatewaySettings
from harnessrl.reward.settings import RewardSettings
from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.bus.nats.streams import REPLICAS_ENV
from harnessrl.shared.contracts import (
    TERMINAL_KINDS,
    EpisodeEvent,
    RolloutComplete,
    Span,
    decode,
    decode_event,
    event_kind,
)
from harnessrl.shared.keys import sign_episode_key
from harnessrl.shared.net import free_port
from harnessrl.stack.local import settings_env
from harnessrl.stack.natsserver import NatsCluster
from harnessrl.testkit.controller_client import ask

SECRET = "bench-scale-secret"  # noqa: S105 - signs this loopback benchmark's episode keys
RUN = "scale"
GATEWAYS, NATS_NODES, REWARD_WORKERS = 3, 3, 2
GROUPS, GROUP_SIZE, CALLS, THINK_S, CONCURRENT = 16, 4, 5, 0.2, 8
NATS_DOWN_S = 5.0  # the cluster serves on two nodes meanwhile
LOAD_CONNECTIONS, WARMUP_S, LOAD_S = 32, 1.0, 5.0
LOAD_BODY = json.dumps({
    "model": "canned", "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}],
}).encode()  # fmt: skip
CHAT = "/v1/chat/completions"
SPAN_HEADER = "x-harnessrl-span"

HARNESS = '''\
"""A scripted harness: SCALE_CALLS chat calls, each answer's span id appended to its call log."""
import json, os, sys, time
from pathlib import Path

from openai import OpenAI

client = OpenAI(max_retries=4, timeout=30)
messages = [{"role": "user", "content": os.environ["HARNESSRL_TASK"]}]
log = Path(os.environ["SCALE_CALL_LOG"]) / (os.environ["HARNESSRL_EPISODE"] + ".jsonl")
with log.open("a") as out:
    for turn in range(int(os.environ["SCALE_CALLS"])):
        raw = client.chat.completions.with_raw_response.create(
            model="canned", messages=messages, max_tokens=16
        )
        out.write(json.dumps({"span": raw.headers.get("x-harnessrl-span")}) + "\\n")
        out.flush()
        reply = raw.parse().choices[0].message.content or ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"go on {turn}"}]
        time.sleep(float(os.environ["SCALE_THINK_S"]))
Path(os.environ["HARNESSRL_WORKDIR"], "answer.txt").write_text("a")
sys.exit(0)
'''

HAPROXY_GLOBAL = """\
global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch
"""
# Frontends of the load balancer: round-robin per request over every replica (what the run goes
# through), over the first replica alone, and pinned by the episode key (for comparison only).
BALANCE = {"round_robin": "roundrobin", "one_replica": "roundrobin",
           "by_key": "hdr(Authorization)\n    hash-type consistent"}  # fmt: skip


def _haproxy_config(ports: dict[str, int], gateways: list[int]) -> str:
    servers = [f"    server gw{i} 127.0.0.1:{port} check inter 500ms" for i, port in enumerate(gateways)]
    lines = [HAPROXY_GLOBAL]
    for name, balance in BALANCE.items():
        members = servers[:1] if name == "one_replica" else servers
        lines += [f"frontend {name}", f"    bind 127.0.0.1:{ports[name]}", f"    default_backend {name}"]
        lines += [f"backend {name}", f"    balance {balance}", "    option httpchk GET /readyz", *members]
    return "\n".join(lines) + "\n"


class Deployment:
    """Every process of the benchmark and where to reach it."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.procs = Processes(home)
        self.cluster = NatsCluster(home / "nats", NATS_NODES, log_dir=home)
        self.env = {REPLICAS_ENV: str(self.cluster.replicas)}
        self.gateways: list[str] = []
        self.lb: dict[str, str] = {}
        self.controllers: list[subprocess.Popen[bytes]] = []
        self.controller_logs: list[Path] = []
        self.rewards: list[subprocess.Popen[bytes]] = []

    def service(
        self, name: str, module: str, prefix: str, settings: msgspec.Struct
    ) -> subprocess.Popen[bytes]:
        """Start `python -m harnessrl.<module>` with its settings as `HRL_<MODULE>_*`."""
        env = {**self.env, **settings_env(prefix, settings)}
        return self.procs.start(name, [sys.executable, "-m", f"harnessrl.{module}"], env)

    def start(self, upstream: str) -> None:
        """The cluster with R3 streams, the gateways and the load balancer in front of them."""
        self.cluster.start()
        asyncio.run(_replicated_streams(self.cluster.url, self.cluster.replicas))
        ports = [free_port() for _ in range(GATEWAYS)]
        for index, port in enumerate(ports):
            settings = GatewaySettings(
                nats_url=self.cluster.url, port=port, key_secret=SECRET, upstreams=[upstream],
                access_log=False, log_level="WARNING",
            )  # fmt: skip
            self.service(f"gateway-{index}", "gateway", "HRL_GATEWAY_", settings)
        self.gateways = [f"http://127.0.0.1:{port}" for port in ports]
        for url in self.gateways:
            wait_http(url + "/readyz", 180)
        self.lb = _haproxy(self.procs, self.home, ports)

    def start_controller(self) -> Path:
        """One more controller (the first holds the lease, later ones stand by); returns its log."""
        settings = ControllerSettings(
            nats_url=self.cluster.url, key_secret=SECRET, gateway_url=self.lb["round_robin"],
            state_dir=str(self.home / "controller"),
        )  # fmt: skip
        name = f"controller-{len(self.controllers)}"
        self.controllers.append(self.service(name, "controller", "HRL_CONTROLLER_", settings))
        self.controller_logs.append(self.home / f"{name}.log")
        return self.controller_logs[-1]

    def revive_controllers(self) -> int:
        """Start a new controller for each one that exited by itself (a lost lease); how many."""
        exited = [c for c in self.controllers if c.poll() is not None and c.returncode != -signal.SIGKILL]
        for _ in exited:
            self.start_controller()
        return len(exited)

    def start_rewards(self) -> None:
        """Reward workers sharing one durable consumer."""
        settings = RewardSettings(nats_url=self.cluster.url, log_level="WARNING")
        for index in range(REWARD_WORKERS):
            self.rewards.append(self.service(f"reward-{index}", "reward", "HRL_REWARD_", settings))

    def stop(self) -> None:
        """Stop every process, the cluster last."""
        self.procs.stop()
        self.cluster.stop()


async def _replicated_streams(url: str, replicas: int) -> None:
    bus = NatsBus(url, replicas=replicas)
    await bus.connect()
    try:
        await bus.ensure_streams()
    finally:
        await bus.close()


def _haproxy(procs: Processes, home: Path, gateways: list[int]) -> dict[str, str]:
    """HAProxy in HTTP mode in front of the gateways; the URL of each frontend."""
    binary = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if binary is None:
        raise RuntimeError("haproxy not found: `apt-get install -y haproxy` (`make bench-scale` tries)")
    ports = {name: free_port() for name in BALANCE}
    config = home / "haproxy.cfg"
    config.write_text(_haproxy_config(ports, gateways))
    procs.start("haproxy", [binary, "-db", "-f", str(config)])
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    for url in urls.values():
        wait_http(url + "/readyz", 30)
    return urls


def _logged(log: Path, text: str) -> bool:
    return log.exists() and text in log.read_text(errors="replace")


async def _wait_for_line(log: Path, text: str, timeout_s: float = 60) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if _logged(log, text):
                return
            await asyncio.sleep(0.1)


async def _completed(bus: NatsBus, at_least: int) -> None:
    async with asyncio.timeout(180):
        while True:
            done = await bus.replay(subjects.EPISODES.name, subjects.episode_events_of_run(RUN, "completed"))
            if len(done) >= at_least:
                return
            await asyncio.sleep(0.3)


def _run_spec(home: Path) -> dict[str, Any]:
    tasks, harness, calls = home / "tasks.jsonl", home / "harness.py", home / "calls"
    rows = ({"task_id": f"t{i}", "prompt": f"Task {i}: say hello.", "answer": "a"} for i in range(GROUPS))
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    harness.write_text(HARNESS)
    calls.mkdir()
    env = {"SCALE_CALLS": str(CALLS), "SCALE_THINK_S": str(THINK_S), "SCALE_CALL_LOG": str(calls)}
    return {
        "run": RUN, "tasks": str(tasks), "group_size": GROUP_SIZE, "batch_tasks": GROUPS, "max_steps": 1,
        "max_concurrent": CONCURRENT, "episode_timeout_s": 120,
        "launcher": {"kind": "local", "command": [sys.executable, str(harness)], "env": env,
                     "preload": ["openai"]},
    }  # fmt: skip


async def _episodes(deployment: Deployment) -> dict[str, Any]:
    """Submit the run, kill the SPANS leader node and then the active controller, wait until done."""
    bus = NatsBus(deployment.cluster.url)
    await bus.connect()
    try:
        deployment.start_controller()
        deployment.start_rewards()
        await ask(bus, "status", {})
        await _wait_for_line(deployment.start_controller(), "controller.standby")
        submitted = await ask(bus, "submit", {"spec": _run_spec(deployment.home)})
        if not submitted.get("ok"):
            raise RuntimeError(f"run refused: {submitted.get('error')}")
        total = GROUPS * GROUP_SIZE
        await _completed(bus, total // 4)
        killed_node = await _kill_spans_leader(deployment, bus)
        await _completed(bus, total // 2)
        revived = deployment.revive_controllers()
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


async def _active_controller(deployment: Deployment, bus: NatsBus) -> subprocess.Popen[bytes]:
    """The controller holding the lease, once every other one stands by."""
    kv = await bus.kv(subjects.CONTROLLER_LEASE)
    entry = await kv.get(lease_key("", []))
    if entry is None:
        raise RuntimeError("no controller holds the lease")
    holder = msgspec.json.decode(entry.value, type=LeaseRecord).holder  # host-pid-random
    pid = int(holder.rsplit("-", 2)[1])
    for controller, log in zip(deployment.controllers, deployment.controller_logs, strict=True):
        if controller.pid != pid and controller.poll() is None:
            await _wait_for_line(log, "controller.standby")
    return next(c for c in deployment.controllers if c.pid == pid)


async def _fail_over(deployment: Deployment, bus: NatsBus) -> float:
    """Kill -9 the active controller; seconds until the standby answers; the killed one restarts."""
    active = await _active_controller(deployment, bus)
    os.kill(active.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    active.wait()
    await ask(bus, "status", {"run": RUN}, timeout_s=60)
    failover_s = time.monotonic() - killed_at
    deployment.start_controller()
    return failover_s


class BusRecord(msgspec.Struct, kw_only=True):
    """What the bus holds about the run (and the loads' spans)."""

    spans: list[Span]
    events: list[EpisodeEvent]
    rollouts: list[RolloutComplete]
    load_spans: list[Span]


async def _read_bus(url: str, load_runs: list[str]) -> BusRecord:
    bus = NatsBus(url)
    await bus.connect()

    async def replay(stream: str, subject: str) -> list[bytes]:
        return [delivery.data for delivery in await bus.replay(stream, subject)]

    try:
        spans = await replay(subjects.SPANS.name, subjects.spans_of_run(RUN))
        events = await replay(subjects.EPISODES.name, subjects.episode_events_of_run(RUN))
        rollouts = await replay(subjects.ROLLOUTS.name, subjects.rollout(RUN))
        load = [
            raw for run in load_runs for raw in await replay(subjects.SPANS.name, subjects.spans_of_run(run))
        ]
    finally:
        await bus.close()
    return BusRecord(
        spans=[decode(raw, Span) for raw in spans], events=[decode_event(raw) for raw in events],
        rollouts=[decode(raw, RolloutComplete) for raw in rollouts],
        load_spans=[decode(raw, Span) for raw in load],
    )  # fmt: skip


def _seq_faults(spans: list[Span]) -> tuple[int, int]:
    """(gaps, duplicates) over every episode: seqs must be exactly 0..n-1."""
    by_episode: dict[tuple[str, str], list[int]] = defaultdict(list)
    for span in spans:
        by_episode[span.run, span.episode].append(span.seq)
    gaps = sum(max(seqs) + 1 - len(set(seqs)) for seqs in by_episode.values())
    duplicates = sum(len(seqs) - len(set(seqs)) for seqs in by_episode.values())
    return gaps, duplicates


def _claimed(calls_dir: Path) -> list[str | None]:
    """The span id of every call the harnesses got answered (None: an answer without one)."""
    lines = (line for log in calls_dir.glob("*.jsonl") for line in log.read_text().splitlines())
    return [json.loads(line)["span"] for line in lines if line]


def _verify(record: BusRecord, claimed: list[str | None], load_claimed: list[str]) -> dict[str, Any]:
    """The correctness figures: seqs, spans of answered calls, terminal events, rollouts."""
    from harnessrl.trainer.assembly import spans_complete  # imports torch: only once the run is over

    by_episode: dict[str, list[Span]] = defaultdict(list)
    for span in record.spans:
        by_episode[span.episode].append(span)
    stored = {span.span_id for span in [*record.spans, *record.load_spans]}
    gaps, duplicates = _seq_faults([*record.spans, *record.load_spans])
    kinds = [(event.episode, event_kind(event)) for event in record.events]
    terminal = Counter(episode for episode, kind in kinds if kind in TERMINAL_KINDS)
    scheduled = {episode for episode, kind in kinds if kind == "scheduled"}
    completed = {episode for episode, kind in kinds if kind == "completed"}
    rolled = [r.episode for r in record.rollouts]
    return {
        "episodes": len(scheduled),
        "calls": len(claimed),
        "seq_gaps": gaps,
        "seq_duplicates": duplicates,
        "spans_missing": sum(1 for span in [*claimed, *load_claimed] if span not in stored),
        "rollouts_dropped": len(completed - set(rolled)),
        "rollouts_incomplete": sum(not spans_complete(r, by_episode[r.episode]) for r in record.rollouts),
        "terminal_exactly_once": bool(scheduled) and all(terminal[e] == 1 for e in scheduled | set(terminal)),
        "episodes_failed": len(scheduled - completed),
        "spans_unclaimed": len({s.span_id for s in record.spans} - set(claimed)),
        "rollout_duplicates": len(rolled) - len(set(rolled)),
        "load_calls": len(load_claimed),
    }


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
    upstream_port = free_port()
    deployment.procs.start(
        "upstream",
        [sys.executable, "-m", "harnessrl.testkit.canned_upstream", "--port", str(upstream_port),
         "--delay", "0.01"],
    )  # fmt: skip
    upstream = f"http://127.0.0.1:{upstream_port}"
    wait_http(upstream + "/health", 30)
    deployment.start(upstream)
    _progress(
        f"{GATEWAYS} gateways behind HAProxy, {NATS_NODES} NATS nodes: up in {time.monotonic() - began:.1f} s"
    )
    faults = asyncio.run(_episodes(deployment))
    _progress(f"run done with faults injected: {json.dumps(faults)}")
    # Controllers and reward workers play no part in a call: their CPU goes to the load now.
    deployment.procs.stop(*deployment.controllers, *deployment.rewards)
    load, load_spans = _rps(deployment)
    _progress(f"loads done: {json.dumps({k: v for k, v in load.items() if k.startswith('rps_')})}")
    record = asyncio.run(_read_bus(deployment.cluster.url, list(load_spans)))
    checked = _verify(record, _claimed(home / "calls"), [s for ids in load_spans.values() for s in ids])
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
        deployment = Deployment(Path(tmp))
        try:
            report = measure(Path(tmp), deployment)
        finally:
            deployment.stop()
    print(json.dumps(report), flush=True)  # noqa: T201 - the benchmark's result line
    if any(report[name] != value for name, value in CORRECT.items()):
        sys.exit(1)

"""The scaled-out deployment that `bench-scale` and `chaos` run on loopback, as real processes.

A NATS cluster with its streams replicated, gateway replicas (`python -m harnessrl.gateway`) on fixed
ports behind HAProxy, controllers (the first holds the lease, later ones stand by), reward workers
sharing one durable consumer, optionally the trainer, and a canned upstream. Every service is started
by name from its own typed settings, so any one can be killed -9 and started again as it was
(`kill`, `relaunch`); `relaunch_exited` restarts those that exited by themselves, as Kubernetes would.
The harness every episode runs is a scripted OpenAI-SDK program logging the span id of each answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

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
from harnessrl.shared.net import free_port
from harnessrl.stack.local import settings_env
from harnessrl.stack.natsserver import NatsCluster
from harnessrl.trainer.settings import EngineSettings, TrainerSettings

SECRET = "bench-scale-secret"  # noqa: S105 - signs this loopback benchmark's episode keys
SPAN_HEADER = "x-harnessrl-span"

HARNESS = '''\
"""A scripted harness: SCALE_CALLS chat calls, each answer's span id appended to its call log.

It answers right ("a") as the first member of its group and wrong as any other, so every group
has reward variance for the trainer to learn from.
"""
import json, os, sys, time
from pathlib import Path

from openai import OpenAI

client = OpenAI(max_retries=8, timeout=30)
messages = [{"role": "user", "content": os.environ["HARNESSRL_TASK"]}]
episode = os.environ["HARNESSRL_EPISODE"]  # e<batch>-<slot>-<member>-a<attempt>
log = Path(os.environ["SCALE_CALL_LOG"]) / (episode + ".jsonl")
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
answer = "a" if episode.split("-")[2] == "00" else "b"
Path(os.environ["HARNESSRL_WORKDIR"], "answer.txt").write_text(answer)
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


class Frontend(msgspec.Struct, frozen=True):
    """One frontend of the load balancer: its balance algorithm, over the first `replicas` (0: all)."""

    balance: str
    replicas: int = 0


ROUND_ROBIN = {"round_robin": Frontend("roundrobin")}  # per request, no affinity


def haproxy_config(ports: dict[str, int], gateways: list[int], frontends: dict[str, Frontend]) -> str:
    """HAProxy's configuration: each frontend on its port, health-checking its gateways' `/readyz`."""
    servers = [f"    server gw{i} 127.0.0.1:{port} check inter 500ms" for i, port in enumerate(gateways)]
    lines = [HAPROXY_GLOBAL]
    for name, frontend in frontends.items():
        members = servers[: frontend.replicas] if frontend.replicas else servers
        lines += [f"frontend {name}", f"    bind 127.0.0.1:{ports[name]}", f"    default_backend {name}"]
        lines += [f"backend {name}", f"    balance {frontend.balance}", "    option httpchk GET /readyz"]
        lines += members
    return "\n".join(lines) + "\n"


def start_haproxy(
    procs: Processes, home: Path, gateways: list[int], frontends: dict[str, Frontend]
) -> dict[str, str]:
    """HAProxy in HTTP mode in front of the gateways; the URL of each frontend."""
    binary = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if binary is None:
        raise RuntimeError("haproxy not found: `apt-get install -y haproxy` (`make bench-scale` tries)")
    ports = {name: free_port() for name in frontends}
    config = home / "haproxy.cfg"
    config.write_text(haproxy_config(ports, gateways, frontends))
    procs.start("haproxy", [binary, "-db", "-f", str(config)])
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    for url in urls.values():
        wait_http(url + "/readyz", 30)
    return urls


def start_upstream(procs: Processes, delay_s: float = 0.01) -> str:
    """The canned upstream (ids and logprobs like vLLM's) on a free port; its URL once healthy."""
    port = free_port()
    argv = [sys.executable, "-m", "harnessrl.testkit.canned_upstream", "--port", str(port)]
    procs.start("upstream", [*argv, "--delay", str(delay_s)])
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 30)
    return url


class Deployment:
    """Every process of the deployment, by name, and where to reach it."""

    def __init__(
        self, home: Path, *, gateways: int = 3, nats_nodes: int = 3, reward_workers: int = 2
    ) -> None:
        self.home = home
        self.procs = Processes(home)
        self.cluster = NatsCluster(home / "nats", nats_nodes, log_dir=home)
        self.env = {REPLICAS_ENV: str(self.cluster.replicas)}
        self.gateway_count, self.reward_count = gateways, reward_workers
        self.gateway_ports: list[int] = []
        self.gateways: list[str] = []
        self.lb: dict[str, str] = {}
        self.specs: dict[str, tuple[str, dict[str, str]]] = {}
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.starts: Counter[str] = Counter()
        self.killed: set[int] = set()  # pids this program killed on purpose

    def service(
        self, name: str, module: str, prefix: str, settings: msgspec.Struct
    ) -> subprocess.Popen[bytes]:
        """Start `python -m harnessrl.<module>` as `name`, its settings as `<prefix><FIELD>`."""
        self.specs[name] = (module, {**self.env, **settings_env(prefix, settings)})
        return self.relaunch(name)

    def relaunch(self, name: str) -> subprocess.Popen[bytes]:
        """Start service `name` (again) as it was first started; each start logs to its own file."""
        module, env = self.specs[name]
        log_name = f"{name}.{self.starts[name]}" if self.starts[name] else name
        self.starts[name] += 1
        child = self.procs.start(log_name, [sys.executable, "-m", f"harnessrl.{module}"], env)
        self.running[name], self.logs[name] = child, self.home / f"{log_name}.log"
        return child

    def kill(self, name: str) -> int:
        """Kill -9 service `name`'s process, as a crash would; its pid."""
        child = self.running[name]
        self.killed.add(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        return child.pid

    def relaunch_exited(self) -> list[str]:
        """Start again every service that exited by itself with a failure (not killed here)."""
        exited = [
            name for name, child in self.running.items()
            if child.poll() not in (None, 0) and child.pid not in self.killed
        ]  # fmt: skip
        for name in exited:
            self.relaunch(name)
        return exited

    def start(self, upstream: str, frontends: dict[str, Frontend] = ROUND_ROBIN) -> None:
        """The cluster with replicated streams, the gateways and the load balancer in front of them."""
        self.cluster.start()
        asyncio.run(replicated_streams(self.cluster.url, self.cluster.replicas))
        self.gateway_ports = [free_port() for _ in range(self.gateway_count)]
        for index, port in enumerate(self.gateway_ports):
            settings = GatewaySettings(
                nats_url=self.cluster.url, port=port, key_secret=SECRET, upstreams=[upstream],
                access_log=False, log_level="WARNING",
            )  # fmt: skip
            self.service(f"gateway-{index}", "gateway", "HRL_GATEWAY_", settings)
        self.gateways = [f"http://127.0.0.1:{port}" for port in self.gateway_ports]
        for url in self.gateways:
            wait_http(url + "/readyz", 180)
        self.lb = start_haproxy(self.procs, self.home, self.gateway_ports, frontends)

    def start_controller(self) -> str:
        """One more controller (the first holds the lease, later ones stand by); its name."""
        settings = ControllerSettings(
            nats_url=self.cluster.url, key_secret=SECRET, gateway_url=self.lb["round_robin"],
            state_dir=str(self.home / "controller"),
        )  # fmt: skip
        name = f"controller-{sum(1 for known in self.specs if known.startswith('controller-'))}"
        self.service(name, "controller", "HRL_CONTROLLER_", settings)
        return name

    @property
    def controllers(self) -> list[str]:
        """The controllers' names."""
        return [name for name in self.specs if name.startswith("controller-")]

    def start_rewards(self) -> None:
        """Reward workers sharing one durable consumer (a lost delivery is graded again within 5 s)."""
        settings = RewardSettings(nats_url=self.cluster.url, ack_wait_s=5.0, log_level="WARNING")
        for index in range(self.reward_count):
            self.service(f"reward-{index}", "reward", "HRL_REWARD_", settings)

    def start_trainer(self, run: str, model_dir: Path, spec: dict[str, Any]) -> None:
        """The run's trainer on the CPU without replicas to reload (the upstream is canned)."""
        settings = TrainerSettings(
            nats_url=self.cluster.url, run=run, model_dir=str(model_dir),
            checkpoint_dir=str(self.home / "checkpoints"), mode=spec["mode"], staleness=spec["staleness"],
            batch_groups=spec["batch_tasks"], max_steps=spec["max_steps"], ack_recheck_s=0.2,
            ack_wait_s=3.0, log_level="WARNING", engine=EngineSettings(torch_threads=1),
        )  # fmt: skip
        self.service("trainer", "trainer", "HRL_TRAINER_", settings)

    def stop_services(self, *names: str) -> None:
        """Stop the named services (SIGTERM, then SIGKILL)."""
        self.procs.stop(*(self.running[name] for name in names))

    def stop(self) -> None:
        """Stop every process, the cluster last."""
        self.procs.stop()
        self.cluster.stop()


async def replicated_streams(url: str, replicas: int) -> None:
    """Create every harnessrl stream at `replicas` on a freshly started cluster."""
    bus = NatsBus(url, replicas=replicas)
    await bus.connect()
    try:
        await bus.ensure_streams()
    finally:
        await bus.close()


def logged(log: Path, text: str) -> bool:
    """Whether `text` is in the log file."""
    return log.exists() and text in log.read_text(errors="replace")


async def wait_for_line(log: Path, text: str, timeout_s: float = 60) -> None:
    """Wait until `text` shows up in the log file."""
    async with asyncio.timeout(timeout_s):
        while True:
            if logged(log, text):
                return
            await asyncio.sleep(0.1)


async def active_controller(deployment: Deployment, bus: NatsBus) -> str:
    """The name of the controller holding the lease, once every other live one stands by."""
    kv = await bus.kv(subjects.CONTROLLER_LEASE)
    entry = await kv.get(lease_key("", []))
    if entry is None:
        raise RuntimeError("no controller holds the lease")
    holder = msgspec.json.decode(entry.value, type=LeaseRecord).holder  # host-pid-random
    pid = int(holder.rsplit("-", 2)[1])
    names = deployment.controllers
    for name in names:
        child = deployment.running[name]
        if child.pid != pid and child.poll() is None:
            await wait_for_line(deployment.logs[name], "controller.standby")
    active = [name for name in names if deployment.running[name].pid == pid]
    if not active:
        raise RuntimeError(f"the lease holder {holder} is none of this deployment's controllers")
    return active[0]


def run_spec(home: Path, run: str, layout: dict[str, Any]) -> dict[str, Any]:
    """A run of the scripted harness: `layout` gives tasks, calls, think time and the run's knobs."""
    tasks, harness, calls = home / "tasks.jsonl", home / "harness.py", home / "calls"
    rows = (
        {"task_id": f"t{i}", "prompt": f"Task {i}: say hello.", "answer": "a"} for i in range(layout["tasks"])
    )
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    harness.write_text(HARNESS)
    calls.mkdir(exist_ok=True)
    env = {
        "SCALE_CALLS": str(layout["calls"]),
        "SCALE_THINK_S": str(layout["think_s"]),
        "SCALE_CALL_LOG": str(calls),
    }
    knobs = ("group_size", "batch_tasks", "max_steps", "max_concurrent", "mode", "staleness")
    return {
        "run": run, "tasks": str(tasks), "episode_timeout_s": 120, **{k: layout[k] for k in knobs},
        "launcher": {"kind": "local", "command": [sys.executable, str(harness)], "env": env,
                     "preload": ["openai"]},
    }  # fmt: skip

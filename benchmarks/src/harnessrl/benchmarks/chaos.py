"""`make chaos`: the whole system under traffic while a seeded driver kills its processes -9.

Real processes on loopback (`scaled_stack`): a 3-node NATS cluster, gateway replicas behind HAProxy
(round-robin per request), two controllers (the standby behind the lease), two reward workers, the
real trainer on the tiny model (CPU, no replica to reload: the upstream is canned, so what is
measured is the system's bookkeeping, not the model) and a canned upstream. A run of scripted
OpenAI-SDK harnesses (several calls each through the load balancer, reward split inside each group
so every step trains) goes through it. Meanwhile the driver follows its plan (`chaos_plan.plan`,
drawn from `--seed`): at each planned count of answered calls it kills -9 a NATS node, a gateway
replica, the active controller, a reward worker or the trainer, keeps it down for the planned time
and starts it again. A service that exits by itself is started again too (as Kubernetes would) and
counted in `unplanned_restarts`.

Afterwards what the clients saw is reconciled with the bus (`reconcile.verify`) and the trainer's
checkpoints: every answered call has exactly one span, seqs are gap-free, every episode has exactly
one terminal event, no rollout was trained twice, weight versions strictly increase, the run
finished (the controller says done and the trainer reached its last step). The last stdout line is
one JSON object; the exit code is 1 when any invariant fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.benchmarks.chaos_plan import Kill, TrainedLedger, plan
from harnessrl.benchmarks.litellm_proxy import wait_http
from harnessrl.benchmarks.reconcile import claimed, read_bus, verify
from harnessrl.benchmarks.scaled_stack import Deployment, active_controller, run_spec, start_upstream
from harnessrl.shared.bus import BusError, NatsBus
from harnessrl.testkit.controller_client import ask

RUN = "chaos"
GROUP_SIZE, BATCH_TASKS = 4, 4  # 16 episodes a step


class ChaosArgs(msgspec.Struct, frozen=True, kw_only=True):
    """The run's size and its faults (see `parse`)."""

    calls: int = 2000
    kills: int = 10
    seed: int = 0
    calls_per_episode: int = 8
    gateways: int = 2
    concurrent: int = 8
    think_s: float = 0.05
    down_s: tuple[float, float] = (0.5, 3.0)
    timeout_s: float = 1800.0
    # No answered call and no trainer step for this long: the run is stuck (reported, exit 1).
    stall_s: float = 240.0
    # A new folder to run in and keep afterwards (every service's log, the stores); "": a temporary one.
    keep: str = ""


def parse(argv: list[str]) -> ChaosArgs:
    """The command line: every field of `ChaosArgs` as a flag."""
    parser = argparse.ArgumentParser(prog="python -m harnessrl.benchmarks.chaos", description=__doc__)
    defaults = ChaosArgs()
    parser.add_argument("--calls", type=int, default=defaults.calls, help="LLM calls the run makes at least")
    parser.add_argument(
        "--kills", type=int, default=defaults.kills, help="processes killed -9 during the run"
    )
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="draws the faults: same seed, same plan"
    )
    parser.add_argument("--calls-per-episode", type=int, default=defaults.calls_per_episode)
    parser.add_argument(
        "--gateways", type=int, default=defaults.gateways, help="replicas behind HAProxy (>= 2)"
    )
    parser.add_argument(
        "--concurrent", type=int, default=defaults.concurrent, help="harnesses running at once"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=defaults.timeout_s, help="give up (finished: false)"
    )
    parser.add_argument(
        "--stall-s", type=float, default=defaults.stall_s, help="no progress this long: stuck"
    )
    parser.add_argument("--keep", default="", help="run in this new folder and keep its logs")
    args = parser.parse_args(argv)
    if args.gateways < 2 or args.kills < 0 or args.calls < 1:
        parser.error("--gateways must be at least 2, --kills not negative, --calls positive")
    return ChaosArgs(
        **{name: getattr(args, name) for name in ChaosArgs.__struct_fields__ if hasattr(args, name)}
    )


def layout(args: ChaosArgs) -> dict[str, Any]:
    """Enough whole steps of `GROUP_SIZE` x `BATCH_TASKS` episodes for `args.calls` calls."""
    steps = math.ceil(args.calls / (args.calls_per_episode * GROUP_SIZE * BATCH_TASKS))
    return {
        "tasks": steps * BATCH_TASKS, "calls": args.calls_per_episode, "think_s": args.think_s,
        "group_size": GROUP_SIZE, "batch_tasks": BATCH_TASKS, "max_steps": steps,
        "max_concurrent": args.concurrent, "mode": "async", "staleness": 1,
    }  # fmt: skip


class Driver:
    """Follows the run, injects the planned kills, restarts what exits by itself, watches the trainer."""

    def __init__(self, deployment: Deployment, bus: NatsBus, args: ChaosArgs, ledger: TrainedLedger) -> None:
        self.deployment = deployment
        self.bus = bus
        self.args = args
        self.ledger = ledger
        self.rng = random.Random(args.seed + 1)  # noqa: S311 - repeatable victims, not a secret
        self.kills: list[dict[str, Any]] = []
        self.unplanned: Counter[str] = Counter()
        self.stalled = False
        self.calls_dir = deployment.home / "calls"

    def answered(self) -> int:
        """Calls answered so far (one line each in the harnesses' call logs)."""
        return sum(log.read_bytes().count(b"\n") for log in self.calls_dir.glob("*.jsonl"))

    async def run(self, faults: list[Kill]) -> bool:
        """Until the run is done and the trainer reached its last step; False on timeout.

        A kill is injected once its call count is reached and no fault of its kind is still in
        progress (so two NATS nodes or both gateways are never down at once); faults of different
        kinds may overlap.
        """
        pending = list(faults)
        in_flight: dict[str, asyncio.Task[None]] = {}
        deadline = time.monotonic() + self.args.timeout_s
        last_status = 0.0
        progress, progressed_at = (0, 0), time.monotonic()
        while time.monotonic() < deadline:
            if (now := (self.answered(), self.ledger.steps_seen())) != progress:
                progress, progressed_at = now, time.monotonic()
            elif time.monotonic() - progressed_at > self.args.stall_s:
                self.stalled = True  # no call answered and no step checkpointed for that long
                return False
            for task in in_flight.values():
                if task.done():
                    task.result()  # a fault that could not be injected fails the run here
            in_flight = {kind: task for kind, task in in_flight.items() if not task.done()}
            if pending and pending[0].kind not in in_flight and self.answered() >= pending[0].at_calls:
                kill = pending.pop(0)
                in_flight[kill.kind] = asyncio.create_task(self.inject(kill))
            self.unplanned.update(self.deployment.relaunch_exited())
            self.ledger.read()
            if not pending and not in_flight and time.monotonic() - last_status > 1.0:
                last_status = time.monotonic()
                if await self.finished():
                    return True
            await asyncio.sleep(0.25)
        return False

    async def finished(self) -> bool:
        """The controller says the run is done and the trainer exited after its last step."""
        if self.deployment.running["trainer"].poll() != 0:
            return False
        status = await ask(self.bus, "status", {"run": RUN}, timeout_s=90)
        return bool(status["runs"][RUN]["state"] == "done")

    async def inject(self, kill: Kill) -> None:
        """Kill one process of `kill.kind` -9, keep it down `kill.down_s`, start it again."""
        at_calls, began = self.answered(), time.monotonic()
        victim = await self.kill(kill.kind)
        await asyncio.sleep(kill.down_s)
        await self.restart(kill.kind, victim)
        record = {"kind": kill.kind, "victim": victim, "at_calls": at_calls, "down_s": kill.down_s,
                  "back_s": round(time.monotonic() - began, 2)}  # fmt: skip
        self.kills.append(record)
        _progress(f"kill {len(self.kills)}: {json.dumps(record)}")

    async def kill(self, kind: str) -> str:
        """Kill -9 a process of `kind` (the victim drawn from the driver's generator); its name."""
        deployment = self.deployment
        if kind == "nats":
            node = deployment.cluster.nodes[self.rng.randrange(len(deployment.cluster.nodes))]
            node.kill()
            return node.name
        if kind == "controller":
            name = await self.active_controller()
        elif kind in ("gateway", "reward"):
            count = deployment.gateway_count if kind == "gateway" else deployment.reward_count
            name = f"{kind}-{self.rng.randrange(count)}"
        else:
            name = "trainer"
        deployment.kill(name)
        return name

    async def active_controller(self) -> str:
        """The lease holder, asked again while the lease changes hands (another fault may be under way)."""
        async with asyncio.timeout(120):
            while True:
                try:
                    return await active_controller(self.deployment, self.bus)
                except (RuntimeError, BusError, TimeoutError):
                    await asyncio.sleep(1.0)

    async def restart(self, kind: str, victim: str) -> None:
        """Start the victim again; a NATS node and a gateway are waited for until they serve."""
        if kind == "nats":
            await asyncio.to_thread(self.deployment.cluster.node(victim).restart, 60.0)
            return
        self.deployment.relaunch(victim)
        if kind == "gateway":
            index = int(victim.rsplit("-", 1)[1])
            await asyncio.to_thread(wait_http, self.deployment.gateways[index] + "/readyz", 120)
        elif kind == "controller":
            await ask(self.bus, "status", {"run": RUN}, timeout_s=120)  # the standby took over


async def _drive(deployment: Deployment, args: ChaosArgs, ledger: TrainedLedger) -> dict[str, Any]:
    """Start the controllers, reward workers and trainer, submit the run, inject the faults."""
    from harnessrl.stack.demo.tiny_model import cached_tiny_model  # imports torch: only here

    spec = run_spec(deployment.home, RUN, layout(args))
    bus = NatsBus(deployment.cluster.url)
    await bus.connect()
    try:
        for _ in range(2):
            deployment.start_controller()
        deployment.start_rewards()
        deployment.start_trainer(RUN, cached_tiny_model(), spec)
        submitted = await ask(bus, "submit", {"spec": spec}, timeout_s=120)
        if not submitted.get("ok"):
            raise RuntimeError(f"run refused: {submitted.get('error')}")
        driver = Driver(deployment, bus, args, ledger)
        faults = plan(args.seed, args.kills, args.calls, args.down_s)
        _progress(
            f"run submitted ({spec['max_steps']} steps); plan: {json.dumps(msgspec.to_builtins(faults))}"
        )
        error = ""
        try:
            finished = await driver.run(faults)
        except (RuntimeError, TimeoutError, OSError, BusError) as exc:  # the run is reported, not lost
            finished, error = False, repr(exc)
        phases = (await ask(bus, "status", {"run": RUN}, timeout_s=60))["runs"][RUN]["phases"]
    finally:
        await bus.close()
    return {
        "finished": finished, "error": error, "stalled": driver.stalled, "episode_phases_at_end": phases,
        "kills": len(driver.kills), "kills_planned": len(faults),
        "kills_by_kind": dict(Counter(k["kind"] for k in driver.kills)), "kill_log": driver.kills,
        "unplanned_restarts": dict(driver.unplanned), "max_steps": spec["max_steps"],
    }  # fmt: skip


def measure(home: Path, args: ChaosArgs) -> dict[str, Any]:
    """Start everything, run the episodes with the faults, reconcile clients, bus and checkpoints."""
    began = time.monotonic()
    deployment = Deployment(home, gateways=args.gateways, nats_nodes=3, reward_workers=2)
    ledger = TrainedLedger(home / "checkpoints" / RUN)
    try:
        deployment.start(start_upstream(deployment.procs))
        _progress(
            f"{args.gateways} gateways behind HAProxy, 3 NATS nodes: up in {time.monotonic() - began:.1f} s"
        )
        driven = asyncio.run(_drive(deployment, args, ledger))
        record = asyncio.run(read_bus(deployment.cluster.url, RUN))
    finally:
        deployment.stop()
    ledger.read()
    checked = verify(record, claimed(home / "calls"))
    steps = [w.step for w in record.weights]
    return {
        "calls": checked["calls"], "kills": driven["kills"],
        "lost_spans": checked["spans_missing"],
        "duplicate_spans": checked["seq_duplicates"] + checked["span_ids_stored_twice"],
        "episodes": checked["episodes"], "terminal_exactly_once": checked["terminal_exactly_once"],
        "rollouts_trained_twice": ledger.trained_twice(),
        "finished": driven["finished"] and len(steps) == driven["max_steps"],
        **{k: checked[k] for k in ("seq_gaps", "rollouts_dropped", "rollouts_incomplete",
                                    "versions_strictly_increase", "episodes_failed", "spans_unclaimed",
                                    "rollout_duplicates", "trainer_dropped")},
        "steps": len(steps), "last_version": record.weights[-1].version if record.weights else 0,
        "rollouts_trained": ledger.trained(), **driven, "seed": args.seed, "gateway_replicas": args.gateways,
        "nats_nodes": 3, "controllers": 2, "reward_workers": 2, "trainer": "real (tiny model, CPU)",
        "wall_s": round(time.monotonic() - began, 1),
    }  # fmt: skip


# What each invariant must read; `kills` must also equal `kills_planned`.
INVARIANTS = {"lost_spans": 0, "duplicate_spans": 0, "seq_gaps": 0, "terminal_exactly_once": True,
              "rollouts_trained_twice": 0, "versions_strictly_increase": True, "rollouts_dropped": 0,
              "rollouts_incomplete": 0, "finished": True}  # fmt: skip


def failed_invariants(report: dict[str, Any]) -> list[str]:
    """The names of the invariants the report breaks."""
    broken = [name for name, value in INVARIANTS.items() if report[name] != value]
    return broken + (["kills"] if report["kills"] != report["kills_planned"] else [])


def _progress(line: str) -> None:
    print(line, flush=True)  # noqa: T201 - the benchmark reports on stdout


def main(argv: list[str] | None = None) -> None:
    """Run the chaos test; the last stdout line is the JSON report, exit 1 when an invariant failed."""
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.keep:
        Path(args.keep).mkdir(parents=True)  # a new folder: a used one would resume its stores
        report = measure(Path(args.keep).resolve(), args)
    else:
        with tempfile.TemporaryDirectory(prefix="harnessrl-chaos-") as tmp:
            report = measure(Path(tmp), args)
    broken = failed_invariants(report)
    print(json.dumps({**report, "invariants_failed": broken}), flush=True)  # noqa: T201 - the result line
    if broken:
        sys.exit(1)


if __name__ == "__main__":
    main()

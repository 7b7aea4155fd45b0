"""`make soak`: one gateway at a steady load for `--minutes`, episodes opening and closing all along.

Real processes on loopback: a nats-server, a canned upstream and `python -m harnessrl.gateway`
(episode cache smaller than the run's episodes, so the LRU evicts all along). `--connections`
harnesses each open an episode (a fresh key), make `--calls-per-episode` growing multi-turn calls at
a fixed overall rate (`--rps`), then close it the way the controller does (an `agent_exited` event
on EPISODES) and open the next. Every `SAMPLE_S` the gateway is sampled from outside: its RSS
(`/proc`), its established connections to the upstream, what `/admin/status` holds (asyncio tasks,
episodes held) and the consumers on the NATS streams.

The warm-up lasts until the gateway's bounded per-key state is full (`WARM_EPISODES`), at least
30 s. Bounds (exit 1 when one fails): RSS grows less than 10% from the end of the warm-up to the end;
the last minute's p99 is within 1.5x (or 10 ms) of the first measured minute's; the upstream
connections never exceed the harnesses; asyncio tasks and NATS consumers are back to their idle
counts once the load stops; the episodes held never exceed the cache size. The last stdout line is
one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from harnessrl.benchmarks.gateway import Processes
from harnessrl.benchmarks.litellm_proxy import wait_http
from harnessrl.benchmarks.scaled_stack import SECRET, start_upstream
from harnessrl.gateway.settings import GatewaySettings
from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import AgentExited, EpisodeScheduled
from harnessrl.shared.keys import sign_episode_key
from harnessrl.shared.net import free_port
from harnessrl.stack.local import settings_env
from harnessrl.stack.natsserver import NatsServer

RUN = "soak"
ADMIN = "soak-admin-token"  # the loopback gateway's admin token
CACHE_SIZE = 1000
SAMPLE_S, WARMUP_S = 5.0, 30.0
# The gateway's bounded per-key state is full once this many episodes came by: its cache of verified
# keys (8,192, `auth.KeyVerifier`) and its episode LRU (`CACHE_SIZE`). RSS grows until then by design,
# so the warm-up lasts at least that long.
WARM_EPISODES = 8192 + 500
STREAMS = (subjects.SPANS, subjects.EPISODES, subjects.WEIGHTS, subjects.UPSTREAMS)
CHAT = "/v1/chat/completions"


class SoakArgs(msgspec.Struct, frozen=True, kw_only=True):
    """The load (see `parse`)."""

    minutes: float = 10.0
    rps: float = 100.0
    connections: int = 16
    calls_per_episode: int = 2


def parse(argv: list[str]) -> SoakArgs:
    """The command line: every field of `SoakArgs` as a flag."""
    parser = argparse.ArgumentParser(prog="python -m harnessrl.benchmarks.soak", description=__doc__)
    defaults = SoakArgs()
    parser.add_argument(
        "--minutes", type=float, default=defaults.minutes, help="measured time (after warm-up)"
    )
    parser.add_argument("--rps", type=float, default=defaults.rps, help="calls per second, all harnesses")
    parser.add_argument("--connections", type=int, default=defaults.connections, help="harnesses at once")
    parser.add_argument("--calls-per-episode", type=int, default=defaults.calls_per_episode)
    args = parser.parse_args(argv)
    if args.minutes < 2 or args.rps <= 0 or args.connections < 1 or args.calls_per_episode < 1:
        parser.error("--minutes must be at least 2 (a first and a last minute); the rest positive")
    return SoakArgs(**{name: getattr(args, name) for name in SoakArgs.__struct_fields__})


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def connections_to(pid: int, port: int) -> int:
    """Established TCP connections of `pid` to 127.0.0.1:`port` (its sockets matched in /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        count += state == "01" and int(remote.split(":")[1], 16) == port and inode in inodes
    return count


def admin_status(gateway: str) -> dict[str, Any]:
    """The gateway's `/admin/status`."""
    request = urllib.request.Request(gateway + "/admin/status", headers={"Authorization": f"Bearer {ADMIN}"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 - loopback
        status: dict[str, Any] = json.loads(response.read())
    return status


async def consumers(bus: NatsBus) -> int:
    """Consumers on the streams the gateway follows or writes."""
    infos = [await bus.js.stream_info(stream.name) for stream in STREAMS]
    return sum(info.state.consumer_count for info in infos)


class Load:
    """The harnesses: episodes opened, calls made at a fixed rate, episodes closed."""

    def __init__(self, gateway: str, bus: NatsBus, args: SoakArgs) -> None:
        self.gateway, self.bus, self.args = gateway, bus, args
        self.latencies: list[tuple[float, float]] = []  # (seconds since start, latency)
        self.failed = 0
        self.episodes = 0
        self.began = time.monotonic()
        self.warm_at = 0.0  # seconds since start when the warm-up ended (0: not yet)

    def measuring(self, seconds: float) -> bool:
        """Whether the load goes on: the warm-up, then `seconds` measured; ends the warm-up when due."""
        elapsed = time.monotonic() - self.began
        if not self.warm_at and elapsed >= WARMUP_S and self.episodes >= WARM_EPISODES:
            self.warm_at = elapsed
        return not self.warm_at or elapsed - self.warm_at < seconds

    async def run(self, seconds: float) -> None:
        """Every harness through the warm-up and `seconds` after it."""
        self.began = time.monotonic()
        connector = aiohttp.TCPConnector(limit=self.args.connections)
        async with aiohttp.ClientSession(connector=connector) as http:
            await asyncio.gather(
                *(self.harness(http, index, seconds) for index in range(self.args.connections))
            )

    async def harness(self, http: aiohttp.ClientSession, index: int, seconds: float) -> None:
        """Episode after episode; each call paced so all harnesses together make `rps` calls a second."""
        interval = self.args.connections / self.args.rps
        next_at = self.began + interval * index / self.args.connections
        while self.measuring(seconds):
            episode = f"h{index}-e{self.episodes}"
            self.episodes += 1
            key = sign_episode_key(SECRET.encode(), RUN, episode, 3600)
            await self.publish(EpisodeScheduled(run=RUN, episode=episode, task="t", group="g"), "scheduled")
            messages = [{"role": "user", "content": f"Episode {episode}: say hello."}]
            for turn in range(self.args.calls_per_episode):
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                next_at += interval
                reply = await self.call(http, key, messages)
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": f"go on {turn}"},
                ]
            await self.close(episode)

    async def call(self, http: aiohttp.ClientSession, key: str, messages: list[dict[str, str]]) -> str:
        """One chat call; its latency recorded, a failure counted."""
        body = {"model": "canned", "max_tokens": 16, "messages": messages}
        started = time.monotonic()
        try:
            async with http.post(
                self.gateway + CHAT, json=body, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                answer = await r.json(content_type=None)
                ok = r.status == 200
        except aiohttp.ClientError:
            ok = False
        if not ok:
            self.failed += 1
            return ""
        self.latencies.append((started - self.began, time.monotonic() - started))
        return str(answer["choices"][0]["message"]["content"] or "")

    async def close(self, episode: str) -> None:
        """The harness exited: the event the controller publishes, which closes the episode."""
        await self.publish(
            AgentExited(run=RUN, episode=episode, task="t", group="g", exit_code=0), "agent_exited"
        )

    async def publish(self, event: EpisodeScheduled | AgentExited, kind: str) -> None:
        """A lifecycle event of the episode, as the controller publishes it."""
        subject = subjects.episode_event(RUN, event.episode, kind)
        await self.bus.publish(subject, event, msg_id=f"{RUN}.{event.episode}.{kind}")


def p(values: list[float], quantile: float) -> float:
    """A quantile in milliseconds."""
    return (
        round(statistics.quantiles(values, n=1000)[int(quantile * 1000) - 1] * 1000, 2)
        if len(values) > 1
        else 0.0
    )


class Samples(msgspec.Struct, kw_only=True):
    """What the sampler saw, one entry per `SAMPLE_S`."""

    at: list[float] = msgspec.field(default_factory=list)
    rss: list[int] = msgspec.field(default_factory=list)
    upstream_connections: list[int] = msgspec.field(default_factory=list)
    tasks: list[int] = msgspec.field(default_factory=list)
    episodes_held: list[int] = msgspec.field(default_factory=list)
    consumers: list[int] = msgspec.field(default_factory=list)


async def sample(
    pid: int, gateway: str, upstream_port: int, bus: NatsBus, into: Samples, began: float
) -> None:
    """One sample of the gateway from outside."""
    status = await asyncio.to_thread(admin_status, gateway)
    into.at.append(round(time.monotonic() - began, 1))
    into.rss.append(rss_bytes(pid))
    into.upstream_connections.append(connections_to(pid, upstream_port))
    into.tasks.append(int(status["asyncio_tasks"]))
    into.episodes_held.append(int(status["episodes_held"]))
    into.consumers.append(await consumers(bus))


async def soak(pid: int, gateway: str, upstream_port: int, bus: NatsBus, args: SoakArgs) -> dict[str, Any]:
    """Idle sample, the load with samples all along, idle sample again; the figures."""
    idle_before = Samples()
    await sample(pid, gateway, upstream_port, bus, idle_before, time.monotonic())
    load, samples = Load(gateway, bus, args), Samples()
    seconds = args.minutes * 60
    running = asyncio.create_task(load.run(seconds))
    while not running.done():
        await sample(pid, gateway, upstream_port, bus, samples, load.began)
        await asyncio.wait([running], timeout=SAMPLE_S)
    running.result()
    await asyncio.sleep(2 * SAMPLE_S)  # the last calls' work settles
    idle_after = Samples()
    await sample(pid, gateway, upstream_port, bus, idle_after, time.monotonic())
    return figures(load, samples, idle_before, idle_after, seconds)


def figures(load: Load, samples: Samples, before: Samples, after: Samples, seconds: float) -> dict[str, Any]:
    """The report: RSS, latency per minute, leaks (from the end of the warm-up on)."""
    warm_at, end = load.warm_at, load.warm_at + seconds
    warm = next(i for i, at in enumerate(samples.at) if at >= warm_at)
    first = [lat for at, lat in load.latencies if warm_at <= at < warm_at + 60]
    last = [lat for at, lat in load.latencies if at >= end - 60]
    measured = [lat for at, lat in load.latencies if at >= warm_at]
    rss_warm, rss_end = samples.rss[warm], samples.rss[-1]
    by_minute = [rss for at, rss in zip(samples.at, samples.rss, strict=True) if at >= warm_at][
        :: int(60 / SAMPLE_S)
    ]
    return {
        "minutes": round(seconds / 60, 2), "warmup_s": round(warm_at, 1), "calls": len(load.latencies),
        "failed": load.failed, "rps": round(len(measured) / seconds, 1), "episodes": load.episodes,
        "rss_warm_mb": round(rss_warm / 2**20, 1), "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_max_mb": round(max(samples.rss[warm:]) / 2**20, 1),
        "rss_by_minute_mb": [round(rss / 2**20, 1) for rss in by_minute],
        "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
        "p50_first_minute_ms": p(first, 0.5), "p50_last_minute_ms": p(last, 0.5),
        "p99_first_minute_ms": p(first, 0.99), "p99_last_minute_ms": p(last, 0.99),
        "upstream_connections_max": max(samples.upstream_connections), "connections": load.args.connections,
        "upstream_connections_idle_after": after.upstream_connections[0],
        "asyncio_tasks_idle_before": before.tasks[0], "asyncio_tasks_max": max(samples.tasks),
        "asyncio_tasks_idle_after": after.tasks[0],
        "nats_consumers_idle_before": before.consumers[0], "nats_consumers_max": max(samples.consumers),
        "nats_consumers_idle_after": after.consumers[0],
        "episodes_held_max": max(samples.episodes_held), "episode_cache_size": CACHE_SIZE,
    }  # fmt: skip


def bounds_failed(report: dict[str, Any]) -> list[str]:
    """The bounds the report breaks."""
    first, last = report["p99_first_minute_ms"], report["p99_last_minute_ms"]
    checks = {
        "rss_growth_pct": report["rss_growth_pct"] < 10,
        "p99_stable": last <= max(1.5 * first, first + 10),
        "upstream_connections": report["upstream_connections_max"] <= report["connections"],
        "asyncio_tasks": report["asyncio_tasks_idle_after"] <= report["asyncio_tasks_idle_before"],
        "nats_consumers": report["nats_consumers_idle_after"] <= report["nats_consumers_idle_before"],
        "episodes_held": report["episodes_held_max"] <= report["episode_cache_size"],
        "calls_failed": report["failed"] == 0,
    }
    return [name for name, ok in checks.items() if not ok]


def measure(home: Path, args: SoakArgs) -> dict[str, Any]:
    """nats-server, the canned upstream and the gateway; then the soak."""
    procs = Processes(home)
    nats = NatsServer(home / "nats", log_file=home / "nats-server.log")
    nats.start()
    try:
        upstream = start_upstream(procs)
        port = free_port()
        settings = GatewaySettings(
            nats_url=nats.url, port=port, key_secret=SECRET, admin_token=ADMIN, upstreams=[upstream],
            access_log=False, log_level="WARNING", episode_cache_size=CACHE_SIZE,
        )  # fmt: skip
        child = procs.start(
            "gateway", [sys.executable, "-m", "harnessrl.gateway"], settings_env("HRL_GATEWAY_", settings)
        )
        gateway = f"http://127.0.0.1:{port}"
        wait_http(gateway + "/readyz", 180)
        return asyncio.run(_soak(child.pid, gateway, int(upstream.rsplit(":", 1)[1]), nats.url, args))
    finally:
        procs.stop()
        nats.stop()


async def _soak(pid: int, gateway: str, upstream_port: int, nats_url: str, args: SoakArgs) -> dict[str, Any]:
    bus = NatsBus(nats_url)
    await bus.connect()
    try:
        return await soak(pid, gateway, upstream_port, bus, args)
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> None:
    """Run the soak; the last stdout line is the JSON report, exit 1 when a bound failed."""
    args = parse(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="harnessrl-soak-") as tmp:
        report = measure(Path(tmp), args)
    broken = bounds_failed(report)
    print(json.dumps({**report, "bounds_failed": broken}), flush=True)  # noqa: T201 - the result line
    if broken:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""`make bench-gateway`: the gateway against its upstream alone and against LiteLLM's proxy.

On loopback, in one run: (a) a canned upstream directly, (b) our gateway in front of it with span
publishing to a real nats-server, (c) LiteLLM's proxy in front of the same upstream. Then the
same at a 100 ms upstream with 64 connections, direct, through the gateway and through the
floor (`gateway_floor`: the same libraries forwarding and publishing with no gateway logic). The
last stdout line is one JSON object. Load generator: `wrk` (1 thread, keep-alive) when installed,
else an asyncio/aiohttp client (named in the `load_generator` field).

With two or more CPUs, the proxy under test (gateway, floor or LiteLLM) runs on a CPU of its own
and the load generator, upstream and nats-server share the others, as when the gateway is deployed
with a dedicated core: otherwise the load generator and the upstream steal the very CPU being
measured. `pinned` in the report says whether that was so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harnessrl.benchmarks.litellm_proxy import MASTER_KEY, litellm_venv, start_litellm, wait_http
from harnessrl.benchmarks.loadgen import LoadResult, run_load
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.keys import sign_episode_key
from harnessrl.shared.net import free_port
from harnessrl.stack.natsserver import NatsServer

BENCH_KEY_SECRET = "bench-secret"  # noqa: S105 - a throwaway key for a loopback benchmark
DURATION_S = 5.0
WARMUP_S = 1.0
BODY = json.dumps({
    "model": "canned", "max_tokens": 16,
    "messages": [{"role": "user", "content": "Say hello."}],
}).encode()  # fmt: skip
CHAT = "/v1/chat/completions"


class Processes:
    """Child processes of the benchmark, each in its own session, all stopped at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start one child with its output in `<workdir>/<name>.log`."""
        log = (self.workdir / f"{name}.log").open("wb")
        child = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,
        )  # fmt: skip
        self.children.append(child)
        return child

    def adopt(self, child: subprocess.Popen[bytes]) -> None:
        """Stop `child` with the others."""
        self.children.append(child)

    def stop(self, *only: subprocess.Popen[bytes]) -> None:
        """Terminate the process groups of `only` (default: every child), then kill what is left."""
        children = list(only) or self.children
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)


def _upstream(procs: Processes, delay_s: float) -> str:
    port = free_port()
    procs.start(
        f"upstream-{int(delay_s * 1000)}ms",
        [sys.executable, "-m", "harnessrl.testkit.canned_upstream", "--port", str(port),
         "--delay", str(delay_s), "--fixed"],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 30)
    return url


def _gateway(
    procs: Processes, upstream: str, nats_url: str, name: str, module: str = "harnessrl.gateway"
) -> tuple[str, int]:
    port = free_port()
    env = {
        "HRL_GATEWAY_KEY_SECRET": BENCH_KEY_SECRET,
        "HRL_GATEWAY_PORT": str(port),
        "HRL_GATEWAY_NATS_URL": nats_url,
        "HRL_GATEWAY_UPSTREAMS": json.dumps([upstream]),
    }
    child = procs.start(name, [sys.executable, "-m", module], env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/readyz", 180)
    except TimeoutError as exc:
        log = (procs.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name} not ready (exit code {child.poll()}):\n{log}") from exc
    return url, child.pid


def _cpu_split() -> tuple[set[int], set[int]] | None:
    """(load side, proxy under test): the last allowed CPU for the proxy, the rest for the load."""
    cpus = sorted(os.sched_getaffinity(0))
    return (set(cpus[:-1]), {cpus[-1]}) if len(cpus) >= 2 else None


def _pin(pid: int, cpus: set[int] | None) -> None:
    """Move `pid` and its children onto `cpus` (no-op without a split)."""
    if cpus is not None:
        for each in (pid, *_children(pid)):
            os.sched_setaffinity(each, cpus)


def _peak_rss_mb(pid: int) -> float:
    """Peak resident memory of `pid` and its children."""
    total = 0.0
    for each in (pid, *_children(pid)):
        for line in Path(f"/proc/{each}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) / 1024
    return total


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in map(int, children):
            found += [child, *_children(child)]
    return found


async def _stored_spans(nats_url: str) -> int:
    bus = NatsBus(nats_url)
    await bus.connect()
    try:
        info = await bus.js.stream_info("SPANS")
        return int(info.state.messages)
    finally:
        await bus.close()


def _load(url: str, headers: dict[str, str], connections: int) -> tuple[LoadResult, LoadResult]:
    headers = {"Content-Type": "application/json", **headers}
    warmup = run_load(url, BODY, headers, connections=connections, duration_s=WARMUP_S)
    return warmup, run_load(url, BODY, headers, connections=connections, duration_s=DURATION_S)


def _progress(label: str, result: LoadResult) -> None:
    line = (
        f"{label:<28} {result.rps:>9.1f} req/s  p50 {result.p50_ms:7.2f} ms  "
        f"p99 {result.p99_ms:7.2f} ms  failed {result.failed}"
    )
    print(line, flush=True)  # noqa: T201 - the benchmark reports on stdout


def measure(workdir: Path, procs: Processes) -> dict[str, Any]:
    """Start everything, run the loads, compute the report."""
    split = _cpu_split()
    everything = os.sched_getaffinity(0)
    if split is not None:
        os.sched_setaffinity(0, split[0])  # children (nats-server, upstreams, wrk) inherit it
    nats = NatsServer(workdir / "nats")
    nats.start()
    try:
        fast, slow = _upstream(procs, 0.0), _upstream(procs, 0.1)
        lite_port = free_port()
        litellm = start_litellm(litellm_venv(), fast, lite_port, workdir)
        procs.adopt(litellm)
        gateway_fast, gateway_pid = _gateway(procs, fast, nats.url, "gateway-fast")
        gateway_slow, slow_pid = _gateway(procs, slow, nats.url, "gateway-slow")
        floor = "harnessrl.benchmarks.gateway_floor"
        floor_slow, floor_pid = _gateway(procs, slow, nats.url, "floor-slow", floor)
        lite = f"http://127.0.0.1:{lite_port}"
        wait_http(lite + "/health/liveliness", 120)
        for pid in (gateway_pid, slow_pid, floor_pid, litellm.pid):
            _pin(pid, split[1] if split else None)
        key = {
            "Authorization": "Bearer " + sign_episode_key(BENCH_KEY_SECRET.encode(), "bench", "ep-1", 3600)
        }
        runs: dict[str, tuple[LoadResult, LoadResult]] = {
            "direct_c32": _load(fast + CHAT, {}, 32),
            "gateway_c32": _load(gateway_fast + CHAT, key, 32),
            "litellm_c32": _load(lite + CHAT, {"Authorization": f"Bearer {MASTER_KEY}"}, 32),
        }
        procs.stop(litellm)  # its background work would share the measured CPU from here on
        runs |= {
            "direct_100ms_c64": _load(slow + CHAT, {}, 64),
            "gateway_100ms_c64": _load(gateway_slow + CHAT, key, 64),
            "floor_100ms_c64": _load(floor_slow + CHAT, {}, 64),
        }
        if split is not None:  # the same again with every process free to run on every CPU
            running = [c for c in [*procs.children, nats.process] if c is not None and c.poll() is None]
            for pid in (os.getpid(), *(c.pid for c in running)):
                _pin(pid, everything)
            runs |= {
                "direct_100ms_c64_shared": _load(slow + CHAT, {}, 64),
                "gateway_100ms_c64_shared": _load(gateway_slow + CHAT, key, 64),
            }
        for label, (_, result) in runs.items():
            _progress(label, result)
        rss = _peak_rss_mb(gateway_pid)
        stored = asyncio.run(_stored_spans(nats.url))
    finally:
        nats.stop()
        os.sched_setaffinity(0, everything)
    return _report(runs, rss, stored)


def _report(runs: dict[str, tuple[LoadResult, LoadResult]], rss: float, stored: int) -> dict[str, Any]:
    result = {name: pair[1] for name, pair in runs.items()}
    direct, gateway, lite = result["direct_c32"], result["gateway_c32"], result["litellm_c32"]
    answered = sum(r.ok for name, pair in runs.items() if name.startswith("gateway") for r in pair)
    report = {
        "rps_c32": round(gateway.rps, 1),
        "litellm_rps_c32": round(lite.rps, 1),
        "direct_rps_c32": round(direct.rps, 1),
        "ratio_vs_litellm": round(gateway.rps / lite.rps, 1) if lite.rps else None,
        "p50_ms_c32": round(gateway.p50_ms, 2),
        "p99_ms_c32": round(gateway.p99_ms, 2),
        **_added("", result["gateway_100ms_c64"], result["direct_100ms_c64"]),
        **_added("floor_", result["floor_100ms_c64"], result["direct_100ms_c64"]),
        "rss_mb": round(rss, 1),
        "spans_missing": max(0, answered - stored),
        "spans_stored": stored,
        "gateway_failed": sum(r.failed for name, r in result.items() if name.startswith("gateway")),
        "load_generator": gateway.tool,
        "pinned": "gateway_100ms_c64_shared" in result,
    }
    if report["pinned"]:
        report |= _added("shared_cpu_", result["gateway_100ms_c64_shared"], result["direct_100ms_c64_shared"])
    return report


def _added(prefix: str, proxied: LoadResult, direct: LoadResult) -> dict[str, float]:
    """What a proxy adds at the 100 ms upstream: p50 latency and lost throughput."""
    return {
        f"{prefix}overhead_p50_ms_100ms": round(proxied.p50_ms - direct.p50_ms, 2),
        f"{prefix}throughput_ratio_100ms": round(proxied.rps / direct.rps, 3),
    }


def main() -> None:
    """Run the benchmark; the last stdout line is the JSON report."""
    with tempfile.TemporaryDirectory(prefix="harnessrl-bench-gateway-") as tmp:
        procs = Processes(Path(tmp))
        try:
            report = measure(Path(tmp), procs)
        finally:
            procs.stop()
    print(json.dumps(report), flush=True)  # noqa: T201 - the benchmark's result line

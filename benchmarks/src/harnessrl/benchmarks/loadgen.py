"""Load generation for the gateway benchmark: `wrk` when installed, else an asyncio/aiohttp client.

Both send the same POST with keep-alive connections for a fixed duration and report requests per
second, latency percentiles and how many answers were 2xx.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec


class LoadResult(msgspec.Struct, frozen=True, kw_only=True):
    """One load run."""

    rps: float
    p50_ms: float
    p99_ms: float
    ok: int
    failed: int
    tool: str


def run_load(
    url: str, body: bytes, headers: dict[str, str], *, connections: int, duration_s: float
) -> LoadResult:
    """Drive `url` with `connections` keep-alive connections for `duration_s` seconds."""
    if shutil.which("wrk"):
        return _wrk(url, body, headers, connections, duration_s)
    return asyncio.run(_aiohttp_load(url, body, headers, connections, duration_s))


def _lua_string(text: str) -> str:
    """A Lua long-bracket string literal (padded: `t[ [==[k]==] ]`, never `t[[`)."""
    if "]==]" in text:
        raise ValueError("text contains the Lua long-string terminator")
    return " [==[" + text + "]==] "


def _wrk(url: str, body: bytes, headers: dict[str, str], connections: int, duration_s: float) -> LoadResult:
    lines = ['wrk.method = "POST"', f"wrk.body = {_lua_string(body.decode())}"]
    lines += [f"wrk.headers[{_lua_string(k)}] = {_lua_string(v)}" for k, v in headers.items()]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write("\n".join(lines) + "\n")
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--latency", "-s",
             script.name, url],
            capture_output=True, text=True, check=True, timeout=duration_s + 30,
        ).stdout  # fmt: skip
    finally:
        Path(script.name).unlink(missing_ok=True)
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    failed = (int(bad.group(1)) if bad else 0) + (sum(map(int, errors.groups())) if errors else 0)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return LoadResult(
        rps=rps, p50_ms=_percentile(out, "50%"), p99_ms=_percentile(out, "99%"),
        ok=total - (int(bad.group(1)) if bad else 0), failed=failed, tool="wrk",
    )  # fmt: skip


def _percentile(out: str, label: str) -> float:
    match = re.search(rf"^\s*{re.escape(label)}\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
    if match is None:
        raise ValueError(f"wrk printed no {label} latency:\n{out}")
    value, unit = float(match.group(1)), match.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


async def _aiohttp_load(
    url: str, body: bytes, headers: dict[str, str], connections: int, duration_s: float
) -> LoadResult:
    latencies: list[float] = []
    failed = 0
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        deadline = time.perf_counter() + duration_s

        async def worker() -> None:
            nonlocal failed
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        ok = response.status < 300
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - started)
                else:
                    failed += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(connections)))
        elapsed = time.perf_counter() - started
    latencies.sort()

    def pick(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else 0.0

    return LoadResult(
        rps=(len(latencies) + failed) / elapsed, p50_ms=pick(0.5), p99_ms=pick(0.99),
        ok=len(latencies), failed=failed, tool="python-aiohttp",
    )  # fmt: skip

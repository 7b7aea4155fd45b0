"""`make analytics-check`: every tap on the event stream of one short real run, checked against it.

A short demo run through every service (real nats-server, vLLM on the CPU, the four services as
processes, each summarising its metrics on METRICS every few seconds) with held-out evaluations
before and after, then, while its bus still runs:

1. `harnessrl export` as a process, killed with SIGKILL once it has committed a few parts, then
   started again until idle; DuckDB counts the exported spans against the stream (duplicates,
   missing);
2. `harnessrl replay` of the run's log (rows per rollout, single-row rate, masked share);
3. `harnessrl otlp` into the test kit's OTLP/HTTP receiver;
4. `harnessrl dashboard` rendered in headless Chromium;
5. the services whose `ServiceMetrics` summaries are on the stream.

The last line is one JSON object; the exit status is 1 when any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import ServiceMetrics, Span, decode
from harnessrl.stack.demo.run import DemoSettings, build_model, evaluate, run_spec, warm_start
from harnessrl.stack.replay import ReplayPolicy, replay_log
from harnessrl.stack.train import TrainSession
from harnessrl.testkit.dashboard_page import render_check
from harnessrl.testkit.otlp_receiver import export_once
from harnessrl.testkit.split_reward_harness import split_rewards

SERVICES = ("gateway", "controller", "reward", "trainer")
SUMMARY_INTERVAL_S = 2.0


def main(argv: list[str] | None = None) -> int:
    """Run the check; prints progress, then the result as the last line."""
    parser = argparse.ArgumentParser(prog="analytics-check", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps of the short run")
    parser.add_argument("--home", type=Path, help="where the run lives (default: a fresh temp folder)")
    args = parser.parse_args(argv)
    home = args.home or Path(tempfile.mkdtemp(prefix="hrl-analytics-"))
    for service in SERVICES:  # every service summarises its metrics on METRICS this often
        os.environ[f"HRL_{service.upper()}_METRICS_INTERVAL_S"] = str(SUMMARY_INTERVAL_S)
    result = run_and_check(home, args.steps)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if passed(result) else 1


def passed(result: dict[str, Any]) -> bool:
    """Every tap saw the whole run, exactly once."""
    return (
        result["stream_spans"] > 0
        and result["parquet_spans"] == result["stream_spans"]
        and result["duplicates"] == 0
        and result["missing"] == 0
        and result["otlp_spans"] == result["stream_spans"]
        and result["services_with_metrics"] == len(SERVICES)
        and result["dashboard_rendered"] is True
    )


def run_and_check(home: Path, steps: int) -> dict[str, Any]:
    """The short run, then every tap against its bus (the stack stops afterwards)."""
    started = time.monotonic()
    settings = DemoSettings(
        run="analytics", steps=steps, group_size=4, tasks_per_step=2, warm_steps=60, warm_examples=2000
    )
    warm = warm_start(home, build_model(home), settings)
    session = TrainSession(split_rewards(run_spec(home, settings, warm)), home / "state")
    try:
        session.start_stack()
        evaluate(session, 0)  # held-out points before and after, on the bus as the demo puts them
        asyncio.run(asyncio.wait_for(session.follow(live=False), timeout=900))
        evaluate(session, steps)
        session.finish()
        url = session.stack.nats_url
        result = asyncio.run(check_taps(url, settings.run, home))
        screenshot = home / "dashboard.png"
        result["dashboard_rendered"] = render_check(url, settings.run, screenshot, tokenizer=warm)
        result["dashboard_screenshot"] = str(screenshot)
    finally:
        session.stop()
    return {**result, "steps": steps, "wall_s": round(time.monotonic() - started, 1)}


async def check_taps(url: str, run: str, home: Path) -> dict[str, Any]:
    """Each tap against the stream of `run` on the bus at `url`."""
    stream = await stream_spans(url, run)
    parquet = export_with_a_kill(url, run, home / "export")
    counted = count_exported(home / "export", stream)
    replayed = (await replay_log(url, run, ReplayPolicy())).report(run, ReplayPolicy())
    return {
        "stream_spans": len(stream),
        "parquet_spans": counted["rows"],
        "duplicates": counted["duplicates"],
        "missing": counted["missing"],
        "export_parts_before_kill": parquet,
        "rows_per_rollout": round(replayed.rows.mean_per_rollout, 3),
        "single_row_rate": round(replayed.rows.single_row_rate, 3),
        "masked_share": round(replayed.tokens.masked_share, 4),
        "otlp_spans": await otlp_spans(url, run),
        "services_with_metrics": len(reporting := await services_with_summaries(url)),
        "services_reporting": sorted(reporting),
    }


async def stream_spans(url: str, run: str) -> set[tuple[str, int]]:
    """(episode, seq) of every span of `run` on the stream."""
    bus = NatsBus(url, name="analytics-check")
    await bus.connect()
    try:
        found = await bus.replay(subjects.SPANS.name, subjects.spans_of_run(run))
    finally:
        await bus.close()
    spans = [decode(delivery.data, Span) for delivery in found]
    return {(span.episode, span.seq) for span in spans}


async def services_with_summaries(url: str) -> set[str]:
    """The services that published a `ServiceMetrics` summary."""
    bus = NatsBus(url, name="analytics-check")
    await bus.connect()
    try:
        found = await bus.replay(subjects.METRICS.name, subjects.metrics_of_run(subjects.SERVICE_SCOPE))
    finally:
        await bus.close()
    return {decode(delivery.data, ServiceMetrics).service for delivery in found}


def export_with_a_kill(url: str, run: str, out: Path) -> int:
    """Export in small commits, SIGKILL it after a few parts, then resume until idle.

    Returns the number of span parts the killed export had committed.
    """
    argv = [sys.executable, "-m", "harnessrl.stack.cli", "export", "--out", str(out), "--nats-url", url]
    argv += ["--run", run, "--batch", "3", "--flush-s", "0.2"]
    first = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(parts := list((out / "spans").rglob("part-*.parquet"))) < 2:
            if first.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the export committed no span part before it was to be killed")
            time.sleep(0.02)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    subprocess.run([*argv, "--until-idle", "3"], check=True, stderr=subprocess.DEVNULL)
    return len(parts)


def count_exported(out: Path, stream: set[tuple[str, int]]) -> dict[str, int]:
    """Rows, duplicates and missing spans of the export, counted by DuckDB."""
    glob = str(out / "spans" / "**" / "*.parquet")
    with duckdb.connect() as db:
        rows = db.execute(
            "SELECT episode, seq FROM read_parquet(?, hive_partitioning = true)", [glob]
        ).fetchall()
    exported = {(episode, int(seq)) for episode, seq in rows}
    return {"rows": len(rows), "duplicates": len(rows) - len(exported), "missing": len(stream - exported)}


async def otlp_spans(url: str, run: str) -> int:
    """Spans the test kit's OTLP receiver got from the `harnessrl otlp` exporter."""
    return await export_once(url, run)


if __name__ == "__main__":
    sys.exit(main())

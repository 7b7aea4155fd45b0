"""`harnessrl tail` against a real nats-server: what it prints is exactly what was published under the
filter (run, episode, kind, since), spans read as one summary line, and Ctrl-C ends it cleanly."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import (
    EpisodeScored,
    EpisodeStarted,
    RunStopped,
    StepMetrics,
    WeightVersion,
)
from harnessrl.stack.cli import main
from harnessrl.stack.natsserver import NatsServer
from harnessrl.stack.tail import parse_since
from harnessrl.testkit.span_sequences import RecordedEpisode, record_group

Published = set[tuple[str, int]]  # (subject, stream seq)


def new_run() -> str:
    return f"tail-{uuid.uuid4().hex[:8]}"


async def publish(bus: NatsBus, subject: str, message: msgspec.Struct, sent: Published) -> None:
    ack = await bus.publish(subject, message, msg_id=uuid.uuid4().hex)
    sent.add((subject, ack.seq))


async def publish_group(bus: NatsBus, episodes: list[RecordedEpisode]) -> dict[str, Published]:
    """Spans, rollouts and two lifecycle events per episode, by kind."""
    sent: dict[str, Published] = {"span": set(), "rollout": set(), "lifecycle": set()}
    for recorder, rollout in episodes:
        run, episode = rollout.run, rollout.episode
        for span in recorder.spans:
            await publish(bus, subjects.span(run, episode), span, sent["span"])
        started = EpisodeStarted(run=run, episode=episode, task=rollout.task, group=rollout.group)
        await publish(bus, subjects.episode_event(run, episode, "started"), started, sent["lifecycle"])
        scored = EpisodeScored(
            run=run, episode=episode, task=rollout.task, group=rollout.group, reward=rollout.reward
        )
        await publish(bus, subjects.episode_event(run, episode, "scored"), scored, sent["lifecycle"])
        await publish(bus, subjects.rollout(run), rollout, sent["rollout"])
    return sent


async def publish_run_events(bus: NatsBus, run: str, step: int) -> dict[str, Published]:
    sent: dict[str, Published] = {"weights": set(), "metrics": set(), "run": set()}
    weights = WeightVersion(run=run, version=step, step=step)
    await publish(bus, subjects.weights(run), weights, sent["weights"])
    metrics = StepMetrics(run=run, step=step, version=step, values={"reward/mean": 0.5})
    await publish(bus, subjects.metrics(run, "trainer"), metrics, sent["metrics"])
    stopped = RunStopped(run=run, cause="agent", reason="harness exited 2", episodes=4)
    await publish(bus, subjects.run_event(run, "stopped"), stopped, sent["run"])
    return sent


async def tail(
    capsys: pytest.CaptureFixture[str], server: NatsServer, *args: str
) -> tuple[int, list[dict[str, Any]]]:
    """Run `harnessrl tail --json ARGS` as a user would; its exit code and JSON lines."""
    capsys.readouterr()
    argv = ["tail", "--nats-url", server.url, "--json", "--until-idle", "0.5", *args]
    code = await asyncio.to_thread(main, argv)
    return code, [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def seen(records: list[dict[str, Any]]) -> Published:
    return {(record["subject"], record["seq"]) for record in records}


def union(*sent: dict[str, Published], kinds: tuple[str, ...] | None = None) -> Published:
    return {item for by_kind in sent for kind, items in by_kind.items() if kinds is None or kind in kinds
            for item in items}  # fmt: skip


async def test_json_lines_are_exactly_what_the_filter_selects(
    bus: NatsBus, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run, other = new_run(), new_run()
    group = record_group(run, "g0", random.Random(1), size=2)
    ours = await publish_group(bus, group)
    ours_run = await publish_run_events(bus, run, 1)
    theirs = await publish_group(bus, record_group(other, "g0", random.Random(2), size=2))
    await publish_run_events(bus, other, 1)

    code, records = await tail(capsys, nats_server, "--run", run, "--all")
    assert code == 0 and seen(records) == union(ours, ours_run)
    assert len(records) == 4 + 4 + 2 + 3

    episode = group[0][1].episode
    _, records = await tail(capsys, nats_server, "--run", run, "--episode", episode, "--all")
    assert {r["kind"] for r in records} == {"span", "lifecycle", "rollout"}
    assert all(r["message"]["episode"] == episode for r in records) and len(records) == 2 + 2 + 1

    _, records = await tail(capsys, nats_server, "--run", run, "--kind", "span", "--kind", "weights", "--all")
    assert seen(records) == union(ours, ours_run, kinds=("span", "weights"))

    _, records = await tail(capsys, nats_server, "--kind", "rollout", "--all")  # any run
    assert union(ours, theirs, kinds=("rollout",)) <= seen(records)


async def test_since_starts_at_a_point_in_time(
    bus: NatsBus, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run = new_run()
    await publish_group(bus, record_group(run, "g0", random.Random(3), size=2))
    await asyncio.sleep(0.05)
    cut = datetime.now(UTC)
    await asyncio.sleep(0.05)
    later = await publish_group(bus, record_group(run, "g1", random.Random(4), size=2))
    later_run = await publish_run_events(bus, run, 2)

    _, records = await tail(capsys, nats_server, "--run", run, "--since", cut.isoformat())
    assert seen(records) == union(later, later_run)
    assert all(datetime.fromisoformat(r["time"]) >= cut for r in records)

    _, records = await tail(capsys, nats_server, "--run", run, "--since", "10m")
    assert len(records) == 2 * (4 + 4 + 2) + 3  # both groups


async def test_json_carries_the_contract_with_token_lists_as_lengths_unless_asked(
    bus: NatsBus, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run = new_run()
    [(recorder, _)] = record_group(run, "g0", random.Random(5), size=1, turns=1, completion_tokens=5)
    [span] = recorder.spans
    ack = await bus.publish(subjects.span(run, span.episode), span, msg_id=span.span_id)

    _, [record] = await tail(capsys, nats_server, "--run", run, "--all")
    assert record["stream"] == "SPANS" and record["seq"] == ack.seq and record["type"] == "Span"
    assert datetime.fromisoformat(record["time"]) > datetime.now(UTC) - timedelta(minutes=1)
    message = record["message"]
    assert message["span_id"] == span.span_id and message["prompt_len"] == 10
    assert message["prompt_suffix_len"] == 10 and "prompt_suffix_ids" not in message
    assert message["completions"][0]["token_ids_len"] == 5 and "token_ids" not in message["completions"][0]

    _, [record] = await tail(capsys, nats_server, "--run", run, "--all", "--tokens")
    assert record["message"]["completions"][0]["token_ids"] == span.completions[0].token_ids


async def test_the_human_view_summarises_each_message_in_one_line(
    bus: NatsBus, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run = new_run()
    [(recorder, rollout)] = record_group(run, "g0", random.Random(6), size=1, turns=1, version=3)
    recorder.spans[0] = msgspec.structs.replace(recorder.spans[0], latency_s=0.25, stream=True)
    await publish_group(bus, [(recorder, rollout)])
    await publish_run_events(bus, run, 4)

    capsys.readouterr()
    code = await asyncio.to_thread(main, ["tail", "--nats-url", nats_server.url, "--run", run, "--all",
                                          "--until-idle", "0.5"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    episode = rollout.episode
    assert f"span      {run}/{episode} #0 chat stream in 10 out 5 tok 0.25s v3 ok" in out
    assert f"lifecycle {run}/{episode} scored reward 0" in out
    assert f"rollout   {run}/{episode} group g0 reward 0, 1 spans, versions [3]" in out
    assert f"weights   {run} v4 step 4" in out
    assert f"metrics   {run} step 4 v4: reward/mean 0.5" in out
    assert f"run       {run} stopped: 4 episodes failed (agent): harness exited 2" in out


async def test_from_now_skips_what_is_stored_and_ctrl_c_exits_cleanly(
    bus: NatsBus, nats_server: NatsServer
) -> None:
    run = new_run()
    old = WeightVersion(run=run, version=1, step=1)
    await bus.publish(subjects.weights(run), old, msg_id=f"{run}:1")
    cli = [sys.executable, "-m", "harnessrl.stack.cli"]
    command = [*cli, "tail", "--nats-url", nats_server.url, "--run", run, "--json"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(first_line_while_publishing(bus, run, proc), timeout=30)
        proc.send_signal(signal.SIGINT)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads(line)["message"]["version"] > 1  # the stored version 1 was not shown
    assert proc.returncode == 0 and "Traceback" not in stderr


async def first_line_while_publishing(bus: NatsBus, run: str, proc: subprocess.Popen[str]) -> str:
    """Publish a new weight version every 0.2 s until the tail prints its first line."""
    assert proc.stdout is not None
    reading = asyncio.ensure_future(asyncio.to_thread(proc.stdout.readline))
    version = 1
    while not reading.done():
        version += 1
        await bus.publish(subjects.weights(run), WeightVersion(run=run, version=version, step=version),
                          msg_id=f"{run}:{version}")  # fmt: skip
        await asyncio.wait([reading], timeout=0.2)
    return reading.result()


def test_since_reads_a_duration_back_from_now_or_a_time() -> None:
    now = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    assert parse_since("10m", now) == now - timedelta(minutes=10)
    assert parse_since("1.5h", now) == now - timedelta(minutes=90)
    assert parse_since("90s", now) == now - timedelta(seconds=90)
    assert parse_since("2026-12-01T09:00Z") == datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    local = datetime(2026, 12, 1, 9, 0).astimezone()
    assert parse_since("2026-12-01T09:00") == local  # no zone: local time
    with pytest.raises(argparse.ArgumentTypeError, match="neither a duration"):
        parse_since("yesterday")


def test_an_episode_with_only_run_level_kinds_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tail", "--episode", "e0", "--kind", "weights"]) == 2
    assert "only span, lifecycle and rollout" in capsys.readouterr().err

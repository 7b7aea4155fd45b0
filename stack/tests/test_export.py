"""`harnessrl export`: Parquet tables that hold every message of the streams exactly once.

Against the session's real nats-server: the export is killed with SIGKILL mid-way and restarted; an
interrupted commit's leftovers are cleaned up; two runs land in their own partitions; a folder is
never shared by two exports or two filters. The tables are read back with `pyarrow.dataset` and
compared with a replay of the streams (sequence numbers, message ids, token ids).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus import Delivery, NatsBus, Outgoing
from harnessrl.shared.contracts import (
    ContractError,
    EpisodeCompleted,
    EpisodeFailed,
    EpisodeScheduled,
    EpisodeStarted,
    Span,
    StepMetrics,
    WeightVersion,
    event_kind,
)
from harnessrl.stack.export import (
    MANIFEST,
    TABLES,
    ExportError,
    ExportOptions,
    Manifest,
    Table,
    export,
    first_seq,
)
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.span_sequences import publish_episodes, record_group

PARTITION = ds.partitioning(pa.schema([("run", pa.string()), ("day", pa.string())]), flavor="hive")


def new_run() -> str:
    return f"exp{uuid.uuid4().hex[:8]}"


async def publish_run(bus: NatsBus, run: str, groups: int, *, first_group: int = 0) -> None:
    """What a run leaves on the bus: spans and rollouts, lifecycle events, a weight version per step."""
    rng = random.Random(run)
    for number in range(first_group, first_group + groups):
        group = f"g{number}"
        episodes = record_group(run, group, rng, size=4, turns=2)
        await publish_episodes(bus, episodes)
        events: list[Outgoing] = []
        for recorder, rollout in episodes:
            ids = {"run": run, "episode": recorder.episode, "task": group, "group": group}
            finished = (
                EpisodeCompleted(**ids, reward=rollout.reward, span_count=len(recorder.spans))
                if rollout.reward
                else EpisodeFailed(**ids, cause="agent", reason="exit 1")
            )
            scheduled = EpisodeScheduled(**ids, sampling={"temperature": 1.0})
            for event in (scheduled, EpisodeStarted(**ids), finished):
                kind = event_kind(event)
                subject = subjects.episode_event(run, recorder.episode, kind)
                events.append(Outgoing(subject=subject, message=event, msg_id=f"{recorder.episode}:{kind}"))
        step = number + 1
        weights = WeightVersion(run=run, version=step, step=step, checkpoint_uri=f"file:///ckpt/{step}")
        metrics = StepMetrics(run=run, step=step, version=step, values={"reward/mean": 0.5}, dropped={"x": 1})
        events.append(Outgoing(subject=subjects.weights(run), message=weights, msg_id=f"{run}:{step}"))
        events.append(
            Outgoing(subject=subjects.metrics(run, "trainer"), message=metrics, msg_id=f"{run}:m{step}")
        )
        await bus.publish_batch(events)


def exported(out: Path, table: str) -> list[dict[str, Any]]:
    """A table's rows, partition columns included, in stream order."""
    folder = out / table
    rows = ds.dataset(folder, format="parquet", partitioning=PARTITION).to_table().to_pylist()
    return sorted(rows, key=lambda row: row["stream_seq"])


async def assert_exactly_once(bus: NatsBus, out: Path, run: str) -> dict[str, int]:
    """Every message of `run` in every stream is one row of its table, in its run's partition."""
    counts = {}
    for table in TABLES:
        stored = [d for d in await bus.replay(table.stream.name, table.filter(run)) if valid(d, table)]
        rows = [row for row in exported(out, table.name) if row["run"] == run]
        assert [(r["stream_seq"], r["msg_id"]) for r in rows] == [(d.stream_seq, d.msg_id) for d in stored]
        assert all(row["day"] == row["stored_at"].date().isoformat() for row in rows), table.name
        counts[table.name] = len(rows)
    assert_parts_named_by_their_sequences(out)
    return counts


def valid(stored: Delivery, table: Table) -> bool:
    """Whether a stored message is one of the table's contract (the export skips any other)."""
    try:
        stored.decode(table.contract)
    except ContractError:
        return False
    return True


def assert_parts_named_by_their_sequences(out: Path) -> None:
    """Each part is `part-<first>-<last>.parquet` of the sequences it holds; no two parts overlap."""
    for table in TABLES:
        for folder in {part.parent for part in (out / table.name).rglob("part-*.parquet")}:
            ranges = []
            for part in sorted(folder.glob("part-*.parquet"), key=first_seq):
                seqs = ds.dataset(part, format="parquet").to_table(columns=["stream_seq"])["stream_seq"]
                first, last = seqs[0].as_py(), seqs[-1].as_py()
                assert part.name == f"part-{first:012d}-{last:012d}.parquet"
                ranges.append((first, last))
            assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges)), ranges


async def assert_token_ids_equal_the_spans(bus: NatsBus, out: Path, run: str) -> None:
    """Prompt suffix ids and completion ids are list columns holding exactly the spans' ids."""
    schema = ds.dataset(out / "spans", format="parquet", partitioning=PARTITION).schema
    assert schema.field("prompt_suffix_ids").type == pa.list_(pa.int64())
    assert schema.field("completions").type.value_type.field("token_ids").type == pa.list_(pa.int64())
    rows = {row["span_id"]: row for row in exported(out, "spans") if row["run"] == run}
    spans = [d.decode(Span) for d in await bus.replay("SPANS", subjects.spans_of_run(run))]
    assert len(rows) == len(spans)
    for span in spans:
        row = rows[span.span_id]
        assert row["prompt_suffix_ids"] == span.prompt_suffix_ids
        assert [c["token_ids"] for c in row["completions"]] == [c.token_ids for c in span.completions]
        assert [c["logprobs"] for c in row["completions"]] == [c.logprobs for c in span.completions]
        assert (row["episode"], row["seq"], row["prefix_len"]) == (span.episode, span.seq, span.prefix_len)


def committed(out: Path, table: str) -> int:
    path = out / table / MANIFEST
    return msgspec.json.decode(path.read_bytes(), type=Manifest).committed_seq if path.exists() else 0


def export_command(out: Path, url: str, *flags: str) -> list[str]:
    cli = [sys.executable, "-m", "harnessrl.stack.cli", "export"]
    return [*cli, "--out", str(out), "--nats-url", url, *flags]


async def wait_for_parts(process: subprocess.Popen[bytes], out: Path, timeout_s: float = 30.0) -> None:
    """Until the export has written its first few parts of spans (it is then mid-way through them)."""
    deadline = time.monotonic() + timeout_s
    while len(list((out / "spans").rglob("part-*.parquet"))) < 4:
        assert process.poll() is None, "the export ended on its own"
        assert time.monotonic() < deadline, "the export committed nothing"
        await asyncio.sleep(0.02)


@pytest.mark.timeout(180)
async def test_an_export_killed_mid_way_resumes_with_every_message_exactly_once(
    bus: NatsBus, nats_server: NatsServer, tmp_path: Path
) -> None:
    run, out = new_run(), tmp_path / "export"
    await publish_run(bus, run, groups=120)  # 960 spans, 480 rollouts, 1,440 lifecycle events
    small_batches = ("--run", run, "--batch", "5", "--flush-s", "0.2")
    with (tmp_path / "first.log").open("wb") as logs:
        first = subprocess.Popen(export_command(out, nats_server.url, *small_batches), stderr=logs)
        try:
            await wait_for_parts(first, out)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
    last_span = (await bus.replay("SPANS", subjects.spans_of_run(run)))[-1].stream_seq
    assert committed(out, "spans") < last_span, "killed only after it had exported every span"

    second = subprocess.run(
        export_command(out, nats_server.url, "--run", run, "--until-idle", "1"),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    counts = await assert_exactly_once(bus, out, run)
    assert counts == {"spans": 960, "episodes": 1440, "rollouts": 480, "weights": 120, "metrics": 120}
    resumed = json.loads(second.stdout.splitlines()[-1])["rows"]
    assert 0 < resumed["spans"] < counts["spans"], resumed  # the restart exported only the rest
    await assert_token_ids_equal_the_spans(bus, out, run)


async def test_an_interrupted_commit_is_undone_and_read_again(
    bus: NatsBus, nats_server: NatsServer, tmp_path: Path
) -> None:
    run, out = new_run(), tmp_path / "export"
    options = ExportOptions(out=out, nats_url=nats_server.url, run=run, until_idle_s=0.3)
    await publish_run(bus, run, groups=2)
    await export(options)
    position = committed(out, "spans")
    [part] = (out / "spans").rglob("part-*.parquet")
    # What a kill mid-commit leaves: a half-written temp file, a renamed part the manifest never
    # covered (here a copy of committed rows, which would show up twice if it were kept), and a
    # manifest that was never renamed into place.
    (part.parent / f".part-{position + 1:012d}-{position + 8:012d}.parquet.tmp").write_bytes(b"PAR1 half")
    shutil.copy(part, part.with_name(f"part-{position + 1:012d}-{position + 4:012d}.parquet"))
    (out / "spans" / f".{MANIFEST}.tmp").write_bytes(b'{"committed_seq": 99')
    await publish_run(bus, run, groups=2, first_group=2)
    await bus.js.publish(subjects.span(run, "garbled"), b"\x00 not a span")  # skipped, but covered

    rows = await export(options)
    assert rows["spans"] == 16
    assert not list(out.rglob("*.tmp"))
    await assert_exactly_once(bus, out, run)
    assert committed(out, "spans") == (await bus.js.stream_info("SPANS")).state.last_seq


async def test_runs_are_partitioned_and_a_second_export_adds_only_what_is_new(
    bus: NatsBus, nats_server: NatsServer, tmp_path: Path
) -> None:
    runs, out = [new_run(), new_run()], tmp_path / "export"
    options = ExportOptions(out=out, nats_url=nats_server.url, until_idle_s=0.3)  # every run
    for run in runs:
        await publish_run(bus, run, groups=2)
    await export(options)
    await publish_run(bus, runs[0], groups=1, first_group=2)
    await export(options)
    assert (await assert_exactly_once(bus, out, runs[0]))["spans"] == 24
    assert (await assert_exactly_once(bus, out, runs[1]))["spans"] == 16
    for table in TABLES:
        seqs = [row["stream_seq"] for row in exported(out, table.name)]
        assert len(seqs) == len(set(seqs)), table.name  # the other tests' runs exactly once too
    assert {p.parent.parent.name for p in (out / "spans").rglob("part-*.parquet")} >= {
        f"run={r}" for r in runs
    }
    await assert_token_ids_equal_the_spans(bus, out, runs[0])


async def test_a_folder_takes_one_export_of_one_filter(
    bus: NatsBus, nats_server: NatsServer, tmp_path: Path
) -> None:
    out, run = tmp_path / "export", new_run()
    await publish_run(bus, run, groups=1)
    last_span = (await bus.replay("SPANS", subjects.spans_of_run(run)))[-1].stream_seq
    stop = asyncio.Event()
    options = ExportOptions(out=out, nats_url=nats_server.url, run=run, flush_s=0.1)
    following = asyncio.create_task(export(options, stop))
    while committed(out, "spans") < last_span:
        await asyncio.sleep(0.02)
    with pytest.raises(ExportError, match="another export is writing"):
        await export(ExportOptions(out=out, nats_url=nats_server.url, run=run, until_idle_s=0.1))
    stop.set()
    assert (await following)["spans"] == 8
    with pytest.raises(
        ExportError, match=rf"exports hrl\.span\.{run}\.\*, not hrl\.span\.>: use another --out"
    ):
        await export(ExportOptions(out=out, nats_url=nats_server.url, until_idle_s=0.1))
    (out / "spans" / MANIFEST).unlink()
    with pytest.raises(ExportError, match=re.escape(f"holds parts but no {MANIFEST}")):
        await export(options)
    with pytest.raises(ExportError, match="--run"):
        ExportOptions(out=out, run="a.b")

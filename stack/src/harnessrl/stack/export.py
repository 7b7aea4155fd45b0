"""`harnessrl export`: the bus's history as Parquet tables, every message exactly once, resumable.

Five tables, one per stream: `spans`, `episodes` (every lifecycle kind in one table, a column per field
of any kind), `rollouts`, `weights` and `metrics`. A row is one message: its contract's fields under
their own names (nested structs stay structs, token ids are lists of int64, free-form dicts are JSON
text), plus where it sits in its stream: `stream_seq`, `subject`, `msg_id` and `stored_at` (when
JetStream stored it, which also names its day). `run` and `day` are the partition, not columns:

    <out>/<table>/run=<run>/day=<YYYY-MM-DD>/part-<first seq>-<last seq>.parquet
    <out>/<table>/_export.json      the committed position: stream, filter, last sequence

Exactly once. A table is read in stream order from one sequence on and written in batches. A batch
spans several partitions, so it becomes several parts: each is written to a hidden temp file, fsynced
and renamed into place, and then `_export.json`, naming the batch's last stream sequence, is replaced
the same way. That last rename is the commit, and the manifest the only place the position lives.
Part names alone could not say whether a kill between two renames left their batch whole; the
manifest can. On start, an interrupted commit's leftovers are deleted (temp files, and parts whose
first sequence is past the committed one) and reading resumes right after the committed sequence.
The server holds no position: the reader is an unacknowledged consumer started at that sequence and
re-created from the next one whenever it is lost or skips one (`StreamReader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import nats.errors
import nats.js.errors
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.bus.nats.consumers import MSG_ID
from harnessrl.shared.contracts import (
    ContractError,
    EpisodeEvent,
    RolloutComplete,
    Span,
    StepMetrics,
    WeightVersion,
    decode,
)
from harnessrl.shared.log import get_logger
from harnessrl.shared.net import DEFAULT_NATS_URL
from harnessrl.shared.subjects import StreamSpec

log = get_logger(__name__)

MANIFEST = "_export.json"
LOCK = ".export.lock"
# Where a row sits in its stream; the columns every table starts with.
ENVELOPE = [
    ("stream_seq", pa.int64()),
    ("subject", pa.string()),
    ("msg_id", pa.string()),
    ("stored_at", pa.timestamp("us", tz="UTC")),
]
# Contract fields that are no column: the partition, and the schema version every row read shares.
_NOT_COLUMNS = frozenset({"run", "schema"})
_SCALARS: dict[type, pa.DataType] = {
    mi.IntType: pa.int64(),
    mi.FloatType: pa.float64(),
    mi.StrType: pa.string(),
    mi.BoolType: pa.bool_(),
    mi.BytesType: pa.binary(),
}
Row = dict[str, Any]


class ExportError(RuntimeError):
    """The export cannot start or go on; the message is meant for a person."""


class ExportOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What `harnessrl export` was asked to do."""

    out: Path
    nats_url: str = DEFAULT_NATS_URL
    # Export only this run's messages (a subject filter on every stream); None exports every run.
    run: str | None = None
    # Messages per commit. A commit costs a file per partition and a few fsyncs, so bigger is faster;
    # a crash makes the next start read at most this many again.
    batch: int = 1000
    # A partial batch is committed after this long, so a quiet run's rows show up within it.
    flush_s: float = 5.0
    # Stop once nothing new came for this long (None: follow until SIGINT or SIGTERM).
    until_idle_s: float | None = None

    def __post_init__(self) -> None:
        """Reject values no export could use, naming the flag."""
        if self.batch < 1 or self.flush_s <= 0 or (self.until_idle_s is not None and self.until_idle_s <= 0):
            raise ExportError("--batch, --flush-s and --until-idle must be above zero")
        if self.run is not None:
            try:
                subjects.token(self.run)
            except ValueError as exc:
                raise ExportError(f"--run: {exc}") from exc


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A table folder's committed position (`_export.json`)."""

    stream: str
    filter: str
    committed_seq: int


# --- tables: a stream's contract as Arrow columns ----------------------------------------------------


def arrow_type(kind: mi.Type) -> pa.DataType | None:
    """The Arrow type of a contract field's type, or None when it is free-form (stored as JSON text)."""
    if isinstance(kind, mi.UnionType):
        present = [t for t in kind.types if not isinstance(t, mi.NoneType)]
        return arrow_type(present[0]) if len(present) == 1 else None
    if isinstance(kind, mi.ListType):
        item = arrow_type(kind.item_type)
        return None if item is None else pa.list_(item)
    if isinstance(kind, mi.DictType):
        value = arrow_type(kind.value_type)
        keyed = isinstance(kind.key_type, mi.StrType) and value is not None
        return pa.map_(pa.string(), value) if keyed else None
    if isinstance(kind, mi.StructType):
        fields = [(f.name, arrow_type(f.type)) for f in kind.fields]
        return None if any(t is None for _, t in fields) else pa.struct(fields)
    if isinstance(kind, mi.LiteralType):
        return pa.string() if all(isinstance(v, str) for v in kind.values) else None
    return _SCALARS.get(type(kind))


class Table(msgspec.Struct, frozen=True, kw_only=True):
    """One exported table: the stream it reads, its contract and the Arrow schema derived from it."""

    name: str
    stream: StreamSpec
    contract: Any
    of_run: Callable[[str], str]
    schema: pa.Schema
    json_fields: frozenset[str]

    def filter(self, run: str | None) -> str:
        """The subject filter of the whole table, or of one run's part of it."""
        return self.stream.subjects[0] if run is None else self.of_run(run)

    def row(self, msg: Msg) -> tuple[str, Row]:
        """A stored message as (its run, its row); `ContractError` when it is no valid message."""
        fields = msgspec.to_builtins(decode(msg.data, self.contract), builtin_types=(bytes,))
        for name in self.json_fields:
            if fields.get(name) is not None:
                fields[name] = msgspec.json.encode(fields[name]).decode()
        meta = msg.metadata
        where = {"stream_seq": meta.sequence.stream, "subject": msg.subject, "stored_at": meta.timestamp}
        return str(fields.pop("run")), {**fields, **where, "msg_id": (msg.headers or {}).get(MSG_ID)}


def table(name: str, stream: StreamSpec, contract: Any, of_run: Callable[[str], str]) -> Table:
    """Describe a table; its columns follow the contract (for a union, every member's fields)."""
    info = mi.type_info(contract)
    kinds = info.types if isinstance(info, mi.UnionType) else (info,)
    members = [kind for kind in kinds if isinstance(kind, mi.StructType)]
    columns: dict[str, pa.DataType | None] = {}
    for member in members:
        if member.tag_field is not None:
            columns.setdefault(member.tag_field, pa.string())
        for field in member.fields:
            if field.name not in _NOT_COLUMNS:
                columns.setdefault(field.name, arrow_type(field.type))
    schema = pa.schema([*ENVELOPE, *((n, t or pa.string()) for n, t in columns.items())])
    json_fields = frozenset(n for n, t in columns.items() if t is None)
    return Table(
        name=name, stream=stream, contract=contract, of_run=of_run, schema=schema, json_fields=json_fields
    )


TABLES = (
    table("spans", subjects.SPANS, Span, subjects.spans_of_run),
    table("episodes", subjects.EPISODES, EpisodeEvent, subjects.episode_events_of_run),
    table("rollouts", subjects.ROLLOUTS, RolloutComplete, subjects.rollout),
    table("weights", subjects.WEIGHTS, WeightVersion, subjects.weights),
    table("metrics", subjects.METRICS, StepMetrics, subjects.metrics_of_run),
)


# --- a table's folder: parts, the manifest, and what an interrupted commit left ---------------------


class Batch:
    """What was read since the last commit: rows by partition (run, day), and how far it read."""

    def __init__(self) -> None:
        self.parts: dict[tuple[str, str], list[Row]] = {}
        self.read = 0
        self.rows = 0
        self.last_seq = 0
        self.opened = 0.0

    def add(self, table: Table, msg: Msg) -> None:
        """Take one message; one that is no valid message only advances the position (and is logged)."""
        meta = msg.metadata
        if not self.read:
            self.opened = time.monotonic()
        self.read += 1
        self.last_seq = meta.sequence.stream
        try:
            run, row = table.row(msg)
        except ContractError as exc:
            log.warning("export.undecodable", table=table.name, seq=self.last_seq, error=str(exc))
            return
        self.parts.setdefault((run, meta.timestamp.date().isoformat()), []).append(row)
        self.rows += 1

    def due(self, flush_s: float) -> bool:
        """Whether the batch has waited `flush_s` since its first message."""
        return bool(self.read) and time.monotonic() - self.opened >= flush_s


class TableFolder:
    """One table's folder: its committed position, its parts, and recovery from an interrupted commit."""

    def __init__(self, root: Path, table: Table, filter_subject: str) -> None:
        self.root, self.table, self.filter = root, table, filter_subject

    def recover(self) -> int:
        """The committed stream sequence (0: none yet), once an interrupted commit's leftovers are gone."""
        self.root.mkdir(parents=True, exist_ok=True)
        committed = self._committed()
        for path in self.root.rglob("*.tmp"):
            path.unlink()
            log.info("export.temp_removed", path=str(path))
        for path in self.root.rglob("part-*.parquet"):
            if first_seq(path) > committed:
                path.unlink()
                log.info("export.uncommitted_part_removed", path=str(path), committed=committed)
        return committed

    def _committed(self) -> int:
        """The manifest's position; a new folder gets one at 0 before it holds any part."""
        path = self.root / MANIFEST
        if not path.exists():
            if any(self.root.rglob("part-*.parquet")):
                raise ExportError(f"{self.root} holds parts but no {MANIFEST}: use another --out")
            self._save(0)
            return 0
        saved = msgspec.json.decode(path.read_bytes(), type=Manifest)
        if (saved.stream, saved.filter) != (self.table.stream.name, self.filter):
            raise ExportError(f"{self.root} exports {saved.filter}, not {self.filter}: use another --out")
        return saved.committed_seq

    def commit(self, batch: Batch) -> None:
        """Write the batch's parts, then its position; the manifest's rename is the commit."""
        folders = {self._write_part(run, day, rows) for (run, day), rows in batch.parts.items()}
        for folder in folders | {f.parent for f in folders}:
            _fsync(folder)
        self._save(batch.last_seq)

    def _save(self, committed_seq: int) -> None:
        manifest = Manifest(stream=self.table.stream.name, filter=self.filter, committed_seq=committed_seq)
        _replace(self.root / MANIFEST, msgspec.json.encode(manifest))

    def _write_part(self, run: str, day: str, rows: list[Row]) -> Path:
        """Write one partition's rows of a batch as a part named by their stream sequences."""
        folder = self.root / f"run={urllib.parse.quote(run, safe='')}" / f"day={day}"
        folder.mkdir(parents=True, exist_ok=True)
        name = f"part-{rows[0]['stream_seq']:012d}-{rows[-1]['stream_seq']:012d}.parquet"
        temp = folder / f".{name}.tmp"
        pq.write_table(pa.Table.from_pylist(rows, schema=self.table.schema), temp, compression="zstd")
        _fsync(temp)
        os.replace(temp, folder / name)
        return folder


def first_seq(part: Path) -> int:
    """The first stream sequence a part holds, from its name (`part-<first>-<last>.parquet`)."""
    return int(part.name.split("-")[1])


def _replace(path: Path, data: bytes) -> None:
    """Replace `path` by `data` atomically and durably: temp file, fsync, rename, fsync the folder."""
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_bytes(data)
    _fsync(temp)
    os.replace(temp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's (its entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading a stream in order from a sequence on ---------------------------------------------------

# An export's consumer outlives a disconnection of this long; after that the next read re-creates it.
_INACTIVE_S = 60.0
# At most this many messages per pull request (halved whenever the client dropped some).
_FETCH_MAX = 1000


class StreamReader:
    """Every message of one stream under a filter from `next_seq` on, in order, each once.

    An ephemeral consumer without acks delivers from `next_seq`. When the server drops it, a read
    fails or a consumer sequence is skipped (a message the client lost), it is re-created from the
    sequence after the last one handed out. `quiet_since` is since when every read found nothing
    new (None while messages come).
    """

    def __init__(self, js: JetStreamContext, stream: str, filter_subject: str, next_seq: int) -> None:
        self.js, self.stream, self.filter, self.next_seq = js, stream, filter_subject, next_seq
        self.quiet_since: float | None = None
        self._psub: Any = None
        self._name = ""
        self._delivered = 0
        self._fetch = _FETCH_MAX

    async def read(self, limit: int, timeout: float) -> list[Msg]:
        """Up to `limit` next messages, waiting up to `timeout` for the first; [] when none came."""
        asked = time.monotonic()
        try:
            if self._psub is None:
                await self._open()
            msgs = await self._psub.fetch(min(limit, self._fetch), timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            self.quiet_since = asked if self.quiet_since is None else self.quiet_since
            return []
        except (nats.errors.Error, OSError) as exc:
            log.warning("export.read_failed", stream=self.stream, after=self.next_seq - 1, error=repr(exc))
            self.quiet_since = None
            await self.close()
            await asyncio.sleep(0.5)
            return []
        self.quiet_since = None
        ordered = self._in_order(msgs)
        if len(ordered) < len(msgs):
            await self.close()
        return ordered

    def _in_order(self, msgs: list[Msg]) -> list[Msg]:
        """The messages up to the first skipped consumer sequence; advances `next_seq` past them.

        A skip means the client dropped messages (more pending bytes than it buffers): later reads
        ask for half as many at a time.
        """
        for count, msg in enumerate(msgs):
            sequence = msg.metadata.sequence
            if sequence.consumer != self._delivered + 1:
                self._fetch = max(self._fetch // 2, 1)
                log.warning(
                    "export.reader_gap", stream=self.stream, after=self.next_seq - 1, fetch=self._fetch
                )
                return msgs[:count]
            self._delivered, self.next_seq = sequence.consumer, sequence.stream + 1
        return msgs

    async def _open(self) -> None:
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.next_seq,
            filter_subject=self.filter,
            inactive_threshold=_INACTIVE_S,
            mem_storage=True,
        )
        self._psub = await self.js.pull_subscribe(self.filter, stream=self.stream, config=config)
        self._name = (await self._psub.consumer_info()).name
        self._delivered = 0

    async def close(self) -> None:
        """End the consumer (the position stays in `next_seq`)."""
        psub, self._psub = self._psub, None
        if psub is None:
            return
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await psub.unsubscribe()
            await self.js.delete_consumer(self.stream, self._name)


# --- the export ----------------------------------------------------------------------------------------


class TableExport:
    """One table: read its stream, commit it to its folder batch by batch."""

    def __init__(self, table: Table, folder: TableFolder, reader: StreamReader, options: ExportOptions):
        self.table, self.folder, self.reader, self.options = table, folder, reader, options
        self.rows = 0

    async def run(self, stop: asyncio.Event) -> int:
        """Export until `stop` or, with `until_idle_s`, until caught up; returns the rows committed."""
        batch = Batch()
        while not stop.is_set() and not self._idle():
            for msg in await self.reader.read(self.options.batch - batch.read, self._wait(batch)):
                batch.add(self.table, msg)
            if batch.read >= self.options.batch or batch.due(self.options.flush_s):
                batch = await self._commit(batch)
        await self._commit(batch)
        return self.rows

    async def _commit(self, batch: Batch) -> Batch:
        """Commit a batch (off the event loop: fsyncs block); returns the next, empty one."""
        if batch.read:
            await asyncio.to_thread(self.folder.commit, batch)
            self.rows += batch.rows
            log.debug("export.committed", table=self.table.name, seq=batch.last_seq, rows=batch.rows)
        return Batch()

    def _wait(self, batch: Batch) -> float:
        """How long a read may wait: until the batch is due, and at most a second (to notice `stop`)."""
        due = self.options.flush_s - (time.monotonic() - batch.opened) if batch.read else 1.0
        return min(max(due, 0.05), 1.0, self.options.until_idle_s or 1.0)

    def _idle(self) -> bool:
        idle_s, quiet_since = self.options.until_idle_s, self.reader.quiet_since
        return idle_s is not None and quiet_since is not None and time.monotonic() - quiet_since >= idle_s


async def export(options: ExportOptions, stop: asyncio.Event | None = None) -> dict[str, int]:
    """Export every table until `stop` (with `until_idle_s`, until all are caught up); rows per table."""
    stop = stop or asyncio.Event()
    with _exclusive(options.out):
        bus = NatsBus(options.nats_url, name="harnessrl-export")
        await bus.connect()
        exports: list[TableExport] = []
        try:
            await bus.ensure_streams([t.stream for t in TABLES])
            exports = [await _resume(bus, t, options) for t in TABLES]
            rows = await _run_all(exports, stop)
        finally:
            for each in exports:
                await each.reader.close()
            await bus.close()
    return {t.name: n for t, n in zip(TABLES, rows, strict=True)}


async def _resume(bus: NatsBus, table: Table, options: ExportOptions) -> TableExport:
    """A table's export, recovered and positioned right after its committed sequence."""
    filter_subject = table.filter(options.run)
    folder = TableFolder(options.out / table.name, table, filter_subject)
    committed = folder.recover()
    state = (await bus.js.stream_info(table.stream.name)).state
    if state.last_seq < committed:
        raise ExportError(
            f"stream {table.stream.name} ends at {state.last_seq} but {folder.root} holds it up to "
            f"{committed}: the stream was recreated, export it into another --out"
        )
    if committed and state.first_seq > committed + 1:
        log.warning("export.gap", table=table.name, lost=f"{committed + 1}-{state.first_seq - 1}")
    log.info("export.resumed", table=table.name, after=committed, stored=state.last_seq)
    reader = StreamReader(bus.js, table.stream.name, filter_subject, committed + 1)
    return TableExport(table, folder, reader, options)


async def _run_all(exports: list[TableExport], stop: asyncio.Event) -> list[int]:
    """Run every table's export; one that fails stops the others, which commit what they read."""

    async def run(each: TableExport) -> int:
        try:
            return await each.run(stop)
        except BaseException:
            stop.set()
            raise

    results = await asyncio.gather(*(run(each) for each in exports), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [result for result in results if not isinstance(result, BaseException)]


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """Hold `out` for this export alone; the kernel drops the lock when the process dies (kill -9 too)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / LOCK).open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise ExportError(f"another export is writing {out}") from exc
        yield


def run_export(options: ExportOptions) -> dict[str, int]:
    """Run `export` to its end in a new event loop; SIGINT and SIGTERM stop it after a last commit."""

    async def main() -> dict[str, int]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await export(options, stop)

    return asyncio.run(main())

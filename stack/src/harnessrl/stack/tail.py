"""`harnessrl tail`: the event stream as it happens, one readable line (or JSON object) per message.

Spans, lifecycle events, rollouts, weight versions, step metrics and run events are read through
one ephemeral ordered consumer per stream (no acks, nothing durable left on the server), filtered
on the server by run and episode where the subject carries them, from now, from a point in time
(`--since`) or from the start (`--all`). Each stream keeps its own order; messages of different
streams interleave as they arrive. A span is summarised (API, tokens in and out, latency, weight
version, status); with `--json` every message is its subject, stream, stream sequence, time and
decoded contract, a span's token lists cut to their lengths unless `--tokens`.

`Bus` offers neither start-time delivery nor message timestamps, so this module uses the JetStream
context of `NatsBus` (`bus.js`) for its consumers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api
from rich.console import Console
from rich.text import Text

from harnessrl.shared import subjects
from harnessrl.shared.bus import BusError, NatsBus
from harnessrl.shared.contracts import (
    AgentExited,
    ContractError,
    EpisodeCompleted,
    EpisodeEventBase,
    EpisodeFailed,
    EpisodeRetried,
    EpisodeScheduled,
    EpisodeScored,
    EpisodeStarted,
    RolloutComplete,
    RunStopped,
    ServiceMetrics,
    Span,
    StepMetrics,
    WeightVersion,
    decode,
    decode_event,
    event_kind,
)
from harnessrl.shared.net import DEFAULT_NATS_URL, NatsUnreachable, probe_nats
from harnessrl.stack.health import stop_text


class TailError(RuntimeError):
    """The stream can't be tailed as asked; the message is meant for a person."""


class Feed(msgspec.Struct, frozen=True, kw_only=True):
    """Where one kind of message lives (the layout of `shared.subjects`) and how it is decoded.

    `pattern` is the subject filter after the `hrl.` prefix, `{run}` and `{episode}` to fill (an id
    or `*`);
    `episode_in` says where the episode shows: a subject token, only the decoded message, or
    nowhere (None: a run-level message).
    """

    stream: str
    pattern: str
    decoder: Callable[[bytes], msgspec.Struct]
    episode_in: Literal["subject", "message"] | None = None


def _decoder(kind: type[msgspec.Struct]) -> Callable[[bytes], msgspec.Struct]:
    return partial(decode, kind=kind)


def _metrics_decoder(data: bytes) -> msgspec.Struct:
    """A trainer's `StepMetrics`, else a service's periodic `ServiceMetrics` (`hrl.metrics._service.*`)."""
    try:
        return decode(data, kind=StepMetrics)
    except ContractError:
        return decode(data, kind=ServiceMetrics)


FEEDS: dict[str, Feed] = {
    "span": Feed(
        stream=subjects.SPANS.name, pattern="span.{run}.{episode}", decoder=_decoder(Span),
        episode_in="subject",
    ),
    "lifecycle": Feed(
        stream=subjects.EPISODES.name, pattern="episode.{run}.{episode}.*", decoder=decode_event,
        episode_in="subject",
    ),
    "rollout": Feed(
        stream=subjects.ROLLOUTS.name, pattern="rollout.{run}", decoder=_decoder(RolloutComplete),
        episode_in="message",
    ),
    "weights": Feed(stream=subjects.WEIGHTS.name, pattern="weights.{run}", decoder=_decoder(WeightVersion)),
    "metrics": Feed(stream=subjects.METRICS.name, pattern="metrics.{run}.*", decoder=_metrics_decoder),
    "run": Feed(stream=subjects.RUNS.name, pattern="run.{run}.*", decoder=_decoder(RunStopped)),
}  # fmt: skip


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """What to tail: which kinds, of which run and episode (None: any), from when.

    `since` None with `from_start` False means from now on. With an episode, run-level kinds
    (weights, metrics, run events) are left out: they are about no episode.
    """

    kinds: tuple[str, ...] = tuple(FEEDS)
    run: str | None = None
    episode: str | None = None
    since: datetime | None = None
    from_start: bool = False

    def feeds(self) -> dict[str, Feed]:
        """The feeds to consume."""
        chosen = {kind: FEEDS[kind] for kind in self.kinds}
        if self.episode is None:
            return chosen
        return {kind: feed for kind, feed in chosen.items() if feed.episode_in is not None}

    def consumer_config(self) -> api.ConsumerConfig:
        """Where each consumer starts."""
        if self.from_start:
            return api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL)
        if self.since is not None:
            return api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_TIME, opt_start_time=self.since
            )
        return api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW)


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One message as tailed: where it was stored, when, and its contract (or why it has none)."""

    kind: str
    subject: str
    stream: str
    seq: int
    time: datetime
    message: msgspec.Struct | None = None
    error: str | None = None


def read_entry(kind: str, msg: Msg) -> Entry:
    """Decode a delivered message; an undecodable one keeps the decoder's complaint."""
    meta = msg.metadata
    entry = Entry(
        kind=kind, subject=msg.subject, stream=meta.stream, seq=meta.sequence.stream, time=meta.timestamp
    )
    try:
        return msgspec.structs.replace(entry, message=FEEDS[kind].decoder(msg.data))
    except ContractError as exc:
        return msgspec.structs.replace(entry, error=str(exc))


class Tail:
    """Ordered consumers on the selected streams, merged into one queue of entries."""

    def __init__(self, bus: NatsBus, selection: Selection) -> None:
        self.bus = bus
        self.selection = selection
        self._queue: asyncio.Queue[Entry] = asyncio.Queue()
        self._subscriptions: list[Any] = []

    async def start(self) -> None:
        """Create one consumer per selected feed; a missing stream raises `TailError`."""
        selection = self.selection
        for kind, feed in selection.feeds().items():
            config = selection.consumer_config()
            subject = f"{subjects.PREFIX}." + feed.pattern.format(
                run=selection.run or "*", episode=selection.episode or "*"
            )
            try:
                sub = await self.bus.js.subscribe(
                    subject, stream=feed.stream, cb=self._receiver(kind), ordered_consumer=True, config=config
                )
            except nats.js.errors.NotFoundError as exc:
                raise TailError(
                    f"stream {feed.stream} does not exist (has a harnessrl service run here?)"
                ) from exc
            # nats-py keeps this config to recreate the consumer after a gap, from a start sequence;
            # the server refuses that with a start time still set.
            config.opt_start_time = None
            self._subscriptions.append(sub)

    def _receiver(self, kind: str) -> Callable[[Msg], Awaitable[None]]:
        async def receive(msg: Msg) -> None:
            entry = read_entry(kind, msg)
            if self._wanted(entry):
                self._queue.put_nowait(entry)

        return receive

    def _wanted(self, entry: Entry) -> bool:
        """The episode filter of feeds whose subject doesn't carry the episode."""
        episode = self.selection.episode
        if episode is None or FEEDS[entry.kind].episode_in != "message":
            return True
        return getattr(entry.message, "episode", None) == episode

    async def entries(self, *, limit: int | None = None, idle_s: float | None = None) -> AsyncIterator[Entry]:
        """Entries as they come: at most `limit`, ending after `idle_s` seconds without one."""
        count = 0
        while limit is None or count < limit:
            try:
                entry = await asyncio.wait_for(self._queue.get(), idle_s)
            except TimeoutError:
                return
            yield entry
            count += 1

    async def stop(self) -> None:
        """End every consumer (the server removes an ephemeral one once nobody listens)."""
        for sub in self._subscriptions:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subscriptions.clear()


# --- output ------------------------------------------------------------------------------------------


def json_record(entry: Entry, *, tokens: bool = False) -> dict[str, Any]:
    """The `--json` object of one entry; a span's token lists become lengths unless `tokens`."""
    record: dict[str, Any] = {
        "subject": entry.subject, "stream": entry.stream, "seq": entry.seq,
        "time": entry.time.isoformat(), "kind": entry.kind,
    }  # fmt: skip
    if entry.message is None:
        record["error"] = entry.error
        return record
    body = msgspec.to_builtins(entry.message)
    record["type"] = type(entry.message).__name__
    record["message"] = body if tokens or not isinstance(entry.message, Span) else _token_lengths(body)
    return record


def _token_lengths(span: dict[str, Any]) -> dict[str, Any]:
    """A span's builtins with each token list (`x`) replaced by its length (`x_len`)."""
    span["prompt_suffix_len"] = len(span.pop("prompt_suffix_ids", []))
    for completion in span.get("completions", []):
        completion["token_ids_len"] = len(completion.pop("token_ids", []))
        completion["logprobs_len"] = len(completion.pop("logprobs", []))
    return span


def json_writer(*, tokens: bool) -> Callable[[Entry], None]:
    """Write each entry as one JSON line (NaN logprobs become null), flushed at once."""

    def write(entry: Entry) -> None:
        sys.stdout.write(msgspec.json.encode(json_record(entry, tokens=tokens)).decode() + "\n")
        sys.stdout.flush()

    return write


def human_writer() -> Callable[[Entry], None]:
    """Print each entry as one line (never wrapped, so lines stay greppable)."""
    console = Console(highlight=False, soft_wrap=True)
    return lambda entry: console.print(summary_line(entry))


_STYLES = {"span": "cyan", "lifecycle": "green", "rollout": "magenta", "weights": "yellow", "run": "red"}
# The step metrics a metrics line shows, when the step has them.
_SHOWN_METRICS = ("reward/mean", "reward/pass_rate", "tokens/trained", "tokens/untrained")


def summary_line(entry: Entry) -> Text:
    """One entry for a person: local time, kind, then what the message says."""
    when = entry.time.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    said = (
        describe(entry.message)
        if entry.message is not None
        else f"undecodable {entry.subject}: {entry.error}"
    )
    return Text.assemble((when, "dim"), " ", (f"{entry.kind:<9}", _STYLES.get(entry.kind, "blue")), " ", said)


def describe(message: msgspec.Struct) -> str:
    """What a message says, in one line."""
    match message:
        case Span():
            said = span_summary(message)
        case EpisodeEventBase():
            said = f"{message.run}/{message.episode} {event_kind(message)} {_event_detail(message)}"
        case RolloutComplete(failure=failure):
            said = (
                f"{message.run}/{message.episode} group {message.group} reward {message.reward:g}, "
                f"{message.span_count} spans, versions {message.versions_seen}"
            ) + (f", failed ({failure})" if failure else "")
        case WeightVersion(carries_previous=carried):
            said = f"{message.run} v{message.version} step {message.step}" + (" (no new weights)" * carried)
        case StepMetrics():
            said = _metrics_summary(message)
        case ServiceMetrics():
            said = f"{message.service} {message.instance}: {len(message.values)} samples"
        case RunStopped():
            said = f"{message.run} stopped: {stop_text(message)}"
        case _:
            said = repr(message)
    return said.rstrip()


def span_summary(span: Span) -> str:
    """API, tokens in and out, latency, weight version and status of one call."""
    out = sum(len(completion.token_ids) for completion in span.completions)
    start, end = span.weight_version_start, span.weight_version_end
    version = f"v{start}" if end in (start, 0) else f"v{start}-{end}"
    error = f": {span.error}" if span.error else ""
    return (
        f"{span.run}/{span.episode} #{span.seq} {span.api}{' stream' * span.stream} in {span.prompt_len} "
        f"out {out} tok {span.latency_s:.2f}s {version} {span.status}{error}"
    )


def _event_detail(event: EpisodeEventBase) -> str:
    """The part of a lifecycle event that its kind adds."""
    match event:
        case EpisodeScheduled():
            detail = (
                f"task {event.task} attempt {event.attempt} ({event.launcher}, v{event.expected_version})"
            )
        case EpisodeStarted():
            detail = event.where
        case AgentExited(artifact=artifact):
            detail = f"exit {event.exit_code}, " + (
                f"{artifact.kind} {artifact.size} B" if artifact else "no artifact"
            )
        case EpisodeScored() | EpisodeCompleted():
            detail = f"reward {event.reward:g}"
        case EpisodeFailed():
            detail = f"{event.cause}: {event.reason}"
        case EpisodeRetried():
            detail = f"as {event.new_episode}"
        case _:
            detail = ""
    return detail


def _metrics_summary(metrics: StepMetrics) -> str:
    """Step, version, whether it trained, and the headline values."""
    values = ", ".join(
        f"{name} {metrics.values[name]:.4g}" for name in _SHOWN_METRICS if name in metrics.values
    )
    trained = "" if metrics.trained else " trained nothing"
    final = " (final)" if metrics.final else ""
    return f"{metrics.run} step {metrics.step} v{metrics.version}{trained}{final}: {values or '-'}"


# --- the command -------------------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """A point in time: a duration back from now (`90s`, `10m`, `2h`, `1d`) or an ISO 8601 time.

    A time without a zone is local time, as a person reads a clock.
    """
    duration = _DURATION.match(text.strip())
    if duration:
        back = timedelta(seconds=float(duration[1]) * _UNIT_S[duration[2]])
        return (now or datetime.now(UTC)) - back
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration (10m, 2h) nor a time (2026-12-01T10:00)"
        ) from None
    return moment.astimezone(UTC)


def subject_token(text: str) -> str:
    """An argparse type: a run or episode id (a valid subject token)."""
    try:
        return subjects.token(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def at_least_one(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def nats_url_option(parser: argparse.ArgumentParser) -> None:
    """`--nats-url`, defaulting to `HRL_NATS_URL`, else the local default."""
    default = os.environ.get("HRL_NATS_URL") or DEFAULT_NATS_URL
    parser.add_argument("--nats-url", default=default, help=f"the deployment's NATS (default {default})")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `harnessrl tail` to the `harnessrl` parser."""
    tail = subparsers.add_parser(
        "tail", help="follow the event stream: spans, lifecycle, rollouts, weights, metrics (Ctrl-C stops)"
    )
    tail.add_argument("--run", type=subject_token, default=None, help="only this run")
    tail.add_argument(
        "--episode",
        type=subject_token,
        default=None,
        help="only this episode (its spans, lifecycle, rollout)",
    )
    tail.add_argument(
        "--kind", action="append", choices=tuple(FEEDS), default=None, help="only these kinds (repeatable)"
    )
    start = tail.add_mutually_exclusive_group()
    start.add_argument(
        "--since", type=parse_since, default=None, metavar="WHEN", help="from 10m ago, or 2026-12-01T10:00"
    )
    start.add_argument("--all", dest="from_start", action="store_true", help="from the start of each stream")
    tail.add_argument("--json", action="store_true", help="one JSON object per message")
    tail.add_argument("--tokens", action="store_true", help="with --json: spans' token ids and logprobs too")
    tail.add_argument("--limit", type=at_least_one, default=None, metavar="N", help="stop after N messages")
    tail.add_argument(
        "--until-idle", type=float, default=None, metavar="S", help="stop after S seconds without a message"
    )
    nats_url_option(tail)
    tail.set_defaults(func=cmd_tail)


async def follow(
    url: str,
    selection: Selection,
    write: Callable[[Entry], None],
    *,
    limit: int | None = None,
    idle_s: float | None = None,
) -> int:
    """Tail the bus at `url`, writing every entry; returns how many were written."""
    await probe_nats(url, timeout_s=3.0)
    bus = NatsBus(url, name="harnessrl-tail")
    await bus.connect()
    tail = Tail(bus, selection)
    written = 0
    try:
        await tail.start()
        async for entry in tail.entries(limit=limit, idle_s=idle_s):
            write(entry)
            written += 1
    finally:
        await tail.stop()
        await bus.close()
    return written


def cmd_tail(args: argparse.Namespace) -> int:
    """Print the stream until Ctrl-C, `--limit` or `--until-idle`."""
    selection = Selection(
        kinds=tuple(dict.fromkeys(args.kind or FEEDS)), run=args.run, episode=args.episode,
        since=args.since, from_start=args.from_start,
    )  # fmt: skip
    if not selection.feeds():
        sys.stderr.write("error: with --episode only span, lifecycle and rollout messages can be tailed\n")
        return 2
    write = json_writer(tokens=args.tokens) if args.json else human_writer()
    try:
        asyncio.run(follow(args.nats_url, selection, write, limit=args.limit, idle_s=args.until_idle))
    except KeyboardInterrupt:
        return 0
    except (TailError, BusError, NatsUnreachable) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0

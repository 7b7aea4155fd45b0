"""The export: a durable consumer on SPANS feeding the exporter until stopped or idle."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import aiohttp
import nats.errors
import nats.js.errors

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.bus.base import ConsumerSpec
from harnessrl.shared.log import get_logger
from harnessrl.shared.metrics_export import exported
from harnessrl.shared.net import probe_nats
from harnessrl.stack.otlp.options import OtlpError, OtlpOptions
from harnessrl.stack.otlp.sending import ExportCounts, OtlpMetrics, PromptText, SpanExporter

log = get_logger(__name__)


async def export_spans(
    options: OtlpOptions, stop: asyncio.Event | None = None, metrics: OtlpMetrics | None = None
) -> ExportCounts:
    """Export spans until `stop` (with `until_idle_s`, until all are exported); what it did."""
    stop = stop or asyncio.Event()
    metrics = metrics or OtlpMetrics()
    await probe_nats(options.nats_url, timeout_s=3.0)
    bus = NatsBus(options.nats_url, name="harnessrl-otlp")
    await bus.connect()
    try:
        await bus.ensure_streams([subjects.SPANS, subjects.DLQ, subjects.METRICS])
        await _check_consumer(bus, options)
        async with (
            aiohttp.ClientSession() as session,
            exported(bus, metrics.registry, service="otlp", settings=options, run=options.run or ""),
        ):
            prompts = None if options.tokenizer is None else PromptText(bus, options.tokenizer)
            exporter = SpanExporter(session, options, metrics, prompts)
            spec = ConsumerSpec(
                stream=subjects.SPANS.name, filter_subject=options.filter_subject, durable=options.durable,
                deliver="all", max_deliver=-1, ack_wait_s=options.ack_wait_s, batch=1,
            )  # fmt: skip
            log.info("otlp.exporting", consumer=options.durable, filter=options.filter_subject,
                     endpoint=options.traces_url)  # fmt: skip
            subscription = await bus.subscribe(spec, exporter)
            try:
                await _until_done(bus, options, exporter, stop)
            finally:
                await subscription.stop()
    finally:
        await bus.close()
    return counts(metrics)


def counts(metrics: OtlpMetrics) -> ExportCounts:
    """The metrics' totals (every label summed)."""

    def total(name: str) -> int:
        return int(sum(s.value for f in metrics.registry.collect() for s in f.samples if s.name == name))

    return ExportCounts(
        exported=total("harnessrl_otlp_spans_exported_total"),
        failures=total("harnessrl_otlp_export_failures_total"),
        refused=total("harnessrl_otlp_spans_refused_total"),
    )


async def _check_consumer(bus: NatsBus, options: OtlpOptions) -> None:
    """A consumer that exists must export the same spans, and waits for acks as long as this run needs.

    Binding to an existing durable consumer keeps its configuration, so a changed filter is refused
    (a changed ack wait, from other `--timeout-s` or `--max-backoff-s`, is updated on the server
    by the bus when it binds).
    """
    try:
        info = await bus.js.consumer_info(subjects.SPANS.name, options.durable)
    except nats.js.errors.NotFoundError:
        return
    if info.config.filter_subject != options.filter_subject:
        raise OtlpError(
            f"consumer {options.durable} exports {info.config.filter_subject}, not "
            f"{options.filter_subject}: choose another --consumer"
        )


async def _until_done(
    bus: NatsBus, options: OtlpOptions, exporter: SpanExporter, stop: asyncio.Event
) -> None:
    """Wait for `stop`; with `until_idle_s`, until nothing is left to send and nothing came for that long."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)
        if options.until_idle_s is None or stop.is_set():
            continue
        if time.monotonic() - exporter.last_activity < options.until_idle_s:
            continue
        try:
            info = await bus.js.consumer_info(subjects.SPANS.name, options.durable)
        except (nats.errors.Error, OSError) as exc:
            log.warning("otlp.consumer_info_failed", error=repr(exc))
            continue
        if not info.num_pending and not info.num_ack_pending:
            return


def run_export(options: OtlpOptions) -> ExportCounts:
    """Run `export_spans` in a new event loop; SIGINT and SIGTERM stop it after the span in hand."""

    async def main() -> ExportCounts:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await export_spans(options, stop)

    return asyncio.run(main())

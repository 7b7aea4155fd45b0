"""`make bench-bus`: acked, batched span publishing and consuming through our bus client.

It runs against raw nats-py `publish_async` of the same payloads in the same run, on a real nats-server.

Last stdout line: {"spans_per_s", "raw_nats_per_s", "ratio", "consumed_per_s", "lost", ...}.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from rich.progress import Progress

from harnessrl.shared import subjects
from harnessrl.shared.bus import ConsumerSpec, Delivery, NatsBus, Outgoing
from harnessrl.shared.contracts import Completion, Span, Usage, encode
from harnessrl.stack.natsserver import NatsServer

SPANS = int(os.environ.get("HRL_BENCH_SPANS", "20000"))
BATCH = 500


def make_span(run: str, i: int) -> Span:
    """A realistic span of about 2 KB: a chat request, ~200 prompt ids, ~100 sampled ids."""
    return Span(
        span_id=f"span-{run}-{i}",
        run=run,
        episode=f"ep-{i // 20}",
        seq=i % 20,
        api="chat",
        model="policy",
        request={"messages": [{"role": "user", "content": "What is 12*34? " * 8}], "temperature": 1.0},
        parent_span=f"span-{run}-{i - 1}" if i % 20 else None,
        prefix_len=180 if i % 20 else 0,
        prompt_suffix_ids=list(range(1000, 1200)),
        prompt_len=380,
        completions=[Completion(token_ids=list(range(100)), logprobs=[-0.5] * 100, finish_reason="stop")],
        weight_version_start=3,
        weight_version_end=3,
        upstream="http://127.0.0.1:8000",
        usage=Usage(prompt_tokens=380, completion_tokens=100),
    )


async def _publish_ours(bus: NatsBus, run: str, progress: Progress) -> float:
    task = progress.add_task("harnessrl bus publish_batch", total=SPANS)
    spans = [make_span(run, i) for i in range(SPANS)]
    start = time.perf_counter()
    for lo in range(0, SPANS, BATCH):
        items = [
            Outgoing(subject=subjects.span(run, s.episode), message=s, msg_id=s.span_id)
            for s in spans[lo : lo + BATCH]
        ]
        await bus.publish_batch(items)
        progress.advance(task, len(items))
    return SPANS / (time.perf_counter() - start)


async def _publish_raw(bus: NatsBus, run: str, progress: Progress) -> float:
    task = progress.add_task("raw nats-py publish_async", total=SPANS)
    payloads = [(subjects.span(run, s.episode), encode(s)) for s in (make_span(run, i) for i in range(SPANS))]
    js = bus.js
    start = time.perf_counter()
    for lo in range(0, SPANS, BATCH):
        futures = [await js.publish_async(subj, data) for subj, data in payloads[lo : lo + BATCH]]
        await asyncio.gather(*futures)
        progress.advance(task, BATCH)
    return SPANS / (time.perf_counter() - start)


async def _consume(bus: NatsBus, run: str, progress: Progress) -> tuple[float, int]:
    task = progress.add_task("consume", total=SPANS)
    seen: set[str] = set()
    done = asyncio.Event()

    async def handler(delivery: Delivery) -> None:
        seen.add(delivery.msg_id or "")
        progress.advance(task)
        if len(seen) >= SPANS:
            done.set()

    start = time.perf_counter()
    spec = ConsumerSpec(
        stream=subjects.SPANS.name, filter_subject=subjects.spans_of_run(run), durable="bench", batch=256
    )
    sub = await bus.subscribe(spec, handler)
    await asyncio.wait_for(done.wait(), timeout=300)
    elapsed = time.perf_counter() - start
    await sub.stop()
    return SPANS / elapsed, SPANS - len(seen)


async def _run_bench() -> dict[str, float | int]:
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp))
        server.start()
        try:
            bus = NatsBus(server.url)
            await bus.connect()
            await bus.ensure_streams()
            with Progress() as progress:
                ours = await _publish_ours(bus, "bench-ours", progress)
                raw = await _publish_raw(bus, "bench-raw", progress)
                consumed, lost = await _consume(bus, "bench-ours", progress)
            await bus.close()
        finally:
            server.stop()
    return {
        "spans": SPANS,
        "span_bytes": len(encode(make_span("bench-ours", 1))),
        "spans_per_s": round(ours, 1),
        "raw_nats_per_s": round(raw, 1),
        "ratio": round(ours / raw, 3),
        "consumed_per_s": round(consumed, 1),
        "lost": lost,
    }


def main() -> None:
    """Run the benchmark and print the JSON result as the last line."""
    print(json.dumps(asyncio.run(_run_bench())))  # noqa: T201 - the benchmark's output contract

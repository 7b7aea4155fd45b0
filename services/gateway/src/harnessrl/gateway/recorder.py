"""Span building and publishing: one span per sampled call, acknowledged before the answer ends.

The prompt is delta-encoded against the episode's previous span (`harnessrl.shared.tokens`). A
span becomes the parent of the next call only after JetStream acknowledged it, so a delta never
refers to a span that isn't stored. A publish that can't be acknowledged within
`span_publish_timeout_s` raises `Unavailable`: the client gets 503 instead of an unrecorded answer.
"""

from __future__ import annotations

import time
from typing import Any

from harnessrl.gateway.capture import Capture
from harnessrl.gateway.episodes import EpisodeCalls
from harnessrl.gateway.errors import Unavailable
from harnessrl.gateway.metrics import GatewayMetrics
from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus
from harnessrl.shared.contracts import ApiKind, Span, SpanStatus
from harnessrl.shared.log import get_logger
from harnessrl.shared.tokens import prompt_delta

log = get_logger(__name__)

# Conversation fields are stored as token ids (delta-encoded); the span keeps only parameters.
_CONVERSATION_FIELDS = frozenset({"messages", "prompt", "input", "system", "tools", "instructions"})


class CallRecord:
    """Who made a call and when: everything a span needs besides the capture."""

    __slots__ = (
        "api",
        "episode",
        "model",
        "params",
        "run",
        "span_id",
        "started_at",
        "started_mono",
        "stream",
        "ttft_s",
        "upstream",
        "weight_version_start",
    )

    def __init__(self, *, run: str, episode: str, api: ApiKind, span_id: str) -> None:
        self.run = run
        self.episode = episode
        self.api: ApiKind = api
        self.span_id = span_id
        self.started_at = time.time()
        self.started_mono = time.perf_counter()
        self.stream = False
        self.model = ""
        self.upstream = ""
        self.params: dict[str, Any] = {}
        self.ttft_s: float | None = None
        self.weight_version_start = 0


def request_params(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request without its conversation (which the token ids carry)."""
    return {k: v for k, v in body.items() if k not in _CONVERSATION_FIELDS}


class SpanRecorder:
    """Publishes spans to SPANS with bounded retries."""

    def __init__(self, bus: Bus, metrics: GatewayMetrics, *, timeout_s: float) -> None:
        self.bus = bus
        self.metrics = metrics
        self.timeout_s = timeout_s

    def build(
        self,
        call: CallRecord,
        calls: EpisodeCalls,
        capture: Capture,
        *,
        status: SpanStatus,
        weight_version_end: int,
        error: str | None = None,
    ) -> Span:
        """Assign the next seq and delta-encode the prompt against the episode's last span."""
        prompt = capture.prompt_ids
        parent: str | None = None
        prefix_len, suffix = 0, prompt or []
        if prompt is not None and calls.last_context is not None:
            prefix_len, suffix = prompt_delta(calls.last_context, prompt)
            parent = calls.last_span if prefix_len else None
        return Span(
            span_id=call.span_id,
            run=call.run,
            episode=call.episode,
            seq=calls.take_seq(),
            api=call.api,
            stream=call.stream,
            status=status,
            model=capture.model or call.model,
            request=call.params,
            parent_span=parent,
            prefix_len=prefix_len,
            prompt_suffix_ids=suffix,
            prompt_len=len(prompt or []),
            completions=capture.completions(),
            weight_version_start=call.weight_version_start,
            weight_version_end=weight_version_end,
            upstream=call.upstream,
            started_at=call.started_at,
            latency_s=time.perf_counter() - call.started_mono,
            ttft_s=call.ttft_s,
            usage=capture.usage,
            error=error,
        )

    async def publish(self, span: Span, calls: EpisodeCalls, capture: Capture) -> None:
        """Publish and await the ack; then the span is the parent of the episode's next call."""
        started = time.perf_counter()
        subject = subjects.span(span.run, span.episode)
        try:
            await self.bus.publish(subject, span, msg_id=span.span_id, budget_s=self.timeout_s)
        except Exception as exc:
            self.metrics.publish_failures.inc()
            log.error("span.publish_failed", span=span.span_id, error=repr(exc))
            raise Unavailable("the span store is unavailable", retry_after=2.0) from exc
        self.metrics.publish_latency.observe(time.perf_counter() - started)
        context = capture.context_ids()
        if span.status == "ok" and context is not None:
            calls.advance(span.span_id, context)

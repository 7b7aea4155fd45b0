"""Span building and publishing: one span per sampled call, acknowledged before the answer ends.

A span is appended to its episode's subject on the condition that the subject did not move on since
this replica last saw it (`EpisodeSpans`): its `seq` and its delta parent are chosen from what is
stored, and a span numbered from a stale view is refused, never stored. The loser of such a race
reads what beat it and tries again, so every sampled call leaves exactly one span and an episode's
spans are numbered 0..n-1 whichever replicas served them, in whatever order. A seq is taken only by
the stored span itself: a call that fails, upstream or at the bus, leaves no gap. A publish that
can't be acknowledged within `span_publish_timeout_s` raises `Unavailable`: the client gets 503
instead of an unrecorded answer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from harnessrl.gateway.capture import Capture
from harnessrl.gateway.conversation import TokenInCall
from harnessrl.gateway.episode_spans import EpisodeSpans
from harnessrl.gateway.errors import Unavailable
from harnessrl.gateway.metrics import GatewayMetrics
from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Bus, LastSequenceMismatchError
from harnessrl.shared.contracts import ApiKind, Span, SpanStatus
from harnessrl.shared.log import get_logger

log = get_logger(__name__)

# Conversation fields are stored as token ids (delta-encoded); the span keeps only parameters.
_CONVERSATION_FIELDS = frozenset({"messages", "prompt", "input", "system", "tools", "instructions"})
# After a lost race that taught nothing new (the winner not readable yet), wait this long.
_RETRY_PAUSE_S = 0.01


class CallRecord:
    """Who made a call and when: everything a span needs besides the capture."""

    __slots__ = (
        "api",
        "client",
        "episode",
        "model",
        "params",
        "run",
        "span_id",
        "started_at",
        "started_mono",
        "stream",
        "token_in",
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
        self.token_in: TokenInCall | None = None  # set when the call went token-in
        self.client = ""  # the caller's User-Agent


def request_params(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request without its conversation (which the token ids carry)."""
    return {k: v for k, v in body.items() if k not in _CONVERSATION_FIELDS}


class SpanRecorder:
    """Appends spans to their episode's subject: numbered, delta-encoded, acknowledged."""

    def __init__(self, bus: Bus, metrics: GatewayMetrics, *, timeout_s: float) -> None:
        self.bus = bus
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def record(
        self,
        call: CallRecord,
        spans: EpisodeSpans,
        capture: Capture,
        *,
        status: SpanStatus,
        weight_version_end: int,
        error: str | None = None,
    ) -> Span:
        """Store the call's span as the episode's next one; the span as stored, once acknowledged."""
        draft = _draft(call, capture, status=status, weight_version_end=weight_version_end, error=error)
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            async with asyncio.timeout_at(deadline), spans.lock:
                span = await self._append(draft, capture.prompt_ids, spans, deadline)
        except Exception as exc:
            self.metrics.publish_failures.inc()
            log.error("span.publish_failed", span=draft.span_id, error=repr(exc))
            raise Unavailable("the span store is unavailable", retry_after=2.0) from exc
        self.metrics.publish_latency.observe(time.perf_counter() - started)
        return span

    async def _append(
        self, draft: Span, prompt: list[int] | None, spans: EpisodeSpans, deadline: float
    ) -> Span:
        subject = subjects.span(draft.run, draft.episode)
        loop = asyncio.get_running_loop()
        while True:
            span = spans.next_span(draft, prompt)
            try:
                ack = await self.bus.publish(
                    subject, span, msg_id=span.span_id, budget_s=max(deadline - loop.time(), 0.01),
                    expect=spans.expected,
                )  # fmt: skip
            except LastSequenceMismatchError as lost:
                self.metrics.seq_conflicts.inc()
                stored = await self._catch_up(spans, lost, span.span_id)
                if stored is not None:
                    return stored
                continue
            spans.appended(span, ack.seq, prompt)
            return span

    async def _catch_up(
        self, spans: EpisodeSpans, lost: LastSequenceMismatchError, span_id: str
    ) -> Span | None:
        """Bring `spans` level with the subject; the span as stored if a lost-ack attempt stored it."""
        known = spans.last_stream_seq
        stored = lost.newer
        if not (lost.complete and spans.learn(stored)):
            stored = await self.bus.replay(subjects.SPANS.name, lost.subject)
            spans.rebuild(stored)
        for delivery in stored:
            if delivery.msg_id == span_id:
                return delivery.decode(Span)
        if spans.last_stream_seq == known:
            await asyncio.sleep(_RETRY_PAUSE_S)
        return None


def _draft(
    call: CallRecord, capture: Capture, *, status: SpanStatus, weight_version_end: int, error: str | None
) -> Span:
    """The call's span before it is numbered and its prompt encoded (`EpisodeSpans.next_span`)."""
    prompt = capture.prompt_ids
    return Span(
        span_id=call.span_id,
        run=call.run,
        episode=call.episode,
        seq=-1,
        api=call.api,
        stream=call.stream,
        status=status,
        model=capture.model or call.model,
        request=call.params,
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
        token_in=call.token_in.case if call.token_in is not None else None,
        history_digest=call.token_in.history_digest() if call.token_in is not None and status == "ok" else "",
        client=call.client,
    )

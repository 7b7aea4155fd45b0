"""Sending one span per request: metrics, backoff, prompt text, the exporter."""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import msgspec
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceResponse,
)
from prometheus_client import CollectorRegistry, Counter, Histogram

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, PermanentError, TransientError
from harnessrl.shared.bus.base import Delivery
from harnessrl.shared.contracts import ContractError, Span
from harnessrl.shared.log import get_logger
from harnessrl.shared.tokens import TokenDeltaError, decode_prompt, reconstruct_prompts, span_context
from harnessrl.stack.otlp.options import PROTOBUF, RETRYABLE, Attributes, OtlpError, OtlpOptions
from harnessrl.stack.otlp.spans import content_attributes, export_request

log = get_logger(__name__)


class OtlpMetrics:
    """Spans exported, failed attempts (retried) and refused spans (dead-lettered), by reason."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.exported = Counter(
            "harnessrl_otlp_spans_exported",
            "Spans the OTLP backend accepted (2xx, nothing rejected).",
            registry=self.registry,
        )
        self.failures = Counter(
            "harnessrl_otlp_export_failures",
            "Export attempts that failed and will be retried, by reason (unreachable, timeout, http_503).",
            ["reason"],
            registry=self.registry,
        )
        self.refused = Counter(
            "harnessrl_otlp_spans_refused",
            "Spans never exported (dead-lettered), by reason (http_400, rejected, undecodable).",
            ["reason"],
            registry=self.registry,
        )
        self.content_unavailable = Counter(
            "harnessrl_otlp_prompt_text_unavailable",
            "Spans sent without their prompt's text: the episode's earlier spans could not rebuild it.",
            registry=self.registry,
        )
        self.duration = Histogram(
            "harnessrl_otlp_export_duration_seconds",
            "Time of one export request, answered or not.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30),
            registry=self.registry,
        )


class ExportCounts(msgspec.Struct, frozen=True, kw_only=True):
    """What one `export_spans` did: spans accepted, attempts retried, spans refused."""

    exported: int
    failures: int
    refused: int


class Backoff:
    """One gate for every attempt: after a failure, the next waits, twice as long each time in a row."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s, self.max_s = first_s, max_s
        self.failures = 0
        self._ready_at = 0.0

    async def wait(self) -> None:
        """Wait until the next attempt is due."""
        delay = self._ready_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    def failed(self, retry_after_s: float | None) -> float:
        """Note a failure; returns the delay before the next attempt (`Retry-After` when longer)."""
        self.failures += 1
        delay: float = min(self.first_s * 2.0 ** (self.failures - 1), self.max_s)
        if retry_after_s is not None:
            delay = min(max(delay, retry_after_s), self.max_s)
        self._ready_at = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        """The backend answered: the next attempt goes at once."""
        self.failures, self._ready_at = 0, 0.0


class PromptText:
    """Each span's full prompt as text: its token ids rebuilt from its parent's context, decoded.

    Contexts (prompt + first completion) of recent spans are kept; a span whose parent's context is
    not (the first span seen of an episode after a restart) has its episode's stored spans replayed.
    """

    def __init__(self, bus: Bus, tokenizer: Path, *, keep: int = 256) -> None:
        self.bus, self.keep = bus, keep
        self.tokenizer = load_tokenizer(tokenizer)
        self._contexts: OrderedDict[str, array[int]] = OrderedDict()

    async def text(self, span: Span) -> str:
        """The prompt the model saw for `span`; `TokenDeltaError` when it cannot be rebuilt."""
        prompt = await self._prompt_ids(span)
        self._remember(span, prompt)
        return str(self.tokenizer.decode(prompt, skip_special_tokens=False))

    async def _prompt_ids(self, span: Span) -> list[int]:
        if span.parent_span is None:
            return decode_prompt(span, None)
        context = self._contexts.get(span.parent_span)
        if context is not None:
            return decode_prompt(span, context)
        deliveries = await self.bus.replay(subjects.SPANS.name, subjects.span(span.run, span.episode))
        stored = [delivery.decode(Span) for delivery in deliveries]
        prompts = reconstruct_prompts([s for s in stored if s.span_id != span.span_id] + [span])
        for earlier in stored:
            if earlier.span_id in prompts and earlier.span_id != span.span_id:
                self._remember(earlier, prompts[earlier.span_id])
        return prompts[span.span_id]

    def _remember(self, span: Span, prompt: list[int]) -> None:
        self._contexts[span.span_id] = array("q", span_context(prompt, span))
        self._contexts.move_to_end(span.span_id)
        while len(self._contexts) > self.keep:
            self._contexts.popitem(last=False)


def load_tokenizer(path: Path) -> Any:
    """A `tokenizers` tokenizer from a model folder (its `tokenizer.json`) or the file itself."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise OtlpError(f"--tokenizer: no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


class SpanExporter:
    """The SPANS handler: one span, one POST; returning means the backend accepted it."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        options: OtlpOptions,
        metrics: OtlpMetrics,
        prompts: PromptText | None = None,
    ) -> None:
        self.session, self.options, self.metrics, self.prompts = session, options, metrics, prompts
        self.backoff = Backoff(options.first_backoff_s, options.max_backoff_s)
        self.last_activity = time.monotonic()

    async def __call__(self, delivery: Delivery) -> None:
        """Export one delivered span (the bus acks on return, naks on `TransientError`)."""
        self.last_activity = time.monotonic()
        try:
            span = delivery.decode(Span)
        except ContractError as exc:
            self._refuse(delivery, "undecodable", str(exc))
        content = await self._content(span) if self.options.include_content else None
        body = export_request(
            span, stream_seq=delivery.stream_seq, service_name=self.options.service_name, content=content
        )
        await self.backoff.wait()
        started = time.perf_counter()
        try:
            status, retry_after, answer = await self._post(body)
        except TimeoutError:
            self._retry(delivery, "timeout", f"no answer within {self.options.timeout_s}s", None)
        except (aiohttp.ClientError, OSError) as exc:
            self._retry(delivery, "unreachable", repr(exc), None)
        finally:
            self.metrics.duration.observe(time.perf_counter() - started)
            self.last_activity = time.monotonic()
        self._settle(delivery, status, retry_after, answer)

    async def _content(self, span: Span) -> Attributes:
        """The span's content attributes; without its prompt's text when that can't be had (counted)."""
        if self.prompts is None:
            return content_attributes(span, None)
        try:
            text = await self.prompts.text(span)
        except (TokenDeltaError, ContractError) as exc:
            self.metrics.content_unavailable.inc()
            log.warning("otlp.prompt_unavailable", span=span.span_id, error=str(exc))
            text = None
        return content_attributes(span, text)

    async def _post(self, body: bytes) -> tuple[int, float | None, bytes]:
        headers = {**self.options.headers, "Content-Type": PROTOBUF}
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s)
        async with self.session.post(
            self.options.traces_url, data=body, headers=headers, timeout=timeout
        ) as response:
            return response.status, _retry_after(response.headers.get("Retry-After")), await response.read()

    def _settle(self, delivery: Delivery, status: int, retry_after: float | None, answer: bytes) -> None:
        """Classify the backend's answer: accepted returns; retryable and refused raise."""
        if status in RETRYABLE:
            self._retry(delivery, f"http_{status}", _said(answer), retry_after)
        self.backoff.succeeded()
        if not 200 <= status < 300:
            self._refuse(delivery, f"http_{status}", _said(answer))
        rejected, message = _rejected(answer)
        if rejected:
            self._refuse(delivery, "rejected", message)
        self.metrics.exported.inc()

    def _retry(self, delivery: Delivery, reason: str, detail: str, retry_after: float | None) -> NoReturn:
        delay = self.backoff.failed(retry_after)
        self.metrics.failures.labels(reason).inc()
        log.warning(
            "otlp.export_failed", subject=delivery.subject, seq=delivery.stream_seq, reason=reason,
            detail=detail[:300], retry_in_s=round(delay, 2), attempt=delivery.num_delivered,
        )  # fmt: skip
        raise TransientError(f"{reason}: {detail[:300]}", delay=0.0)

    def _refuse(self, delivery: Delivery, reason: str, detail: str) -> NoReturn:
        self.backoff.succeeded()
        self.metrics.refused.labels(reason).inc()
        log.error("otlp.span_refused", subject=delivery.subject, seq=delivery.stream_seq, reason=reason,
                  detail=detail[:300])  # fmt: skip
        raise PermanentError(f"OTLP export refused ({reason}): {detail[:300]}")


def _retry_after(header: str | None) -> float | None:
    """A `Retry-After` of seconds (an HTTP date is ignored: the backoff applies)."""
    try:
        return max(float(header), 0.0) if header else None
    except ValueError:
        return None


def _said(answer: bytes) -> str:
    """A refusal's body for the log (OTLP sends a `google.rpc.Status`; its text shows through)."""
    return answer[:300].decode("utf-8", "replace")


def _rejected(answer: bytes) -> tuple[int, str]:
    """Spans a 2xx answer rejected (`partial_success`), with the backend's reason."""
    response = ExportTraceServiceResponse()
    try:
        response.ParseFromString(answer)
    except DecodeError:
        return 0, ""  # A 2xx without a protobuf body (some proxies): nothing reported rejected.
    return response.partial_success.rejected_spans, response.partial_success.error_message

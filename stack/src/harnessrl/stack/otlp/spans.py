"""A gateway span as an OTLP span: GenAI attributes, RL attributes, contents when asked."""

from __future__ import annotations

import hashlib
import json
import urllib.parse
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

from harnessrl.shared.contracts import Span
from harnessrl.stack.otlp.options import OPERATION, PROVIDER, REQUEST_ATTRIBUTES, SCOPE, Attributes


def trace_id(run: str, episode: str) -> bytes:
    """The 16-byte trace id of an episode: the same on every export."""
    return hashlib.sha256(f"harnessrl-trace\0{run}\0{episode}".encode()).digest()[:16]


def span_id(run: str, episode: str, gateway_span_id: str) -> bytes:
    """The 8-byte OTLP span id of a gateway span."""
    return hashlib.sha256(f"harnessrl-span\0{run}\0{episode}\0{gateway_span_id}".encode()).digest()[:8]


def any_value(value: str | bool | int | float | Sequence[str] | Sequence[int]) -> AnyValue:
    """An attribute value as OTLP carries it."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    return AnyValue(array_value=ArrayValue(values=[any_value(item) for item in value]))


def key_values(attributes: Mapping[str, Any]) -> list[KeyValue]:
    """Attributes as OTLP key-values, in a stable order."""
    return [KeyValue(key=key, value=any_value(attributes[key])) for key in sorted(attributes)]


def genai_attributes(span: Span) -> Attributes:
    """The GenAI semantic-convention attributes of one call."""
    model = span.request.get("model")
    out_tokens = span.usage.completion_tokens or sum(len(c.token_ids) for c in span.completions)
    attributes: Attributes = {
        "gen_ai.operation.name": OPERATION[span.api],
        "gen_ai.provider.name": PROVIDER[span.api],
        "gen_ai.system": PROVIDER[span.api],
        "gen_ai.request.model": model if isinstance(model, str) and model else span.model,
        "gen_ai.response.model": span.model,
        "gen_ai.conversation.id": span.episode,
        "gen_ai.usage.input_tokens": span.usage.prompt_tokens or span.prompt_len,
        "gen_ai.usage.output_tokens": out_tokens,
        "gen_ai.request.stream": span.stream,
    }
    reasons = [c.finish_reason for c in span.completions if c.finish_reason]
    if reasons:
        attributes["gen_ai.response.finish_reasons"] = reasons
    if span.ttft_s is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = span.ttft_s
    attributes.update(request_attributes(span.request))
    attributes.update(server_attributes(span.upstream))
    return attributes


def request_attributes(request: Mapping[str, Any]) -> Attributes:
    """The request parameters the conventions name, when the call set them."""
    attributes: Attributes = {}
    for field, name in REQUEST_ATTRIBUTES.items():
        value = request.get(field)
        if isinstance(value, str) and name == "gen_ai.request.stop_sequences":
            value = [value]
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float | str) or (
            isinstance(value, list) and value and all(isinstance(v, str) for v in value)
        ):
            attributes[name] = value
    return attributes


def server_attributes(upstream: str) -> Attributes:
    """`server.address` and `server.port` of the replica that served the call."""
    url = urllib.parse.urlsplit(upstream)
    if not url.hostname:
        return {}
    attributes: Attributes = {"server.address": url.hostname}
    if url.port:
        attributes["server.port"] = url.port
    return attributes


def rl_attributes(span: Span, stream_seq: int) -> Attributes:
    """The RL facts of the call, in our own namespace."""
    attributes: Attributes = {
        "harnessrl.run_id": span.run,
        "harnessrl.episode_id": span.episode,
        "harnessrl.span_id": span.span_id,
        "harnessrl.span_seq": span.seq,
        "harnessrl.api": span.api,
        "harnessrl.status": span.status,
        "harnessrl.policy_version": span.weight_version_start,
        "harnessrl.policy_version_end": span.weight_version_end,
        "harnessrl.prompt_len": span.prompt_len,
        "harnessrl.prefix_len": span.prefix_len,
        "harnessrl.completion_count": len(span.completions),
        "harnessrl.stream_seq": stream_seq,
    }
    if span.parent_span is not None:
        attributes["harnessrl.parent_span_id"] = span.parent_span
    if span.token_in is not None:
        attributes["harnessrl.token_in"] = span.token_in
    if span.client:
        attributes["user_agent.original"] = span.client
    return attributes


def content_attributes(span: Span, prompt_text: str | None) -> Attributes:
    """What was said (opt-in): GenAI input and output messages, and the token ids.

    The prompt is one user message holding the whole rendered prompt (chat template included):
    the tokens the model saw, decoded, since the roles went into the template before the gateway.
    """
    messages = [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": c.text}],
            "finish_reason": c.finish_reason,
        }
        for c in span.completions
    ]
    attributes: Attributes = {
        "gen_ai.output.messages": json.dumps(messages, ensure_ascii=False),
        "harnessrl.prompt.suffix_token_ids": span.prompt_suffix_ids,
    }
    if prompt_text is not None:
        prompt = [{"role": "user", "parts": [{"type": "text", "content": prompt_text}]}]
        attributes["gen_ai.input.messages"] = json.dumps(prompt, ensure_ascii=False)
    for index, completion in enumerate(span.completions):
        attributes[f"harnessrl.completion.{index}.token_ids"] = completion.token_ids
    return attributes


def otlp_span(span: Span, *, stream_seq: int, content: Attributes | None = None) -> OtlpSpan:
    """One gateway span as an OTLP CLIENT span of its episode's trace (`content` when opted in)."""
    attributes = {**genai_attributes(span), **rl_attributes(span, stream_seq), **(content or {})}
    status = Status(code=Status.STATUS_CODE_UNSET)
    if span.status != "ok":
        attributes["error.type"] = span.status
        status = Status(code=Status.STATUS_CODE_ERROR, message=span.error or span.status)
    start_ns = round(span.started_at * 1e9)
    links = []
    if span.parent_span is not None:
        parent = span_id(span.run, span.episode, span.parent_span)
        links.append(OtlpSpan.Link(trace_id=trace_id(span.run, span.episode), span_id=parent))
    return OtlpSpan(
        trace_id=trace_id(span.run, span.episode),
        span_id=span_id(span.run, span.episode, span.span_id),
        name=f"{attributes['gen_ai.operation.name']} {attributes['gen_ai.request.model']}".rstrip(),
        kind=OtlpSpan.SPAN_KIND_CLIENT,
        start_time_unix_nano=start_ns,
        end_time_unix_nano=start_ns + round(span.latency_s * 1e9),
        attributes=key_values(attributes),
        links=links,
        status=status,
    )


def export_request(
    span: Span, *, stream_seq: int, service_name: str, content: Attributes | None = None
) -> bytes:
    """The serialized `ExportTraceServiceRequest` carrying one span."""
    resource = Resource(
        attributes=key_values(
            {"service.name": service_name, "service.namespace": "harnessrl", "service.version": _VERSION}
        )
    )
    scope = InstrumentationScope(name=SCOPE, version=_VERSION)
    exported_span = otlp_span(span, stream_seq=stream_seq, content=content)
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(resource=resource, scope_spans=[ScopeSpans(scope=scope, spans=[exported_span])])
        ]
    )
    return bytes(request.SerializeToString())


def _package_version() -> str:
    try:
        return version("harnessrl-stack")
    except PackageNotFoundError:
        return "0"


_VERSION = _package_version()

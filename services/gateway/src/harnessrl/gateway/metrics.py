"""Prometheus metrics of one gateway (own registry, so several gateways can live in one process).

Labels are bounded: route and status code only, never episode or run ids.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PUBLISH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 10)


class GatewayMetrics:
    """The gateway's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "harnessrl_gateway_requests",
            "Requests answered, by route and HTTP status code.",
            ["route", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "harnessrl_gateway_request_duration_seconds",
            "Time from request to the end of the response, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "harnessrl_gateway_time_to_first_token_seconds",
            "Time from request to the first streamed event, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.publish_latency = Histogram(
            "harnessrl_gateway_span_publish_duration_seconds",
            "Time to publish one span and receive its JetStream ack.",
            buckets=_PUBLISH_BUCKETS,
            registry=self.registry,
        )
        self.publish_failures = Counter(
            "harnessrl_gateway_span_publish_failures",
            "Spans that could not be published in time (their calls were answered 503).",
            registry=self.registry,
        )
        self.seq_conflicts = Counter(
            "harnessrl_gateway_span_seq_conflicts",
            "Span appends that found their episode moved on (another replica stored a span first), "
            "then numbered again.",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "harnessrl_gateway_in_flight_requests",
            "LLM calls currently in flight.",
            registry=self.registry,
        )
        self.left_out = Counter(
            "harnessrl_gateway_request_parts_left_out",
            "Parts of requests not forwarded to vLLM (e.g. hosted tools a Responses call declares), "
            "by route and kind.",
            ["route", "part"],
            registry=self.registry,
        )
        self.token_in = Counter(
            "harnessrl_gateway_token_in_calls",
            "Calls of token-in runs, by how their prompt was built: extended (the sampled history "
            "spliced), fresh (nothing sampled before), branched (the client rewrote history), plain "
            "(sent as plain chat; reason: request = a forced tool choice, media or "
            "continue_final_message, api = not chat-shaped, no_render = the replica has no /tokenize).",
            ["case", "reason"],
            registry=self.registry,
        )
        self.upstream_retries = Counter(
            "harnessrl_gateway_upstream_retries",
            "Calls retried on another replica because the first could not be reached.",
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

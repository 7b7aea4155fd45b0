"""What `harnessrl otlp` is asked to do, and the GenAI names it maps to."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.contracts import ApiKind
from harnessrl.shared.net import DEFAULT_NATS_URL

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
SCOPE = "harnessrl.stack.otlp"
# The statuses after which OTLP/HTTP says to retry (the specification's "retryable" responses).
RETRYABLE = frozenset({429, 502, 503, 504})
# The GenAI operation of each API the gateway captures.
OPERATION: dict[ApiKind, str] = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "messages": "chat",
}
# The provider as the client sees it: the API it speaks (vLLM serves both; `server.address` says where).
PROVIDER: dict[ApiKind, str] = {
    "chat": "openai",
    "completions": "openai",
    "responses": "openai",
    "messages": "anthropic",
}
# Request parameters of the GenAI conventions, by every name the APIs give them.
REQUEST_ATTRIBUTES = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "max_output_tokens": "gen_ai.request.max_tokens",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "seed": "gen_ai.request.seed",
    "n": "gen_ai.request.choice.count",
    "stop": "gen_ai.request.stop_sequences",
    "stop_sequences": "gen_ai.request.stop_sequences",
}
Attributes = dict[str, str | bool | int | float | list[str] | list[int]]


class OtlpError(RuntimeError):
    """The export cannot start as asked; the message is meant for a person."""


class OtlpOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What `harnessrl otlp` was asked to do."""

    # The backend's OTLP/HTTP base URL (`http://collector:4318`); spans go to its `/v1/traces`.
    endpoint: str
    nats_url: str = DEFAULT_NATS_URL
    # Export only this run's spans; None exports every run's.
    run: str | None = None
    # The durable consumer holding the position (default `otlp-<run>`, or `otlp-all`).
    consumer: str | None = None
    service_name: str = "harnessrl"
    include_content: bool = False
    # With `include_content`: the policy's tokenizer (a model folder), to send the prompt as text.
    tokenizer: Path | None = None
    # Extra request headers (an API key of a hosted backend).
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    # One POST may take this long before it counts as failed.
    timeout_s: float = 10.0
    # Retries start this far apart and double up to `max_backoff_s`.
    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    # Stop once every span is exported and nothing new came for this long (None: until a signal).
    until_idle_s: float | None = None
    # `/metrics` (0: not served) and `ServiceMetrics` summaries on METRICS (0: none).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    metrics_interval_s: float = 0.0

    def __post_init__(self) -> None:
        """Reject what no export could use, naming the flag."""
        url = urllib.parse.urlsplit(self.endpoint)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise OtlpError(f"--endpoint: {self.endpoint!r} is no http(s)://host:port URL")
        if self.tokenizer is not None and not self.include_content:
            raise OtlpError("--tokenizer only serves --include-content")
        if self.run is not None:
            _checked_token("--run", self.run)
        if self.consumer is not None:
            _checked_token("--consumer", self.consumer)
        positive = (self.timeout_s, self.first_backoff_s, self.max_backoff_s, self.until_idle_s or 1.0)
        if min(positive) <= 0:
            raise OtlpError("--timeout-s, backoffs and --until-idle must be above zero")

    @property
    def traces_url(self) -> str:
        """Where requests go: the endpoint's `/v1/traces` (kept when the endpoint already names it)."""
        base = self.endpoint.rstrip("/")
        return base if base.endswith(TRACES_PATH) else base + TRACES_PATH

    @property
    def durable(self) -> str:
        """The durable consumer's name."""
        return self.consumer or f"otlp-{self.run or 'all'}"

    @property
    def filter_subject(self) -> str:
        """The SPANS subjects exported."""
        return subjects.SPANS.subjects[0] if self.run is None else subjects.spans_of_run(self.run)

    @property
    def ack_wait_s(self) -> float:
        """Longer than a wait at the backoff gate plus a POST, so a span in hand is never redelivered."""
        return self.max_backoff_s + self.timeout_s + 5.0


def _checked_token(flag: str, value: str) -> None:
    try:
        subjects.token(value)
    except ValueError as exc:
        raise OtlpError(f"{flag}: {exc}") from exc

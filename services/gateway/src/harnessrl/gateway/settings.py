"""The gateway's settings: one Struct, every default documented, read from TOML and `HRL_GATEWAY_*`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from harnessrl.shared.net import DEFAULT_NATS_URL, VLLM_CLIENT_KEEPALIVE_S, VLLM_TOOL_CALL_PARSER
from harnessrl.shared.settings import SettingsError, load_settings

ENV_PREFIX = "HRL_GATEWAY_"


class GatewaySettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the gateway listens, authenticates, routes and records."""

    host: str = "127.0.0.1"
    port: int = 8300
    # HMAC secret shared with the controller, which signs each episode's key with it.
    key_secret: str = ""
    # Bearer token of the admin routes (pause/resume/upstreams/status); empty disables them.
    admin_token: str = ""
    nats_url: str = DEFAULT_NATS_URL
    # vLLM replicas known at start; more arrive as UpstreamRegistration messages on the bus.
    upstreams: list[str] = msgspec.field(default_factory=list)
    # The policy's served model name; every request's `model` is set to it ("" keeps the client's).
    served_model: str = ""
    # Sampling parameters forced on every LLM call; a run's own (`sampling` in its spec) win over them.
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)
    # Token-in mode for episodes whose run doesn't say (RunSpec `token_in`): chat, Messages and
    # Responses calls are sent as the episode's exact token history (README "Token-in mode"). On:
    # `make bench-merge` measured one training row per rollout for 100% of episodes (38% plain).
    token_in: bool = True
    # How token-in mode reads tool calls and reasoning out of sampled text: vLLM's own parser names,
    # which must be what the replicas run with (`--tool-call-parser`, `--reasoning-parser`) so both
    # modes answer alike. Empty `reasoning_parser`: no reasoning split, as vLLM without the flag.
    tool_parser: str = VLLM_TOOL_CALL_PARSER
    reasoning_parser: str = ""
    # Bigger request bodies get 413 (agents send long contexts; 16 MiB is far above any window).
    max_body_bytes: int = 16 * 1024 * 1024
    max_artifact_bytes: int = 16 * 1024 * 1024
    # At most this many calls in flight per replica; more wait for a slot (vLLM batches them anyway).
    max_in_flight_per_upstream: int = 512
    connect_timeout_s: float = 5.0
    # An idle connection to a replica is not reused after this long; below the replica's own
    # keep-alive, else a call can go out on a connection the replica is closing, fail (502) and,
    # three at once, take the replica off the ring (seen in `make demo`).
    upstream_keepalive_s: float = VLLM_CLIENT_KEEPALIVE_S
    # A sampling call can legitimately run for minutes; this bounds a stuck upstream.
    read_timeout_s: float = 600.0
    # A replica that fails this many calls in a row leaves the ring until a health check passes.
    unhealthy_after_failures: int = 3
    health_interval_s: float = 5.0
    # While paused (weight update) new calls wait this long, then get 503 with Retry-After.
    pause_wait_s: float = 30.0
    # How long a span publish may keep retrying before the call is answered 503.
    span_publish_timeout_s: float = 10.0
    # Episodes one replica holds (whether closed, their newest spans' contexts), least recently used
    # evicted: this bounds its memory; an evicted episode is looked up on the bus again when it
    # comes back. Nothing correctness depends on lives only here (replicas share the bus).
    episode_cache_size: int = 4096
    access_log: bool = True
    # Seconds between two summaries of this gateway's metrics on METRICS (0: none); `/metrics` is
    # served on the gateway's own port either way.
    metrics_interval_s: float = 60.0
    # Logs: JSON lines for collectors, or "console" (key-value) for a person; stdlib level names.
    log_format: Literal["json", "console"] = "json"
    log_level: str = "INFO"
    # On SIGTERM, calls in flight get this long to finish; then they are cut (503, or a stream just
    # ends) and the gateway exits. Keep it below the pod's terminationGracePeriodSeconds.
    shutdown_grace_s: int = 20

    def __post_init__(self) -> None:
        """Reject values the gateway could not run with, naming the setting."""
        if not 0 <= self.port < 65536:
            raise SettingsError(f"port must be in 0..65535, not {self.port}")
        if self.shutdown_grace_s < 0:
            raise SettingsError(f"shutdown_grace_s must be >= 0, not {self.shutdown_grace_s}")
        if self.metrics_interval_s < 0:
            raise SettingsError(f"metrics_interval_s must be >= 0, not {self.metrics_interval_s}")
        self._check_parsers()
        for name in ("max_body_bytes", "max_in_flight_per_upstream", "unhealthy_after_failures"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1, not {getattr(self, name)}")

    def _check_parsers(self) -> None:
        """The parser names against the gateway's registries (imported here: the module stays a leaf)."""
        from harnessrl.gateway.reasoning_parse import REASONING_PARSERS
        from harnessrl.gateway.tool_parse import TOOL_PARSERS

        if self.tool_parser not in TOOL_PARSERS:
            known = sorted(TOOL_PARSERS)
            raise SettingsError(f"tool_parser must be one of {known}, not {self.tool_parser!r}")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            known = sorted(REASONING_PARSERS)
            given = self.reasoning_parser
            raise SettingsError(f"reasoning_parser must be empty or one of {known}, not {given!r}")

    @property
    def secret(self) -> bytes:
        """The key secret as bytes."""
        return self.key_secret.encode()


def read_settings(toml_path: Path | str | None = None, **overrides: Any) -> GatewaySettings:
    """Read `[gateway]` from a TOML file, then `HRL_GATEWAY_*`, then `overrides` (None: not given).

    Fails fast with `SettingsError` on an invalid value or without `key_secret`: a gateway that
    can't verify episode keys would refuse every call.
    """
    settings = load_settings(
        GatewaySettings, prefix=ENV_PREFIX, section="gateway", toml_path=toml_path, **overrides
    )
    if not settings.key_secret:
        raise SettingsError(f"{ENV_PREFIX}KEY_SECRET is required (the episode key signing secret)")
    return settings

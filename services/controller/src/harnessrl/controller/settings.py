"""The controller's settings: one struct, every default explained, read from TOML and `HRL_CONTROLLER_*`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import msgspec

from harnessrl.shared.net import DEFAULT_NATS_URL
from harnessrl.shared.settings import SettingsError, load_settings

ENV_PREFIX = "HRL_CONTROLLER_"
_MIN_LEASE_TTL_S = 0.5
_LEASE_GROUP = re.compile(r"^[A-Za-z0-9_-]+$")


class ControllerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the controller reaches the bus, the gateway and the cluster."""

    nats_url: str = DEFAULT_NATS_URL
    # HMAC secret shared with the gateway; episode keys are signed with it. Required outside tests.
    key_secret: str = ""
    # Base URL harnesses use for the model API (the gateway), without `/v1`.
    gateway_url: str = "http://127.0.0.1:8000"
    # Where local episodes get their work directories and captured output.
    state_dir: str = ".harnessrl/controller"
    # Episode keys outlive the episode deadline by this much, so grading-time reads still verify.
    key_grace_s: float = 300.0
    # Local launcher: seconds between SIGTERM and SIGKILL at the deadline.
    kill_grace_s: float = 5.0
    # Kubernetes: kubeconfig file (empty: in-cluster config, then the default kubeconfig).
    kubeconfig: str = ""
    # Kubernetes: explicit API server URL (tests and the fake API server); overrides kubeconfig.
    kube_api_url: str = ""
    # Kubernetes: seconds a watch request stays open before it is renewed (the server ends it).
    kube_watch_timeout_s: int = 60
    # Kubernetes: finished Jobs are garbage-collected this long after they end.
    job_ttl_s: int = 3600
    # Seconds an unanswered bus request (episode open/close, run submit) waits.
    request_timeout_s: float = 10.0
    # The runs this controller owns (empty: every run). One active controller per run.
    runs: list[str] = msgspec.field(default_factory=list)
    # Active and standby: controllers of one group share a lease (KV `hrl-controller-lease`) and only
    # its holder works. Empty: the group is named after `runs`, so controllers that own the same runs
    # are one group and controllers owning other runs never wait for each other.
    lease_group: str = ""
    # Seconds a lease outlives its holder's last renewal (renewed every third of it). A standby takes
    # over about 1.2 times this after the holder died (12 s by default, under the 15 s bound); a
    # holder cut off from the bus stops at two thirds of it, before anyone else may start.
    lease_ttl_s: float = 10.0
    # Prometheus `/metrics` (`harnessrl.shared.metrics_export`), served by standbys too. Off (port 0)
    # by default: an active and a standby controller may share one machine; a pod sets a port (and
    # host 0.0.0.0) for its scraper.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    # A summary of the same metrics on `hrl.metrics._service.controller` this often (0: none).
    metrics_interval_s: float = 60.0
    # In a cluster the controller pod holds a cluster token and the key secret: a run asking for
    # `launcher.kind = "local"` (its harness inside this pod) is refused. The chart sets it.
    in_cluster: bool = False
    # Images episode and grading pods may run, as shell patterns (`ghcr.io/acme/harness-*`); a run
    # naming another (`launcher.image`, a `job_template` container, a task's image) is refused.
    # Empty: any image (local runs, tests); a cluster deployment lists its own.
    allowed_images: list[str] = msgspec.field(default_factory=list)
    # Logs: JSON lines for collectors, or "console" (key-value) for a person; stdlib level names.
    log_format: Literal["json", "console"] = "json"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        """Refuse values the controller cannot work with (the message names the field)."""
        if self.kube_watch_timeout_s < 1:
            raise SettingsError("kube_watch_timeout_s must be >= 1")
        if self.lease_ttl_s < _MIN_LEASE_TTL_S:
            raise SettingsError(f"lease_ttl_s must be >= {_MIN_LEASE_TTL_S}: a renewal takes a KV round trip")
        if self.lease_group and not _LEASE_GROUP.match(self.lease_group):
            raise SettingsError(f"lease_group {self.lease_group!r}: only letters, digits, '-' and '_'")
        if not 0 <= self.metrics_port < 65536:
            raise SettingsError(f"metrics_port must be in 0..65535 (got {self.metrics_port})")
        if self.metrics_interval_s < 0:
            raise SettingsError(f"metrics_interval_s must be >= 0 (got {self.metrics_interval_s})")

    @property
    def secret(self) -> bytes:
        """The key-signing secret as bytes."""
        return self.key_secret.encode()


def read_settings(toml_path: Path | str | None = None, **overrides: Any) -> ControllerSettings:
    """Build settings from defaults, `[controller]` in a TOML file, env and overrides.

    The service needs `key_secret` (episode keys are signed with it); a struct built in code may
    leave it empty, settings read for the process may not.
    """
    settings = load_settings(
        ControllerSettings, prefix=ENV_PREFIX, section="controller", toml_path=toml_path, **overrides
    )
    if not settings.key_secret:
        raise SettingsError(f"{ENV_PREFIX}KEY_SECRET is required: episode keys are signed with it")
    return settings

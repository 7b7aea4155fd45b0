"""The reward service's settings (env `HRL_REWARD_*` or the `[reward]` table of a TOML file).

A leaf: it imports nothing of the service, so anything (the stack, a test) can build
`RewardSettings` without loading graders. The limits and rules graders apply live here too,
as plain Structs; `grading.grading_context` turns settings into what graders see.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from harnessrl.shared.net import DEFAULT_NATS_URL
from harnessrl.shared.settings import SettingsError, load_settings
from harnessrl.shared.subjects import REWARD_RESULTS


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Resource limits for one sandboxed command."""

    timeout_s: float = 120.0
    memory_bytes: int = 2 * 1024**3
    file_bytes: int = 64 * 1024**2
    processes: int = 512
    isolate_network: bool = True
    drop_privileges: bool = True


class GradingRules(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of the resolution rules; the defaults are stricter than SWE-bench on XFAIL."""

    # An XFAIL on a FAIL_TO_PASS test is a test the patch did not fix; SWE-bench counts it as pass.
    xfail_passes_f2p: bool = False
    # Shaping: an unresolved patch earns f2p_rate * p2p_rate instead of 0 (resolved is always 1).
    partial_credit: bool = False


class RewardSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Every knob of the reward service, with the reason for each default."""

    nats_url: str = DEFAULT_NATS_URL
    # One durable shared by all workers: JetStream hands each event to exactly one of them.
    durable: str = "reward"
    # Which runs this worker grades (a subject token or `*`).
    runs: str = "*"
    # Gradings in flight per worker process; each is one sandboxed pytest.
    concurrency: int = 1
    # Finished results per episode, so a redelivered event republishes instead of regrading.
    results_bucket: str = REWARD_RESULTS.name
    # Where relative `repo_path`s of task instances live (the folder holding a tinyswe build).
    tasks_root: str = "."
    # The interpreter that runs task tests in the local sandbox (empty: this one).
    python: str = ""
    # Whole-grading deadline (clone, patch, tests); past it the episode fails as reward-error.
    grade_timeout_s: float = 300.0
    # Test-run deadline inside the sandbox.
    test_timeout_s: float = 120.0
    # How soon an episode whose grading worker died (or whose delivery was lost) is graded again.
    # A grading that runs longer keeps its event by saying it is still working, every third of this.
    ack_wait_s: float = 30.0
    memory_bytes: int = 2 * 1024**3
    isolate_network: bool = True
    drop_privileges: bool = True
    max_artifact_bytes: int = 2 * 1024 * 1024
    xfail_passes_f2p: bool = False
    partial_credit: bool = False
    # Where SWE patches are graded: "local" (our pytest run in this machine's sandbox, from the
    # row's `repo_path`), "container" (the grading Job's pod in the row's image, run here by
    # `container_engine`), "kubernetes" (that Job in a cluster). Rows with their own `eval_script`
    # (SWE-bench 5.x) need an image: "container" or "kubernetes".
    sandbox: Literal["local", "container", "kubernetes"] = "local"
    container_engine: str = "podman"
    namespace: str = "default"
    # Kubernetes sandbox: an API server URL taking requests without credentials (`kubectl proxy`,
    # the test kit's fake API server). Empty: the pod's in-cluster service account, as the chart runs it.
    kube_api_url: str = ""
    # Prometheus `/metrics` (`harnessrl.shared.metrics_export`). Off (port 0) by default: workers
    # of a local stack share one machine; a pod sets a port (and host 0.0.0.0) for its scraper.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    # A summary of the same metrics on `hrl.metrics._service.reward` this often (0: none).
    metrics_interval_s: float = 60.0
    # Logs: JSON lines for collectors, or "console" (key-value) for a person; stdlib level names.
    log_format: Literal["json", "console"] = "json"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        """Reject values no worker could run with, naming the field."""
        if self.concurrency < 1:
            raise SettingsError(f"concurrency must be >= 1 (got {self.concurrency})")
        if not 0 <= self.metrics_port < 65536:
            raise SettingsError(f"metrics_port must be in 0..65535 (got {self.metrics_port})")
        if self.metrics_interval_s < 0:
            raise SettingsError(f"metrics_interval_s must be >= 0 (got {self.metrics_interval_s})")
        if self.kube_api_url and not self.kube_api_url.startswith(("http://", "https://")):
            raise SettingsError(f"kube_api_url must be an http:// or https:// URL, not {self.kube_api_url!r}")
        for name in ("grade_timeout_s", "test_timeout_s", "ack_wait_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be > 0 (got {getattr(self, name)})")


def read_settings(toml_path: Path | str | None = None, **overrides: Any) -> RewardSettings:
    """Read settings from defaults, TOML, `HRL_REWARD_*` and overrides (highest last)."""
    return load_settings(
        RewardSettings, prefix="HRL_REWARD_", section="reward", toml_path=toml_path, **overrides
    )

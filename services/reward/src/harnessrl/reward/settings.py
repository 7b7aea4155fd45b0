"""The reward service's settings (env `HRL_REWARD_*` or the `[reward]` table of a TOML file)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

import msgspec

from harnessrl.reward.grading import GradingContext
from harnessrl.reward.swe.rules import GradingRules
from harnessrl.reward.swe.sandbox import SandboxLimits
from harnessrl.shared.net import DEFAULT_NATS_URL
from harnessrl.shared.settings import load_settings


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
    results_bucket: str = "hrl-rewards"
    # Where relative `repo_path`s of task instances live (the folder holding a tinyswe build).
    tasks_root: str = "."
    # The interpreter that runs task tests in the local sandbox (empty: this one).
    python: str = ""
    # Whole-grading deadline (clone, patch, tests); past it the episode fails as reward-error.
    grade_timeout_s: float = 300.0
    # Test-run deadline inside the sandbox.
    test_timeout_s: float = 120.0
    memory_bytes: int = 2 * 1024**3
    isolate_network: bool = True
    drop_privileges: bool = True
    max_artifact_bytes: int = 2 * 1024 * 1024
    xfail_passes_f2p: bool = False
    partial_credit: bool = False
    sandbox: Literal["local", "kubernetes"] = "local"
    namespace: str = "default"
    log_format: Literal["json", "console"] = "json"

    def __post_init__(self) -> None:
        """Reject values no worker could run with."""
        if self.concurrency < 1:
            raise msgspec.ValidationError("Expected `concurrency` >= 1")
        if self.grade_timeout_s <= 0 or self.test_timeout_s <= 0:
            raise msgspec.ValidationError("Expected timeouts > 0")

    def grading_context(self) -> GradingContext:
        """The part graders see."""
        return GradingContext(
            tasks_root=self.tasks_root,
            python=self.python or sys.executable,
            limits=SandboxLimits(
                timeout_s=self.test_timeout_s,
                memory_bytes=self.memory_bytes,
                isolate_network=self.isolate_network,
                drop_privileges=self.drop_privileges,
            ),
            rules=GradingRules(xfail_passes_f2p=self.xfail_passes_f2p, partial_credit=self.partial_credit),
            max_artifact_bytes=self.max_artifact_bytes,
            sandbox=self.sandbox,
            namespace=self.namespace,
        )


def load_reward_settings(toml_path: Path | str | None = None, **overrides: Any) -> RewardSettings:
    """Read settings from defaults, TOML, `HRL_REWARD_*` and overrides."""
    return load_settings(
        RewardSettings, prefix="HRL_REWARD_", section="reward", toml_path=toml_path, **overrides
    )

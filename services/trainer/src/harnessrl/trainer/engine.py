"""The policy engine: verl's FSDP2 `TrainingWorker`, built once and driven in-process.

On a machine without a GPU the project's verl platform plugin (`verl_cpu`) provides the `cpu`
platform; the engine runs in a world-size-1 gloo process group started here (free port, no Ray),
with `sdpa` attention, `use_remove_padding=False` and float32 parameters. On GPUs the same code takes
verl's CUDA platform and engine (`torchrun` provides the process group; written against verl 0.9.1's
API, not run here).

One step: recompute the behaviour logprobs of the batch (`infer_batch`), fold truncated
importance weights into the loss (`loss.rollout_normalized_loss`), one optimizer update
(`train_mini_batch`). Weights leave as HF safetensors (`export_hf`) for vLLM to reload.
"""

from __future__ import annotations

import logging
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.utils.checkpoint import fsdp_checkpoint_manager
from verl.utils.device import get_device_name
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.padding import no_padding_2_padding

from harnessrl.shared.log import get_logger
from harnessrl.shared.net import free_port
from harnessrl.trainer.batch import RowBatch, probe_tensordict, to_tensordict
from harnessrl.trainer.loss import actor_config, rollout_normalized_loss
from harnessrl.trainer.samples import TrainingRow
from harnessrl.trainer.settings import EngineSettings, LossSettings
from harnessrl.trainer.verl_cpu import register_cpu_engine

log = get_logger(__name__)
# Files vLLM needs beside the weights to load a checkpoint as a model directory.
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def _quiet_verl_checkpoint_logs() -> None:
    """Verl logs every checkpoint file it writes at INFO; one checkpoint per step is routine."""
    logging.getLogger(fsdp_checkpoint_manager.__file__).setLevel(logging.WARNING)


def ensure_process_group() -> None:
    """Join torchrun's process group, or start a world-size-1 gloo group on a free port.

    Outside torchrun the rendezvous variables are always overwritten: a child process inherits
    its parent's, and reusing the parent's port would collide with the parent's store.
    """
    if dist.is_initialized():
        return
    backend = "gloo" if not torch.cuda.is_available() else "cpu:gloo,cuda:nccl"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        dist.init_process_group(backend=backend)
        return
    port = free_port()
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


class PolicyEngine:
    """verl's TrainingWorker on the policy model; create once, call `train` per step."""

    def __init__(self, model_dir: Path, settings: EngineSettings, loss: LossSettings) -> None:
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.loss_settings = loss
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        ensure_process_group()
        _quiet_verl_checkpoint_logs()
        self.worker = self._build_worker()
        self.worker.set_loss_fn(partial(rollout_normalized_loss, loss, actor_config(loss)))
        self.worker.reset()
        # The reference policy (the starting model, frozen) is only needed for a KL term. verl's
        # forward-only engine pins host memory (CPUOffloadPolicy), which needs an accelerator, so
        # on the CPU the reference is a plain transformers model.
        self.reference: Any = None
        if loss.kl_coef > 0 and self.device_name != "cpu":
            self.reference = self._build_worker(forward_only=True)
            self.reference.reset()
        elif loss.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            self.reference.eval()
        log.info("engine.ready", model=str(self.model_dir), device=self.device_name)

    @property
    def device_name(self) -> str:
        """Verl's device for this process ("cpu" through our plugin, or "cuda")."""
        return str(get_device_name())

    def _build_worker(self, *, forward_only: bool = False) -> Any:

        register_cpu_engine()
        cfg = self.settings
        on_cpu = self.device_name == "cpu"
        precision = cfg.precision if cfg.precision != "auto" else ("fp32" if on_cpu else "bf16")
        mixed = {"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
        model = HFModelConfig(
            path=str(self.model_dir),
            load_tokenizer=False,
            use_remove_padding=not on_cpu,
            enable_gradient_checkpointing=not on_cpu,
            override_config={"attn_implementation": "sdpa" if on_cpu else "flash_attention_2"},
        )
        engine = FSDPEngineConfig(
            strategy=cfg.strategy,
            model_dtype="fp32",
            mixed_precision=mixed,
            use_torch_compile=False,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=cfg.max_tokens_per_micro_batch,
            infer_max_token_len_per_gpu=cfg.max_tokens_per_micro_batch,
            seed=cfg.seed,
            forward_only=forward_only,
        )
        optim = FSDPOptimizerConfig(
            lr=cfg.lr, weight_decay=cfg.weight_decay, clip_grad=cfg.clip_grad,
            total_training_steps=10**9,
        )  # fmt: skip
        return TrainingWorker(
            TrainingWorkerConfig(
                model_type="language_model",
                model_config=model,
                engine_config=engine,
                optimizer_config=optim,
                checkpoint_config=CheckpointConfig(),
            )
        )

    def row_logprobs(
        self, rows: list[TrainingRow], *, temperature: float = 1.0, reference: bool = False
    ) -> list[list[float]]:
        """The policy's (or the reference's) logprobs of each row's response tokens at `temperature`."""
        if reference and isinstance(self.reference, torch.nn.Module):
            return _module_logprobs(self.reference, rows, temperature)
        data = probe_tensordict(rows, temperature=temperature)
        worker = self.reference if reference else self.worker
        output = worker.infer_batch(data)
        padded = no_padding_2_padding(tu.get(output, "log_probs"), data)
        return [
            padded[index, : len(row.input_ids) - row.prompt_len].tolist() for index, row in enumerate(rows)
        ]

    def train(self, batch: RowBatch, *, step: int) -> dict[str, float]:
        """One optimizer update on `batch`; returns verl's and our loss metrics (floats)."""
        data = to_tensordict(batch, seed=step)
        extra: dict[str, float] = {}
        width = data["old_log_probs"].shape[1]
        if self.settings.recompute_old_logprobs:
            old = self.row_logprobs(batch.rows, temperature=batch.temperature)
            data["old_log_probs"] = _padded(old, width)
            extra = logprob_mismatch(batch.rows, old)
        if self.reference is not None:
            reference = self.row_logprobs(batch.rows, temperature=batch.temperature, reference=True)
            data["ref_log_prob"] = _padded(reference, width)
        tu.assign_non_tensor(data, calculate_entropy=self.settings.calculate_entropy)
        output = self.worker.train_mini_batch(data)
        return {**_flatten_metrics(tu.get(output, "metrics")), **extra}

    def save(self, directory: Path, step: int) -> None:
        """Verl's own engine checkpoint (model, optimizer, RNG) into `directory`."""
        self.worker.save_checkpoint(str(directory), global_step=step)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""
        self.worker.load_checkpoint(str(directory))

    def export_hf(self, directory: Path) -> Path:
        """Write the full weights as HF safetensors plus the base model's config and tokenizer."""
        directory.mkdir(parents=True, exist_ok=True)
        params, _ = self.worker.engine.get_per_tensor_param()
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in params}
        config = _read_json(self.model_dir / "config.json")
        if config.get("tie_word_embeddings") and "lm_head.weight" in tensors:
            del tensors["lm_head.weight"]
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        for name in _MODEL_FILES:
            source = self.model_dir / name
            if source.exists():
                shutil.copyfile(source, directory / name)
        return directory


def logprob_mismatch(rows: list[TrainingRow], trainer: list[list[float]]) -> dict[str, float]:
    """How far vLLM's sampled-token logprobs are from the trainer's (KL estimates k1, k3, max)."""
    diffs = [
        rollout - mine
        for row, values in zip(rows, trainer, strict=True)
        for rollout, mine, mask in zip(row.logprobs, values, row.loss_mask, strict=False)
        if mask
    ]
    if not diffs:
        return {}
    delta = torch.tensor(diffs, dtype=torch.float64)
    k3 = torch.exp(-delta) - 1 + delta
    return {
        "mismatch/kl_k1": float(delta.mean()),
        "mismatch/kl_k3": float(k3.mean()),
        "mismatch/max_abs": float(delta.abs().max()),
    }


@torch.no_grad()
def _module_logprobs(
    model: torch.nn.Module, rows: list[TrainingRow], temperature: float
) -> list[list[float]]:
    out = []
    for row in rows:
        ids = torch.tensor([row.input_ids])
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(logprobs[row.prompt_len - 1 :].tolist())
    return out


def _padded(values: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(values), width)
    for index, row in enumerate(values):
        out[index, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def _read_json(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = msgspec.json.decode(path.read_bytes())
    return result


def _flatten_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Verl returns lists (one value per micro-batch): average them into floats."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        numbers = [float(item.value if hasattr(item, "value") else item) for item in values]
        if numbers:
            flat[key] = sum(numbers) / len(numbers)
    return flat

"""The policy engine: verl's FSDP2 `TrainingWorker`, built once and driven in-process.

On a machine without a GPU the project's verl platform plugin (`verl_cpu`) provides the `cpu`
platform; the engine runs in a world-size-1 gloo process group started here (free port, no Ray),
with `sdpa` attention, `use_remove_padding=False` and float32 parameters. On GPUs the same code takes
verl's CUDA platform and engine (`torchrun` provides the process group; written against verl 0.9.1's
API, not run here).

One step: recompute the behaviour logprobs of the batch (`infer_batch`), fold truncated
importance weights into the loss (`loss.rollout_normalized_loss`), one optimizer update
(`train_mini_batch`). Weights leave as HF safetensors (`export_hf`) for vLLM to reload.

Data parallelism (`torchrun --nproc-per-node N`): every rank builds this engine; the public methods
are called on rank 0 only, which announces each one to the other ranks (`ranks.RankChannel`) and
hands each its share: the rows of a step or a probe are split by `batch.rank_positions`, results
come back to rank 0 in the callers' order. Checkpoints are written by every rank into the same
directory (verl's per-rank shards); the HF export is a collective gather written by rank 0 alone.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any

import msgspec
import torch
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
from harnessrl.trainer.batch import (
    RowBatch,
    batch_at,
    in_callers_order,
    padded_values,
    probe_tensordict,
    rank_positions,
    rows_at,
    to_tensordict,
)
from harnessrl.trainer.loss import (
    actor_config,
    flatten_metrics,
    mismatch_deltas,
    mismatch_metrics,
    rollout_normalized_loss,
)
from harnessrl.trainer.ranks import (
    CheckpointShare,
    LogprobShare,
    RankChannel,
    TrainShare,
    ensure_process_group,
)
from harnessrl.trainer.samples import TrainingRow
from harnessrl.trainer.settings import EngineSettings, LossSettings
from harnessrl.trainer.verl_cpu import register_cpu_engine

log = get_logger(__name__)
# Files vLLM needs beside the weights to load a checkpoint as a model directory.
# On the padded path, a step whose longest row is longer trains one row per micro-batch.
PADDED_ROW_LIMIT = 4096
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


ParamConvert = Callable[[str, torch.Tensor], torch.Tensor]


class PolicyEngine:
    """verl's TrainingWorker on the policy model; create once, call `train` per step."""

    def __init__(self, model_dir: Path, settings: EngineSettings, loss: LossSettings) -> None:
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.loss_settings = loss
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        ensure_process_group()
        self.ranks = RankChannel()
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
        log.info(
            "engine.ready", model=str(self.model_dir), device=self.device_name,
            rank=self.ranks.rank, ranks=self.ranks.size,
        )  # fmt: skip

    @property
    def packed(self) -> bool:
        """Whether rows are packed without padding (verl's remove-padding path: GPUs)."""
        return self.device_name != "cpu"

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
        positions = rank_positions(rows, self.ranks.size)
        single = self._row_micro_batches(rows)
        shares = [LogprobShare(rows_at(rows, part), temperature, reference, single) for part in positions]
        with self.ranks.command("logprobs", shares) as mine:
            parts = self._logprobs_share(mine) or []
        return in_callers_order(positions, parts, len(rows))

    def train(self, batch: RowBatch, *, step: int) -> dict[str, float]:
        """One optimizer update on `batch`; returns verl's and our loss metrics (floats)."""
        positions = rank_positions(batch.rows, self.ranks.size)
        single = self._row_micro_batches(batch.rows)
        shares = [TrainShare(batch_at(batch, part), step, len(batch.rows), single) for part in positions]
        with self.ranks.command("train", shares) as mine:
            return self._train_share(mine)

    def save(self, directory: Path, step: int) -> None:
        """Verl's own engine checkpoint (model, optimizer, RNG; one shard per rank) into `directory`."""
        with self.ranks.command("save", self._everywhere(CheckpointShare(str(directory), step))) as mine:
            self._save_share(mine)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (with the same number of ranks)."""
        with self.ranks.command("load", self._everywhere(CheckpointShare(str(directory)))) as mine:
            self._load_share(mine)

    def export_hf(self, directory: Path) -> Path:
        """Write the full weights as HF safetensors plus the base model's config and tokenizer."""
        with self.ranks.command("export", self._everywhere(CheckpointShare(str(directory)))) as mine:
            self._export_share(mine)
        return directory

    def full_params(self, convert: ParamConvert | None = None) -> list[tuple[str, torch.Tensor]]:
        """Every parameter, full and HF-named, as `convert(name, tensor)` (default: the tensor).

        Each tensor is an all-gather over the ranks, so this is the one way to read the weights
        (e.g. for an NCCL weight sync): it runs the gather on every rank, in the same order.
        """
        with self.ranks.command("params", self._everywhere(None)):
            return self._gather_params(convert)

    def follow(self) -> None:
        """Ranks > 0: run rank 0's engine calls with this rank's share until `stop_followers`."""
        self.ranks.follow(
            {
                "train": self._train_share,
                "logprobs": self._logprobs_share,
                "save": self._save_share,
                "load": self._load_share,
                "export": self._export_share,
                "params": lambda _share: self._gather_params(None),
            }
        )

    def stop_followers(self) -> None:
        """Rank 0, when done: end the other ranks' `follow` (no engine call can follow it)."""
        self.ranks.stop()

    def _row_micro_batches(self, rows: Sequence[TrainingRow]) -> bool:
        """Whether to run one row per micro-batch: on the padded (CPU) path once a row is long.

        Without padding removal a micro-batch is padded to its longest row and attention gets a
        dense mask, so verl's token-count packing would put a 32k-token row beside a 1k one into
        tens of GiB (measured: 21.6 GiB; one row per micro-batch: 2.2 GiB, same gradient). One
        decision for the whole step, so every rank runs the same number of micro-batches.
        """
        return not self.packed and max((len(row.input_ids) for row in rows), default=0) > PADDED_ROW_LIMIT

    def _everywhere(self, share: Any) -> list[Any]:
        return [share] * self.ranks.size

    def _logprobs_share(self, share: LogprobShare) -> list[list[list[float]]] | None:
        """Every rank: the logprobs of its rows; each rank's list on rank 0, None elsewhere."""
        return self.ranks.gather(
            self._local_logprobs(share.rows, share.temperature, share.reference, share.row_micro_batches)
        )

    def _local_logprobs(
        self, rows: list[TrainingRow], temperature: float, reference: bool, single: bool
    ) -> list[list[float]]:
        if reference and isinstance(self.reference, torch.nn.Module):
            return _module_logprobs(self.reference, rows, temperature)
        data = probe_tensordict(rows, temperature=temperature, dp_size=self.ranks.size)
        if single:
            tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        worker = self.reference if reference else self.worker
        output = worker.infer_batch(data)
        padded = no_padding_2_padding(tu.get(output, "log_probs"), data)
        return [
            padded[index, : len(row.input_ids) - row.prompt_len].tolist() for index, row in enumerate(rows)
        ]

    def _train_share(self, share: TrainShare) -> dict[str, float]:
        """Every rank: its rows' behaviour logprobs, then the collective update; metrics on rank 0."""
        batch = share.batch
        data = to_tensordict(
            batch, seed=share.step, dp_size=self.ranks.size, global_batch_size=share.global_rows
        )
        width = data["old_log_probs"].shape[1]
        deltas: list[float] = []
        if self.settings.recompute_old_logprobs:
            old = self._local_logprobs(batch.rows, batch.temperature, False, share.row_micro_batches)
            data["old_log_probs"] = padded_values(old, width)
            deltas = mismatch_deltas(batch.rows, old)
        if self.reference is not None:
            reference = self._local_logprobs(batch.rows, batch.temperature, True, share.row_micro_batches)
            data["ref_log_prob"] = padded_values(reference, width)
        tu.assign_non_tensor(data, calculate_entropy=self.settings.calculate_entropy)
        if share.row_micro_batches:
            tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        output = self.worker.train_mini_batch(data)
        gathered = self.ranks.gather(deltas)
        if gathered is None:
            return {}
        metrics = flatten_metrics(tu.get(output, "metrics"))
        return {**metrics, **mismatch_metrics(list(chain.from_iterable(gathered)))}

    def _save_share(self, share: CheckpointShare) -> None:
        self.worker.save_checkpoint(share.directory, global_step=share.step)

    def _load_share(self, share: CheckpointShare) -> None:
        self.worker.load_checkpoint(share.directory)

    def _export_share(self, share: CheckpointShare) -> None:
        """Every rank gathers; rank 0 writes the safetensors and the base model's files."""
        tensors = dict(self._gather_params(lambda _name, tensor: tensor.detach().to("cpu").contiguous()))
        if not self.ranks.leads:
            return
        directory = Path(share.directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = _read_json(self.model_dir / "config.json")
        if config.get("tie_word_embeddings") and "lm_head.weight" in tensors:
            del tensors["lm_head.weight"]
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        for name in _MODEL_FILES:
            source = self.model_dir / name
            if source.exists():
                shutil.copyfile(source, directory / name)

    def _gather_params(self, convert: ParamConvert | None) -> list[tuple[str, torch.Tensor]]:
        """Every rank: iterate verl's per-tensor gather; rank 0 keeps the tensors, the others drop them.

        The gathers run on this thread's (default) stream and are synchronised before returning:
        verl notes FSDP2 deadlocks with more than two ranks when they run on a side stream.
        """
        params, _ = self.worker.engine.get_per_tensor_param()
        kept: list[tuple[str, torch.Tensor]] = []
        for name, tensor in params:
            if self.ranks.leads:
                kept.append((name, convert(name, tensor) if convert is not None else tensor))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return kept


def _module_logprobs(
    model: torch.nn.Module, rows: list[TrainingRow], temperature: float
) -> list[list[float]]:
    out: list[list[float]] = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.input_ids])
            logits = model(input_ids=ids).logits[0, :-1].float() / temperature
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(logprobs[row.prompt_len - 1 :].tolist())
    return out


def _read_json(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = msgspec.json.decode(path.read_bytes())
    return result

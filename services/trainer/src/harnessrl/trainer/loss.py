"""The policy loss: verl's clipped policy-gradient math, normalised per rollout.

verl's `ppo_loss` aggregates per row or per token. We reuse its policy-loss function
(`core_algos.get_policy_loss_fn`) unchanged and fold two per-token factors into its
`rollout_is_weights` argument, which multiplies the per-token loss before aggregation:

- truncated importance sampling: `min(exp(old_logp - rollout_logp), tis_clip)`, correcting for the
  difference between the trainer's and vLLM's probabilities of the sampled tokens;
- the per-rollout weight `1 / (R * n_r)` from `advantages.token_weights`.

With `loss_agg_mode="token-sum"` the loss is then `sum_r mean_{t in r} (tis_t * pg_t) / R`, exact
across micro-batches (each micro-batch's sum adds up). An optional KL to a reference policy uses
verl's `kl_penalty` under the same weights.

Data parallelism: the weights `1 / (R * n_r)` are over the *global* batch, but FSDP averages
gradients over the `dp_size` ranks, so every rank's sum is multiplied by `dp_size` (verl's
`agg_loss` does this in "token-sum" mode once `dp_size` is in `config.global_batch_info`, as verl's
own `ppo_loss` sets it); the averaged gradient is then the global sum.

Metrics are verl `Metric`s, aggregated by verl over micro-batches and ranks: a `SUM` over
micro-batches of the mean over ranks. Loss terms are reported as the loss itself (dp-scaled sums:
the reported value is the global loss); per-token rates (`tis_mean`, `tis_clipped`, verl's clip
fractions and `ppo_kl`) as the micro-batch's share of the global token mean,
`rate * tokens / batch_num_tokens * dp_size`. Both come out the same however the batch is split
into micro-batches or ranks.

Beside the loss: the logprob mismatch between vLLM and the trainer that TIS corrects
(`mismatch_metrics`, over every rank's tokens), and verl's metrics as floats (`flatten_metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import torch
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.utils.padding import no_padding_2_padding

from harnessrl.trainer.samples import TrainingRow
from harnessrl.trainer.settings import LossSettings


def truncated_is_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """Token-level truncated importance weights `min(exp(old - rollout), clip)`, 0 off the mask."""
    ratio = torch.exp(torch.clamp(old_log_probs - rollout_log_probs, min=-20.0, max=20.0))
    return torch.clamp(ratio, max=clip) * mask


def actor_config(settings: LossSettings) -> Any:
    """Verl's ActorConfig carrying the clip and loss settings its policy-loss functions read."""
    return ActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        use_dynamic_bsz=False,
        rollout_n=1,
        clip_ratio=settings.clip_ratio,
        loss_agg_mode="token-sum",
        use_kl_loss=settings.kl_coef > 0,
        kl_loss_coef=settings.kl_coef,
        kl_loss_type=settings.kl_type,
        entropy_coeff=settings.entropy_coef,
        policy_loss=PolicyLossConfig(loss_mode=settings.policy_loss),
    )


class BatchShare(msgspec.Struct, frozen=True):
    """Where a micro-batch sits in the global batch: verl's `dp_size` and `batch_num_tokens`."""

    dp_size: int
    batch_tokens: float

    @classmethod
    def of(cls, data: Any, tokens: float) -> BatchShare:
        """Read from the micro-batch (verl's engine sets both before the loss runs).

        Called outside verl's engine (no `batch_num_tokens`), the micro-batch's own `tokens` are
        the whole batch, on one rank.
        """
        dp_size = int(tu.get_non_tensor_data(data, "dp_size", 1))
        batch_tokens = tu.get_non_tensor_data(data, "batch_num_tokens", None)
        if batch_tokens is None:
            dp_size, batch_tokens = 1, tokens
        return cls(dp_size=dp_size, batch_tokens=max(float(batch_tokens), 1.0))

    def loss_term(self, value: torch.Tensor) -> Metric:
        """A dp-scaled sum of the loss (what backward sees): summed over micro-batches."""
        return Metric(AggregationType.SUM, float(value.detach()))

    def token_rate(self, rate: float, tokens: float) -> Metric:
        """A rate over this micro-batch's `tokens`, as its part of the global token mean."""
        return Metric(AggregationType.SUM, rate * tokens / self.batch_tokens * self.dp_size)


def _set_global_batch_info(config: Any, data: Any, share: BatchShare) -> None:
    """What verl's policy-loss functions pass to `agg_loss` (as verl's `ppo_loss` sets it)."""
    config.global_batch_info.update(
        dp_size=share.dp_size,
        batch_num_tokens=share.batch_tokens,
        global_batch_size=tu.get_non_tensor_data(data, "global_batch_size", None),
        loss_scale_factor=config.loss_scale_factor,
    )


def rollout_normalized_loss(
    settings: LossSettings,
    config: Any,
    model_output: dict[str, Any],
    data: Any,
    dp_group: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Verl loss-function signature; bind `settings` and `config` with functools.partial."""
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    fields = ["response_mask", "old_log_probs", "rollout_log_probs", "advantages", "token_weights"]
    if "ref_log_prob" in data:
        fields.append("ref_log_prob")
    padded = data.select(*fields).to_padded_tensor()
    mask = padded["response_mask"].to(torch.float32)
    tokens = float(mask.sum())
    share = BatchShare.of(data, tokens)
    _set_global_batch_info(config, data, share)
    old = padded["old_log_probs"]
    tis = truncated_is_weights(old, padded["rollout_log_probs"], mask, settings.tis_clip)
    weights = padded["token_weights"]
    pg_loss, pg_metrics = get_policy_loss_fn(settings.policy_loss)(  # type: ignore[no-untyped-call]
        old_log_prob=old,
        log_prob=log_prob,
        advantages=padded["advantages"],
        response_mask=mask.bool(),
        loss_agg_mode="token-sum",
        config=config,
        rollout_is_weights=tis * weights,
    )
    metrics: dict[str, Any] = {key: share.token_rate(float(rate), tokens) for key, rate in pg_metrics.items()}
    metrics["actor/pg_loss"] = share.loss_term(pg_loss)
    metrics["actor/tis_mean"] = share.token_rate(float(tis.sum()) / max(tokens, 1.0), tokens)
    clipped = float(((tis >= settings.tis_clip) * mask).sum())
    metrics["actor/tis_clipped"] = share.token_rate(clipped / max(tokens, 1.0), tokens)
    return _with_regularizers(settings, pg_loss, log_prob, model_output, data, padded, share, metrics)


def _with_regularizers(
    settings: LossSettings,
    loss: torch.Tensor,
    log_prob: torch.Tensor,
    model_output: dict[str, Any],
    data: Any,
    padded: Any,
    share: BatchShare,
    metrics: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Add the entropy bonus and the KL to the reference, weighted like the policy term."""
    mask = padded["response_mask"].to(torch.float32)
    weights = padded["token_weights"]
    entropy = model_output.get("entropy")
    if entropy is not None:
        ent = no_padding_2_padding(entropy, data)
        ent_term = agg_loss(ent * weights, mask, "token-sum", dp_size=share.dp_size)
        metrics["actor/entropy"] = share.loss_term(ent_term)
        loss = loss - settings.entropy_coef * ent_term
    if settings.kl_coef > 0 and "ref_log_prob" in padded:
        kld = kl_penalty(log_prob, padded["ref_log_prob"], settings.kl_type)  # type: ignore[arg-type]
        kl_term = agg_loss(kld * weights, mask, "token-sum", dp_size=share.dp_size)
        metrics["actor/kl_loss"] = share.loss_term(kl_term)
        loss = loss + settings.kl_coef * kl_term
    return loss, metrics


def mismatch_deltas(rows: Iterable[TrainingRow], trainer: Iterable[list[float]]) -> list[float]:
    """The rollout's (vLLM's) logprob minus the trainer's, for every trained token of `rows`."""
    return [
        rollout - mine
        for row, values in zip(rows, trainer, strict=True)
        for rollout, mine, mask in zip(row.logprobs, values, row.loss_mask, strict=False)
        if mask
    ]


def mismatch_metrics(deltas: Sequence[float]) -> dict[str, float]:
    """How far vLLM's sampled-token logprobs are from the trainer's (KL estimates k1, k3, max)."""
    if not deltas:
        return {}
    delta = torch.tensor(deltas, dtype=torch.float64)
    k3 = torch.exp(-delta) - 1 + delta
    return {
        "mismatch/kl_k1": float(delta.mean()),
        "mismatch/kl_k3": float(k3.mean()),
        "mismatch/max_abs": float(delta.abs().max()),
    }


def flatten_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Verl's metrics as floats: lists (one value per mini-batch) averaged, `Metric`s aggregated."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        numbers = [float(item.aggregate() if isinstance(item, Metric) else item) for item in values]
        if numbers:
            flat[key] = sum(numbers) / len(numbers)
    return flat

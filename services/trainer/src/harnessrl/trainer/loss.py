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
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.utils.padding import no_padding_2_padding

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


def rollout_normalized_loss(
    settings: LossSettings,
    config: Any,
    model_output: dict[str, Any],
    data: Any,
    dp_group: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Verl loss-function signature; bind `settings` and `config` with functools.partial."""
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = model_output.get("entropy")
    fields = ["response_mask", "old_log_probs", "rollout_log_probs", "advantages", "token_weights"]
    if "ref_log_prob" in data:
        fields.append("ref_log_prob")
    padded = data.select(*fields).to_padded_tensor()
    mask = padded["response_mask"].to(torch.float32)
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
    loss = pg_loss
    metrics: dict[str, Any] = dict(pg_metrics)
    metrics["actor/pg_loss"] = float(pg_loss.detach())
    metrics["actor/tis_mean"] = float((tis.sum() / mask.sum().clamp(min=1)).detach())
    metrics["actor/tis_clipped"] = float(((tis >= settings.tis_clip) * mask).sum() / mask.sum().clamp(min=1))
    if entropy is not None:
        ent = no_padding_2_padding(entropy, data)
        ent_term = agg_loss(ent * weights, mask, "token-sum")
        metrics["actor/entropy"] = float(ent_term.detach())
        loss = loss - settings.entropy_coef * ent_term
    if settings.kl_coef > 0 and "ref_log_prob" in padded:
        kld = kl_penalty(log_prob, padded["ref_log_prob"], settings.kl_type)  # type: ignore[arg-type]
        kl_term = agg_loss(kld * weights, mask, "token-sum")
        metrics["actor/kl_loss"] = float(kl_term.detach())
        loss = loss + settings.kl_coef * kl_term
    return loss, metrics

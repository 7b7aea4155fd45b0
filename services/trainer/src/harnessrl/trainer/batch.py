"""Training rows to verl's batch layout.

verl's training worker takes a TensorDict in left/right padding (`prompts` left-padded, `responses`
right-padded, `input_ids` their concatenation, `attention_mask`, `position_ids`, `response_mask`)
and converts it to its no-padding (nested) layout with `left_right_2_no_padding`. Next to verl's
fields the batch carries `rollout_log_probs` (what vLLM reported), `advantages` (the rollout's,
broadcast to its tokens) and `token_weights` (per-rollout normalisation, see `advantages`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from harnessrl.trainer.samples import TrainingRow


class RowBatch(msgspec.Struct, kw_only=True):
    """Rows of one step with the per-row values the loss needs.

    `temperature` is the one the rows' trained tokens were sampled at (the run's sampling).
    """

    rows: list[TrainingRow]
    advantages: list[float]
    weights: list[float]
    temperature: float = 1.0


def padded_fields(rows: Sequence[TrainingRow]) -> dict[str, torch.Tensor]:
    """Verl's left/right-padded tensors for `rows` (masks, positions, rollout logprobs)."""
    prompt_width = max(row.prompt_len for row in rows)
    response_width = max(1, *(len(row.input_ids) - row.prompt_len for row in rows))
    size = len(rows)
    prompts = torch.zeros(size, prompt_width, dtype=torch.long)
    responses = torch.zeros(size, response_width, dtype=torch.long)
    attention = torch.zeros(size, prompt_width + response_width, dtype=torch.long)
    response_mask = torch.zeros(size, response_width, dtype=torch.float32)
    rollout_log_probs = torch.zeros(size, response_width, dtype=torch.float32)
    for index, row in enumerate(rows):
        prompt = row.input_ids[: row.prompt_len]
        response = row.input_ids[row.prompt_len :]
        prompts[index, prompt_width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention[index, prompt_width - len(prompt) : prompt_width + len(response)] = 1
        if response:
            responses[index, : len(response)] = torch.tensor(response, dtype=torch.long)
            response_mask[index, : len(response)] = torch.tensor(row.loss_mask, dtype=torch.float32)
            rollout_log_probs[index, : len(response)] = torch.tensor(row.logprobs)
    position_ids = torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
    }


def to_tensordict(batch: RowBatch, *, seed: int = 0) -> TensorDict:
    """The verl no-padding TensorDict of a step: one mini-batch, one epoch."""
    fields = padded_fields(batch.rows)
    mask = fields["response_mask"]
    fields["advantages"] = torch.tensor(batch.advantages, dtype=torch.float32)[:, None] * mask
    fields["token_weights"] = torch.tensor(batch.weights, dtype=torch.float32)[:, None] * mask
    # Until the engine recomputes them, the behaviour policy is the rollout policy.
    fields["old_log_probs"] = fields["rollout_log_probs"].clone()
    size = len(batch.rows)
    data = TensorDict(fields, batch_size=[size])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(
        data,
        temperature=batch.temperature,
        global_batch_size=size,
        mini_batch_size=size,
        epochs=1,
        seed=seed,
        dp_size=1,
    )
    return data


def probe_tensordict(rows: Sequence[TrainingRow], *, temperature: float = 1.0) -> TensorDict:
    """A forward-only batch (no loss inputs) to read the policy's logprobs of `rows`."""
    fields = padded_fields(rows)
    data = left_right_2_no_padding(TensorDict(fields, batch_size=[len(rows)]))
    tu.assign_non_tensor(data, temperature=temperature, compute_loss=False, dp_size=1)
    return data

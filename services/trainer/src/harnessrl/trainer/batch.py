"""Training rows to verl's batch layout.

verl's training worker takes a TensorDict in left/right padding (`prompts` left-padded, `responses`
right-padded, `input_ids` their concatenation, `attention_mask`, `position_ids`, `response_mask`)
and converts it to its no-padding (nested) layout with `left_right_2_no_padding`. Next to verl's
fields the batch carries `rollout_log_probs` (what vLLM reported), `advantages` (the rollout's,
broadcast to its tokens) and `token_weights` (per-rollout normalisation, see `advantages`).

Under data parallelism each rank trains a share of the step's rows (`rank_positions`): the same
number of rows on every rank, token counts balanced, fillers where the rows don't divide evenly.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions
from verl.workers.utils.padding import left_right_2_no_padding

from harnessrl.trainer.samples import TrainingRow

# A rank's stand-in for a row it lacks: two tokens, nothing trained (no loss, no gradient).
FILLER = TrainingRow(
    rollout_id="", input_ids=[0, 0], prompt_len=1, loss_mask=[0], logprobs=[0.0], versions=[-1]
)
FILLER_POSITION = -1


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


def rank_positions(rows: Sequence[TrainingRow], ranks: int) -> list[list[int]]:
    """Which rows each rank takes: positions in `rows`, `FILLER_POSITION` where a filler goes.

    Every rank gets the same number of rows, at least one: verl runs the same number of
    micro-batches on every rank and refuses a rank with fewer rows than micro-batches, so equal
    counts always fit. Within that, token sums are balanced (verl's Karmarkar-Karp partitioner with
    equal sizes); verl's dynamic batching then packs each rank's rows into micro-batches. Fillers
    round the count up to a multiple of `ranks`. One rank takes every row, in order.
    """
    if ranks == 1:
        return [list(range(len(rows)))]
    count = max(ranks, -(-len(rows) // ranks) * ranks)
    lengths = [len(row.input_ids) for row in rows] + [len(FILLER.input_ids)] * (count - len(rows))
    partitions = get_seqlen_balanced_partitions(lengths, ranks, equal_size=True)
    return [[index if index < len(rows) else FILLER_POSITION for index in part] for part in partitions]


def rows_at(rows: Sequence[TrainingRow], positions: Sequence[int]) -> list[TrainingRow]:
    """The rows at `positions`, `FILLER` at `FILLER_POSITION`."""
    return [rows[index] if index != FILLER_POSITION else FILLER for index in positions]


def batch_at(batch: RowBatch, positions: Sequence[int]) -> RowBatch:
    """The part of `batch` at `positions`; a filler's advantage and weight are 0."""
    return RowBatch(
        rows=rows_at(batch.rows, positions),
        advantages=[batch.advantages[index] if index != FILLER_POSITION else 0.0 for index in positions],
        weights=[batch.weights[index] if index != FILLER_POSITION else 0.0 for index in positions],
        temperature=batch.temperature,
    )


def to_tensordict(
    batch: RowBatch, *, seed: int = 0, dp_size: int = 1, global_batch_size: int | None = None
) -> TensorDict:
    """The verl no-padding TensorDict of one rank's share of a step: one mini-batch, one epoch.

    `global_batch_size` counts the rows of the whole step (all ranks, fillers excluded; default:
    this batch's rows) and `dp_size` the ranks; verl's engine sets both `dp_size` and the global
    `batch_num_tokens` again before the loss runs, the loss reads them from there.
    """
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
        global_batch_size=size if global_batch_size is None else global_batch_size,
        # One mini-batch per rank, whatever the rank's row count: one optimizer step per call.
        num_mini_batch=1,
        epochs=1,
        seed=seed,
        dp_size=dp_size,
    )
    return data


def probe_tensordict(
    rows: Sequence[TrainingRow], *, temperature: float = 1.0, dp_size: int = 1
) -> TensorDict:
    """A forward-only batch (no loss inputs) to read the policy's logprobs of `rows`."""
    fields = padded_fields(rows)
    data = left_right_2_no_padding(TensorDict(fields, batch_size=[len(rows)]))
    tu.assign_non_tensor(data, temperature=temperature, compute_loss=False, dp_size=dp_size)
    return data


def in_callers_order(
    positions: Sequence[Sequence[int]], parts: Sequence[Sequence[list[float]]], count: int
) -> list[list[float]]:
    """Each rank's results put back at the positions its rows came from (fillers dropped)."""
    out: list[list[float]] = [[] for _ in range(count)]
    for part_positions, part in zip(positions, parts, strict=True):
        for index, values in zip(part_positions, part, strict=True):
            if index != FILLER_POSITION:
                out[index] = values
    return out


def padded_values(values: list[list[float]], width: int) -> torch.Tensor:
    """Per-row values (e.g. logprobs of the response tokens) as a right-padded `[rows, width]` tensor."""
    out = torch.zeros(len(values), width)
    for index, row in enumerate(values):
        out[index, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out

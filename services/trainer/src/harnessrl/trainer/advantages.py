"""Groups, rollout-level advantages and per-rollout loss weights.

A group is the N attempts of one task. Membership rule: a rollout whose failure is not the
policy's doing (`infra`, `reward-error` by default) or that became no trainable row leaves its
group (as does one with a NaN or infinite reward, which the reward service already refuses);
the group trains when at least `min_group_size` (2) valid members remain, and is skipped
(counted) otherwise or when every valid member got the same reward (zero variance: no signal).

Advantages are computed once per rollout by verl's own estimators (`core_algos`, GRPO with or
without std normalisation, RLOO) and broadcast to all of the rollout's trained tokens.

Loss normalisation is per rollout: token t of rollout r gets weight `1 / (R * n_r)`, with R the
rollouts in the batch and n_r the trained tokens of r over all its rows, and the policy loss is the
weighted token sum. Every rollout thus contributes equally however many rows and tokens it became
(dividing by rows instead would over-weigh rollouts that split into many rows). For rollouts that
are one row each this equals verl's `seq-mean-token-mean` aggregation.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

import msgspec
import numpy as np
import torch
from verl.trainer.ppo import core_algos

from harnessrl.shared.contracts import RolloutComplete
from harnessrl.trainer.samples import TrainingRow
from harnessrl.trainer.settings import AdvantageSettings, Estimator


class AssembledRollout(msgspec.Struct, kw_only=True):
    """A rollout with its training rows, ready for a step."""

    rollout: RolloutComplete
    rows: list[TrainingRow]
    min_version: int = 0
    # Why the rollout can't train at all though it is a member (e.g. "undecodable" spans).
    unusable: str | None = None

    @property
    def rollout_id(self) -> str:
        """The episode id, the rollout's business key."""
        return self.rollout.episode

    @property
    def trained_tokens(self) -> int:
        """Trained tokens over all rows."""
        return sum(row.trained_tokens for row in self.rows)


class ScoredRollout(msgspec.Struct, kw_only=True):
    """A rollout admitted to a step with its advantage."""

    assembled: AssembledRollout
    advantage: float


class GroupOutcome(msgspec.Struct, kw_only=True):
    """The rollouts a batch trains on, and what was left out and why."""

    scored: list[ScoredRollout]
    dropped: dict[str, int] = msgspec.field(default_factory=dict)
    dropped_ids: list[str] = msgspec.field(default_factory=list)
    groups_trained: int = 0
    groups_zero_variance: int = 0
    groups_too_small: int = 0


def split_stale(
    rollouts: Sequence[AssembledRollout], *, version: int, lag: int
) -> tuple[list[AssembledRollout], list[AssembledRollout]]:
    """(current, stale), decided per group: one member beyond `lag` versions makes the whole group stale.

    Members that leave their group anyway (infra failures, retried as new attempts) don't count.
    """
    groups: dict[str, list[AssembledRollout]] = defaultdict(list)
    for item in rollouts:
        groups[item.rollout.group].append(item)
    current: list[AssembledRollout] = []
    stale: list[AssembledRollout] = []
    for members in groups.values():
        counted = [m for m in members if m.rollout.failure != "infra"] or members
        old = any(version - member.min_version > lag for member in counted)
        (stale if old else current).extend(members)
    return current, stale


def _valid(item: AssembledRollout, settings: AdvantageSettings) -> str | None:
    """Why `item` leaves its group, or None when it is a valid member."""
    if item.unusable is not None:
        return item.unusable
    failure = item.rollout.failure
    if failure is not None and failure in settings.excluded_failures:
        return f"failure_{failure}"
    if not math.isfinite(item.rollout.reward):
        return "nonfinite_reward"
    if item.trained_tokens == 0:
        return "no_trainable_tokens"
    return None


def score_groups(rollouts: Sequence[AssembledRollout], settings: AdvantageSettings) -> GroupOutcome:
    """Apply the membership rule, skip degenerate groups, compute advantages with verl."""
    groups: dict[str, list[AssembledRollout]] = defaultdict(list)
    dropped: Counter[str] = Counter()
    dropped_ids: list[str] = []
    outcome = GroupOutcome(scored=[])
    for item in rollouts:
        reason = _valid(item, settings)
        if reason is None:
            groups[item.rollout.group].append(item)
        else:
            dropped[reason] += 1
            dropped_ids.append(item.rollout_id)
    admitted: list[AssembledRollout] = []
    for members in groups.values():
        rewards = [member.rollout.reward for member in members]
        if len(members) < settings.min_group_size:
            outcome.groups_too_small += 1
            dropped["group_too_small"] += len(members)
        elif max(rewards) - min(rewards) < settings.zero_variance_eps:
            outcome.groups_zero_variance += 1
            dropped["zero_variance"] += len(members)
        else:
            outcome.groups_trained += 1
            admitted.extend(members)
            continue
        dropped_ids.extend(member.rollout_id for member in members)
    advantages = rollout_advantages(
        [item.rollout.reward for item in admitted],
        [item.rollout.group for item in admitted],
        settings.estimator,
    )
    outcome.scored = [
        ScoredRollout(assembled=item, advantage=adv) for item, adv in zip(admitted, advantages, strict=True)
    ]
    outcome.dropped = dict(dropped)
    outcome.dropped_ids = dropped_ids
    return outcome


def rollout_advantages(rewards: Sequence[float], groups: Sequence[str], estimator: Estimator) -> list[float]:
    """One advantage per rollout, computed by verl's outcome estimators (one 'token' per rollout)."""
    if not rewards:
        return []
    scores = torch.tensor(list(rewards), dtype=torch.float32).unsqueeze(-1)
    mask = torch.ones_like(scores)
    index = np.array(list(groups), dtype=object)
    if estimator == "rloo":
        advantages, _ = core_algos.compute_rloo_outcome_advantage(scores, mask, index)
    else:
        advantages, _ = core_algos.compute_grpo_outcome_advantage(
            scores, mask, index, norm_adv_by_std_in_grpo=estimator == "grpo"
        )
    return [float(value) for value in advantages.squeeze(-1).tolist()]


def token_weights(scored: Sequence[ScoredRollout]) -> dict[str, float]:
    """Per-token loss weight of each rollout: `1 / (R * n_r)` (see the module doc)."""
    count = len(scored)
    return {
        item.assembled.rollout_id: 1.0 / (count * item.assembled.trained_tokens)
        for item in scored
        if item.assembled.trained_tokens
    }

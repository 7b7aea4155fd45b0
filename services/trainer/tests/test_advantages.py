"""Advantages, group rules and per-rollout loss normalisation on analytic cases."""

import math
import random
from functools import partial

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos

from harnessrl.shared.contracts import RolloutComplete
from harnessrl.trainer.advantages import (
    AssembledRollout,
    rollout_advantages,
    score_groups,
    split_stale,
    token_weights,
)
from harnessrl.trainer.batch import RowBatch, to_tensordict
from harnessrl.trainer.loss import actor_config, rollout_normalized_loss
from harnessrl.trainer.samples import TrainingRow
from harnessrl.trainer.settings import AdvantageSettings, LossSettings


def rollout(episode, group, reward, *, rows=1, tokens_per_row=4, failure=None, group_size=4):
    made = []
    for index in range(rows):
        prompt = [1, 2, 3 + index]
        made.append(
            TrainingRow(
                rollout_id=episode,
                input_ids=[*prompt, *range(10, 10 + tokens_per_row)],
                prompt_len=len(prompt),
                loss_mask=[1] * tokens_per_row,
                logprobs=[-1.5] * tokens_per_row,
                versions=[0] * tokens_per_row,
            )
        )
    return AssembledRollout(
        rollout=RolloutComplete(
            run="r", episode=episode, task="t", group=group, reward=reward,
            group_size=group_size, failure=failure,
        ),
        rows=made,
    )  # fmt: skip


def test_grpo_and_rloo_on_analytic_cases():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0]
    groups = ["a"] * 4 + ["b"] * 4
    grpo = rollout_advantages(rewards, groups, "grpo")
    # Group a: mean 0.5, unbiased std sqrt(1/3).
    std_a = math.sqrt(1 / 3)
    assert grpo[:4] == pytest.approx([0.5 / std_a, -0.5 / std_a, -0.5 / std_a, 0.5 / std_a], 1e-4)
    assert rollout_advantages(rewards, groups, "grpo_no_std")[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # RLOO: reward minus the mean of the others.
    rloo = rollout_advantages(rewards, groups, "rloo")
    assert rloo[4:] == pytest.approx([0.5 - 1.0, 0.5 - 1.0, 0.5 - 1.0, 2.0 - 0.5])


def test_our_advantages_equal_verls_token_level_computation():
    rng = random.Random(3)
    rewards = [rng.choice([0.0, 1.0, 0.3]) for _ in range(24)]
    groups = [f"g{i // 6}" for i in range(24)]
    ours = rollout_advantages(rewards, groups, "grpo")
    # verl's usual call: token-level rewards with the score on the last response token.
    length = 7
    token_rewards = torch.zeros(24, length)
    token_rewards[:, -1] = torch.tensor(rewards)
    theirs, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, torch.ones(24, length), np.array(groups, dtype=object)
    )
    assert torch.allclose(theirs, torch.tensor(ours)[:, None].expand(24, length), atol=1e-6)


def test_group_rules_drop_failures_small_and_zero_variance_groups():
    items = [
        rollout("a1", "a", 1.0), rollout("a2", "a", 0.0),
        rollout("a3", "a", 0.0, failure="infra"),  # leaves the group
        rollout("b1", "b", 1.0), rollout("b2", "b", 0.0, failure="reward-error"),  # 1 left
        rollout("c1", "c", 1.0), rollout("c2", "c", 1.0),  # zero variance
        rollout("d1", "d", 0.0, failure="agent"), rollout("d2", "d", 1.0),  # agent failure counts
    ]  # fmt: skip
    outcome = score_groups(items, AdvantageSettings())
    assert sorted(s.assembled.rollout_id for s in outcome.scored) == ["a1", "a2", "d1", "d2"]
    assert outcome.groups_trained == 2
    assert outcome.groups_too_small == 1 and outcome.groups_zero_variance == 1
    assert outcome.dropped == {
        "failure_infra": 1, "failure_reward-error": 1, "group_too_small": 1, "zero_variance": 2,
    }  # fmt: skip
    assert sorted(outcome.dropped_ids) == ["a3", "b1", "b2", "c1", "c2"]


def loss_of(scored_rollouts, advantages, *, logprob_shift=0.0):
    """Run our loss on a batch where the policy equals the rollout policy (+ shift)."""
    settings = LossSettings()
    scored = [_scored(item, adv) for item, adv in zip(scored_rollouts, advantages, strict=False)]
    weights = token_weights(scored)
    rows, advs, ws = [], [], []
    for item in scored:
        for row in item.assembled.rows:
            rows.append(row)
            advs.append(item.advantage)
            ws.append(weights[item.assembled.rollout_id])
    data = to_tensordict(RowBatch(rows=rows, advantages=advs, weights=ws))
    per_token = []
    for row in rows:
        values = torch.zeros(len(row.input_ids))
        values[row.prompt_len - 1 : len(row.input_ids) - 1] = torch.tensor(row.logprobs)
        per_token.append(values + logprob_shift)
    model_output = {"log_probs": torch.nested.as_nested_tensor(per_token, layout=torch.jagged)}
    loss_fn = partial(rollout_normalized_loss, settings, actor_config(settings))
    loss, _ = loss_fn(model_output=model_output, data=data)
    return float(loss)


def _scored(item, advantage):
    from harnessrl.trainer.advantages import ScoredRollout

    return ScoredRollout(assembled=item, advantage=advantage)


def test_rollouts_that_split_into_1_2_and_5_rows_weigh_the_same():
    # Ratio 1 everywhere: the loss is -sum_r A_r / R whatever the row and token counts.
    items = [
        rollout("x", "g", 1.0, rows=1, tokens_per_row=3),
        rollout("y", "g", 0.0, rows=2, tokens_per_row=5),
        rollout("z", "g", 0.0, rows=5, tokens_per_row=2),
    ]
    for advantages in ([1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.3, -0.7, 0.4]):
        assert loss_of(items, advantages) == pytest.approx(-sum(advantages) / 3, abs=1e-6)


def test_dividing_by_rows_would_differ():
    # The known bug weighs the 5-row rollout 5x: make sure our number is not that one.
    items = [rollout("x", "g", 1.0, rows=1), rollout("z", "g", 0.0, rows=5)]
    ours = loss_of(items, [0.0, 1.0])
    per_row_mean = -(5 * 1.0) / 6
    assert ours == pytest.approx(-0.5, abs=1e-6)
    assert abs(ours - per_row_mean) > 0.1


def test_single_row_rollouts_equal_verls_seq_mean_token_mean():
    rng = random.Random(5)
    items = [rollout(f"r{i}", "g", 0.0, tokens_per_row=rng.randint(1, 9)) for i in range(6)]
    advantages = [rng.uniform(-1, 1) for _ in items]
    shift = 0.05  # ratio != 1: exercises the importance weights too
    ours = loss_of(items, advantages, logprob_shift=shift)
    width = max(item.trained_tokens for item in items)
    mask = torch.zeros(len(items), width)
    loss_mat = torch.zeros(len(items), width)
    for index, (item, adv) in enumerate(zip(items, advantages, strict=False)):
        n = item.trained_tokens
        mask[index, :n] = 1
        ratio = math.exp(shift)  # old = rollout logprobs (no recompute here), clip 0.2 not hit
        tis = min(math.exp(0.0), 2.0)
        loss_mat[index, :n] = -adv * ratio * tis
    theirs = core_algos.agg_loss(loss_mat, mask, "seq-mean-token-mean")
    assert ours == pytest.approx(float(theirs), abs=1e-6)


def test_advantages_after_an_infra_member_leaves_have_the_analytic_values():
    # Group of 4: rewards 1, 0, 0 and an infra failure (retried elsewhere, not the policy's doing).
    members = [rollout("a", "g", 1.0), rollout("b", "g", 0.0), rollout("c", "g", 0.0)]
    members.append(rollout("d", "g", 0.0, failure="infra"))
    outcome = score_groups(members, AdvantageSettings(estimator="grpo"))
    got = {item.assembled.rollout_id: item.advantage for item in outcome.scored}
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased, over the 3 that stayed
    assert got["a"] == pytest.approx((2 / 3) / (std + 1e-6), abs=1e-6)
    assert got["b"] == got["c"] == pytest.approx((-1 / 3) / (std + 1e-6), abs=1e-6)
    assert "d" not in got and outcome.dropped == {"failure_infra": 1}
    rloo = score_groups(members, AdvantageSettings(estimator="rloo"))
    assert {i.assembled.rollout_id: i.advantage for i in rloo.scored} == pytest.approx(
        {"a": 1.0, "b": -0.5, "c": -0.5}
    )


def test_a_non_finite_reward_leaves_its_group_counted():
    members = [rollout("a", "g", 1.0), rollout("b", "g", 0.0), rollout("c", "g", float("nan"))]
    outcome = score_groups(members, AdvantageSettings())
    assert sorted(item.assembled.rollout_id for item in outcome.scored) == ["a", "b"]
    assert outcome.dropped == {"nonfinite_reward": 1}
    assert all(math.isfinite(item.advantage) for item in outcome.scored)


def test_staleness_is_decided_per_group():
    def aged(episode, group, version, failure=None):
        item = rollout(episode, group, 0.0, failure=failure)
        item.min_version = version
        return item

    fast, slow = aged("f1", "g1", 3), aged("s1", "g1", 1)  # slow: 2 versions behind at version 3
    other = [aged("o1", "g2", 3), aged("o2", "g2", 2)]
    infra_old = aged("i1", "g2", 0, failure="infra")  # leaves its group anyway: doesn't make it stale
    current, stale = split_stale([fast, slow, *other, infra_old], version=3, lag=1)
    assert {item.rollout_id for item in stale} == {"f1", "s1"}  # the fast member goes with its group
    assert {item.rollout_id for item in current} == {"o1", "o2", "i1"}

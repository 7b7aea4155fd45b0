"""verl's FSDP2 engine on the CPU: the platform plugin, and a reward signal that moves the policy."""

import random
import statistics

import pytest
import torch
import verl
from verl.plugin.platform import get_platform

from harnessrl.shared.contracts import RolloutComplete
from harnessrl.trainer.advantages import AssembledRollout, score_groups, token_weights
from harnessrl.trainer.batch import RowBatch
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.samples import TrainingRow
from harnessrl.trainer.settings import AdvantageSettings, EngineSettings, LossSettings
from harnessrl.trainer.verl_cpu import PlatformCPU


def test_verl_resolves_our_cpu_platform():
    assert verl.__version__ == "0.9.1"
    assert isinstance(get_platform(), PlatformCPU)
    assert get_platform().communication_backend_name() == "gloo"


def make_row(episode, prompt, completion, logprobs):
    return TrainingRow(
        rollout_id=episode,
        input_ids=[*prompt, *completion],
        prompt_len=len(prompt),
        loss_mask=[1] * len(completion),
        logprobs=logprobs,
        versions=[0] * len(completion),
    )


def mean_logprob(engine, rows):
    return statistics.fmean(lp for values in engine.row_logprobs(rows) for lp in values)


def test_reward_moves_the_policy(policy_engine: PolicyEngine):
    rng = random.Random(11)
    tasks = []
    for task in range(4):
        prompt = [rng.randrange(10, 500) for _ in range(12)]
        good = [rng.randrange(10, 500) for _ in range(6)]
        bad = [rng.randrange(10, 500) for _ in range(9)]
        tasks.append((f"t{task}", prompt, good, bad))
    good_rows = [make_row("g", p, g, [0.0] * len(g)) for _, p, g, _ in tasks]
    bad_rows = [make_row("b", p, b, [0.0] * len(b)) for _, p, _, b in tasks]
    good_before = mean_logprob(policy_engine, good_rows)
    bad_before = mean_logprob(policy_engine, bad_rows)

    for step in range(4):
        rollouts = []
        for task, prompt, good, bad in tasks:
            for attempt in range(8):
                completion, reward = (good, 1.0) if attempt % 2 == 0 else (bad, 0.0)
                row = make_row(f"{task}-{attempt}", prompt, completion, [0.0] * len(completion))
                row.logprobs = policy_engine.row_logprobs([row])[0]  # on-policy rollouts
                rollouts.append(
                    AssembledRollout(
                        rollout=RolloutComplete(
                            run="r", episode=f"{task}-{step}-{attempt}", task=task, group=task,
                            group_size=8, reward=reward,
                        ),
                        rows=[row],
                    )
                )  # fmt: skip
        outcome = score_groups(rollouts, AdvantageSettings())
        weights = token_weights(outcome.scored)
        batch = RowBatch(
            rows=[s.assembled.rows[0] for s in outcome.scored],
            advantages=[s.advantage for s in outcome.scored],
            weights=[weights[s.assembled.rollout_id] for s in outcome.scored],
        )
        metrics = policy_engine.train(batch, step=step)
        assert metrics["grad_norm"] > 0
        assert abs(metrics["mismatch/kl_k1"]) < 1e-4  # rollout logprobs are the trainer's

    assert mean_logprob(policy_engine, good_rows) > good_before + 0.05
    assert mean_logprob(policy_engine, bad_rows) < bad_before - 0.05


def test_kl_to_the_reference_policy_starts_at_zero_and_grows(tiny_model):
    engine = PolicyEngine(tiny_model, EngineSettings(lr=1e-2), LossSettings(kl_coef=0.1))
    rng = random.Random(3)
    prompt = [rng.randrange(10, 500) for _ in range(8)]
    rows = [
        make_row(f"r{i}", prompt, [rng.randrange(10, 500) for _ in range(6)], [-6.0] * 6) for i in range(4)
    ]
    batch = RowBatch(rows=rows, advantages=[1.0, -1.0, 1.0, -1.0], weights=[1 / 24] * 4)
    first = engine.train(batch, step=0)
    second = engine.train(batch, step=1)
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert second["actor/kl_loss"] > 1e-4


def test_full_params_are_the_exported_weights_and_one_rank_has_no_followers(policy_engine, tmp_path):
    from safetensors.torch import load_file

    exported = load_file(str(policy_engine.export_hf(tmp_path / "hf") / "model.safetensors"))
    params = dict(policy_engine.full_params(lambda _name, tensor: tensor.detach().to("cpu")))
    assert set(exported) <= set(params)  # the export leaves out lm_head (tied to the embeddings)
    assert all(torch.equal(exported[name], params[name]) for name in exported)
    assert (policy_engine.ranks.rank, policy_engine.ranks.size) == (0, 1)
    policy_engine.stop_followers()  # nothing to stop: the engine keeps working
    assert len(policy_engine.row_logprobs([make_row("p", [11, 12], [13, 14], [0.0, 0.0])])[0]) == 2

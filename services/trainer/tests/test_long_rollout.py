"""A coding-agent-sized rollout (its last prompt over 32k tokens) trains in one step on the tiny model.

verl's real engine on the CPU (sdpa, float32, no padding removal). The group holds a long attempt
(the resolved one) and two short ones. verl's token-count packing would put the short row beside a long one,
padded, with a dense 4D attention mask (measured: 21.5 GB and 150 s for 32k + 1k tokens); the
engine trains such a step one row per micro-batch instead (`PADDED_ROW_LIMIT`): a row alone has no
padding, transformers then passes no mask to sdpa (`is_causal`), and a 33k-token forward and
backward stays near 2 GB.
"""

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harnessrl.testkit.span_sequences import EpisodeRecorder, coding_episode
from harnessrl.trainer.advantages import AssembledRollout
from harnessrl.trainer.engine import PADDED_ROW_LIMIT, PolicyEngine
from harnessrl.trainer.samples import build_rows
from harnessrl.trainer.settings import TrainerSettings
from harnessrl.trainer.training import Trainer

pytestmark = pytest.mark.slow

LONG = 32_768
TURNS = 8  # with coding_episode's defaults the last prompt is 32,768 tokens
COMPLETION = 96


def long_episode(episode: str, rng: random.Random) -> EpisodeRecorder:
    """A task, then turns of a short model call and a long tool output; the last prompt is 32k."""
    return coding_episode("long", episode, rng, turns=TURNS, completion_tokens=COMPLETION)


def short_episode(rng: random.Random, attempt: int) -> EpisodeRecorder:
    """An attempt that gave up at once: one call."""
    return coding_episode("long", f"long-short{attempt}", rng, turns=0, completion_tokens=COMPLETION)


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def test_a_rollout_longer_than_32k_tokens_trains_in_one_step(
    policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
) -> None:
    rng = random.Random(5)
    rollouts, reports = [], {}
    for attempt, reward in enumerate((1.0, 0.0, 0.0)):
        recorder = long_episode(f"long-a{attempt}", rng) if attempt == 0 else short_episode(rng, attempt)
        rows, report = build_rows(recorder.episode, recorder.spans)
        assert len(rows) == 1 and report.trained_tokens == report.sampled_tokens
        rollout = recorder.rollout(task="t", group="g", reward=reward, group_size=3)
        rollouts.append(AssembledRollout(rollout=rollout, rows=rows))
        reports[rollout.episode] = report
    lengths = sorted(len(row.input_ids) for item in rollouts for row in item.rows)
    assert lengths[0] < PADDED_ROW_LIMIT and lengths[-1] >= LONG  # short rows beside a long one
    before = weights(policy_engine.export_hf(tmp_path / "before"))
    settings = TrainerSettings(run="long", model_dir=str(tiny_model), checkpoint_dir=str(tmp_path / "ckpt"))
    trainer = Trainer(settings, engine=policy_engine)

    result = trainer.step(rollouts, reports)

    assert result.trained, result.metrics
    values = result.metrics.values
    assert values["tokens/trained"] == values["tokens/sampled"] == (TURNS + 1 + 2) * COMPLETION
    assert values["tokens/untrained"] == 0
    after = weights(trainer.hf_dir())
    assert any(not torch.equal(before[name], after[name]) for name in before)

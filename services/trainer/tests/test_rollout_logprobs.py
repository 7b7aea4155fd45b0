"""Behaviour logprobs: what vLLM reports for the tokens it sampled is what the trainer computes.

The session's vLLM serves with `--logprobs-mode processed_logprobs` (`harnessrl.stack.vllm`): a
sampled token's logprob comes from the distribution it was drawn from, after temperature and
top-p. The trainer divides logits by the same temperature (`PolicyEngine.row_logprobs`), so at
top_p 1 the two agree within float32 noise; at top_p < 1 vLLM renormalises over the nucleus, which
the trainer does not model: that is why spans sampled with top_p < 1 are not trained.
"""

import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from transformers import AutoTokenizer

from harnessrl.stack.vllm import VllmServer
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.replica import VllmReplica
from harnessrl.trainer.samples import TrainingRow

TEMPERATURE = 0.7
TOKENS = 32
QUESTIONS = ("What is 37*52?", "What is 12*34?", "What is 90*11?", "What is 45*67?", "Hi", "2+2?")
log = logging.getLogger(__name__)


@pytest.fixture
async def replica_on_the_engine(
    vllm_server: VllmServer, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
) -> AsyncIterator[VllmServer]:
    """The session's server on the engine's current weights, restored to the original after."""
    async with VllmReplica(vllm_server.url, vllm_server.model) as replica:
        await replica.reload_from(policy_engine.export_hf(tmp_path / "engine"))
        yield vllm_server
        await replica.reload_from(tiny_model)


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
        )
        for question in QUESTIONS
    ]


async def sample(server: VllmServer, prompt: list[int], seed: int, **sampling: float) -> TrainingRow:
    """One completion of `prompt` as a training row carrying the logprobs vLLM reported."""
    body: dict[str, Any] = {
        "model": server.model, "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True,
        "logprobs": 0, "return_token_ids": True, "seed": seed, **sampling,
    }  # fmt: skip
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        choice = (await response.json())["choices"][0]
    tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    return TrainingRow(
        rollout_id=f"sample-{seed}", input_ids=[*prompt, *tokens], prompt_len=len(prompt),
        loss_mask=[1] * len(tokens), logprobs=[float(x) for x in logprobs], versions=[0] * len(tokens),
        temperature=sampling["temperature"],
    )  # fmt: skip


async def differences(
    server: VllmServer, engine: PolicyEngine, prompts: Sequence[list[int]], **sampling: float
) -> list[float]:
    """vLLM's logprob minus the trainer's (at the sampling temperature), for every sampled token."""
    rows = [await sample(server, prompt, seed, **sampling) for seed, prompt in enumerate(prompts)]
    trainer = engine.row_logprobs(rows, temperature=sampling["temperature"])
    assert all(len(row.logprobs) == TOKENS for row in rows)
    return [
        a - b
        for row, mine in zip(rows, trainer, strict=True)
        for a, b in zip(row.logprobs, mine, strict=True)
    ]


async def test_sampled_logprobs_at_temperature_07_match_the_trainers(
    replica_on_the_engine: VllmServer, policy_engine: PolicyEngine, prompts: list[list[int]]
) -> None:
    diffs = await differences(
        replica_on_the_engine, policy_engine, prompts, temperature=TEMPERATURE, top_p=1.0
    )
    worst = max(abs(d) for d in diffs)
    log.info(
        "temperature %s, top_p 1: %d tokens, max |vLLM - trainer| %s, mean %s",
        TEMPERATURE, len(diffs), f"{worst:.3g}", f"{sum(diffs) / len(diffs):.3g}",
    )  # fmt: skip
    assert 0 < worst < 1e-4


async def test_top_p_09_logprobs_are_renormalised_over_the_nucleus(
    replica_on_the_engine: VllmServer, policy_engine: PolicyEngine, prompts: list[list[int]]
) -> None:
    diffs = await differences(
        replica_on_the_engine, policy_engine, prompts, temperature=TEMPERATURE, top_p=0.9
    )
    moved = [d for d in diffs if d > 1e-4]
    log.info(
        "temperature %s, top_p 0.9: %d of %d tokens differ by > 1e-4, max %s",
        TEMPERATURE, len(moved), len(diffs), f"{max(diffs):.3g}",
    )  # fmt: skip
    assert moved  # log(p / nucleus mass) > log p wherever the nucleus left tokens out
    assert min(diffs) > -1e-4  # renormalising never lowers a kept token's logprob

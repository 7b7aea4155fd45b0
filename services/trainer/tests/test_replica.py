"""Weight sync to a real vLLM CPU replica: a reload must change what the replica computes."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harnessrl.stack.vllm import VllmServer
from harnessrl.trainer.errors import ReplicaError
from harnessrl.trainer.replica import VllmReplica, wait_serving

TOLERANCE = 2e-3
PROBE_TOKENS = 8


def reference_logprobs(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= 1, from a float32 transformers forward pass."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)[:-1]
    return logprobs.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def perturbed_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every parameter moved by N(0, 0.05), saved like a trainer checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * 0.05)
    out = tmp_path_factory.mktemp("checkpoint") / "step-1"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def probe_ids(tiny_model: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "user", "content": "What is 37*52?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return [*ids, *tokenizer.encode("CALC 37*52")]


@pytest.fixture
async def replica(vllm_server: VllmServer, tiny_model: Path) -> AsyncIterator[VllmReplica]:
    """A client for the session server; its original weights are back after the test."""
    async with VllmReplica(vllm_server.url, vllm_server.model) as client:
        yield client
        await client.resume()
        await client.reload_from(tiny_model)


async def test_reload_serves_the_new_weights(
    replica: VllmReplica, tiny_model: Path, perturbed_model: Path, probe_ids: list[int]
) -> None:
    before = await replica.probe_logprobs(probe_ids, PROBE_TOKENS)
    base_diff = (torch.tensor(before.prompt) - reference_logprobs(tiny_model, probe_ids)).abs()
    assert base_diff.max() < TOLERANCE

    await replica.reload_from(perturbed_model)
    after = await replica.probe_logprobs(probe_ids, PROBE_TOKENS)
    assert (torch.tensor(after.prompt) - torch.tensor(before.prompt)).abs().max() > 0.1
    full = [*probe_ids, *after.tokens]
    expected = reference_logprobs(perturbed_model, full)
    served = torch.tensor([*after.prompt, *after.completion])
    assert (served - expected).abs().max() < TOLERANCE

    await replica.reload_from(tiny_model)
    restored = await replica.probe_logprobs(probe_ids, PROBE_TOKENS)
    assert restored.tokens == before.tokens
    assert (torch.tensor(restored.prompt) - torch.tensor(before.prompt)).abs().max() < 1e-5


async def test_reloaded_replica_equals_a_fresh_one(
    replica: VllmReplica, perturbed_model: Path, probe_ids: list[int], tmp_path: Path
) -> None:
    """The fresh one is waited for as a trainer started beside it waits (`wait_serving`)."""
    await replica.reload_from(perturbed_model)
    reloaded = await replica.probe_logprobs(probe_ids, PROBE_TOKENS)
    fresh_server = VllmServer(perturbed_model, log_file=tmp_path / "fresh.log")
    fresh_server.launch()
    try:
        assert await wait_serving([fresh_server.url], timeout_s=0.1) == [fresh_server.url]  # starting
        assert await wait_serving([fresh_server.url], timeout_s=300) == []
        async with VllmReplica(fresh_server.url, fresh_server.model) as fresh:
            started = await fresh.probe_logprobs(probe_ids, PROBE_TOKENS)
    finally:
        fresh_server.stop()
    assert reloaded.tokens == started.tokens
    served = torch.tensor([*reloaded.prompt, *reloaded.completion])
    assert (served - torch.tensor([*started.prompt, *started.completion])).abs().max() < 1e-5


async def test_reload_frozen_switches_weights_resumes_and_leaves_the_label(
    replica: VllmReplica, perturbed_model: Path, probe_ids: list[int]
) -> None:
    await replica.set_weight_version("old")
    await replica.reload_frozen(perturbed_model)
    assert await replica.weight_info() == "old"  # labelling is the syncer's, after its probe
    assert not await replica.is_paused()
    served = await replica.probe_logprobs(probe_ids)
    expected = reference_logprobs(perturbed_model, probe_ids)
    assert (torch.tensor(served.prompt) - expected).abs().max() < TOLERANCE


async def test_weight_version_label_round_trips(replica: VllmReplica) -> None:
    await replica.set_weight_version(41)
    assert await replica.weight_info() == "41"
    await replica.set_weight_version("42")
    assert await replica.weight_info() == "42"


async def test_pause_keep_holds_requests_until_resume(replica: VllmReplica, vllm_server: VllmServer) -> None:
    await replica.pause("keep")
    assert await replica.is_paused()
    body = {"model": vllm_server.model, "prompt": [1, 2, 3], "max_tokens": 4}
    async with aiohttp.ClientSession() as http:
        request = asyncio.ensure_future(http.post(f"{vllm_server.url}/v1/completions", json=body))
        done, _ = await asyncio.wait([request], timeout=1.0)
        assert not done
        await replica.resume()
        response = await request
        assert response.status == 200
        assert (await response.json())["usage"]["completion_tokens"] > 0
    assert not await replica.is_paused()


async def test_a_replica_resumes_after_a_failed_admin_call(
    replica: VllmReplica, probe_ids: list[int]
) -> None:
    """vLLM drops the connection after a 500; the next call (here the resume) must still go through.

    (A failed *reload* can't be shown on the shared server: vLLM 0.31 leaves the model's weights
    on the meta device and its next forward kills the engine; the syncer withdraws such a replica.)
    """
    await replica.pause("keep")
    with pytest.raises(ReplicaError, match="500"):
        await replica._call("POST", "/collective_rpc", json={"method": "no_such_worker_method"})
    await replica.resume()
    assert not await replica.is_paused()
    assert len((await replica.probe_logprobs(probe_ids)).prompt) == len(probe_ids) - 1

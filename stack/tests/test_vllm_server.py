import json
import shutil
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from transformers import AutoTokenizer

from harnessrl.stack.vllm import VllmServer, VllmServerError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Solve it."},
    {"role": "user", "content": "What is 12*34?"},
    {
        "role": "assistant",
        "content": "CALC 12*34",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "echo $((12*34))"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "RESULT 408"},
]


async def _post(server: VllmServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}{path}", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result


async def _stream(server: VllmServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}{path}", json={**body, "stream": True}) as response,
    ):
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@pytest.mark.parametrize("tools", [None, TOOLS])
async def test_chat_prompt_ids_equal_transformers_template(
    vllm_server: VllmServer, tiny_model: Path, tools: list[dict[str, Any]] | None
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    expected = tokenizer.apply_chat_template(
        CONVERSATION, tools=tools, add_generation_prompt=True, return_dict=False
    )
    body: dict[str, Any] = {"model": vllm_server.model, "messages": CONVERSATION}
    if tools:
        body |= {"tools": tools, "tool_choice": "auto"}
    result = await _post(
        vllm_server, "/v1/chat/completions", body | {"max_tokens": 4, "return_token_ids": True}
    )
    assert result["prompt_token_ids"] == expected
    assert len(result["choices"][0]["token_ids"]) == result["usage"]["completion_tokens"]


async def test_chat_stream_carries_the_same_ids(vllm_server: VllmServer) -> None:
    body = {
        "model": vllm_server.model,
        "messages": CONVERSATION[:2],
        "max_tokens": 12,
        "temperature": 0,
        "return_token_ids": True,
    }
    whole = await _post(vllm_server, "/v1/chat/completions", body)
    chunks = await _stream(vllm_server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed = [i for c in chunks for choice in c["choices"] for i in choice.get("token_ids") or []]
    assert streamed == whole["choices"][0]["token_ids"]
    assert len(streamed) == 12


async def test_completions_take_token_ids_and_return_them(vllm_server: VllmServer) -> None:
    prompt = [1, 269, 201, 305, 291, 223, 19, 20]
    body = {
        "model": vllm_server.model,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    whole = await _post(vllm_server, "/v1/completions", body)
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == 6
    assert len(choice["logprobs"]["token_logprobs"]) == 6
    chunks = await _stream(vllm_server, "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    streamed = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
    assert streamed == choice["token_ids"]


def test_a_server_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    server = VllmServer(tmp_path / "no-such-model", log_file=tmp_path / "vllm.log")
    with pytest.raises(VllmServerError, match="exited") as failure:
        server.start(timeout_s=120)
    assert "no-such-model" in str(failure.value)
    assert server.process is not None
    server.stop()
    assert server.process is None


def test_the_command_asks_for_processed_logprobs_and_vllms_sampling_defaults(
    tmp_path: Path,
) -> None:
    command = VllmServer(tmp_path, port=1).command()
    flags = dict(pairwise(command))
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert flags["--generation-config"] == "vllm"


def test_the_engine_runs_its_worker_itself(vllm_server: VllmServer) -> None:
    """Two processes, not three: the API server and its engine, which holds the model's one worker
    (that the engine is forked, not spawned, is the vLLM plugin's test)."""
    assert vllm_server.process is not None
    api = psutil.Process(vllm_server.process.pid)
    tree = [api, *api.children(recursive=True)]
    live = [p for p in tree if p.status() != psutil.STATUS_ZOMBIE]
    assert len(live) == 2, [p.cmdline() for p in live]
    assert live[1].cmdline()[0] == "VLLM::EngineCore", live[1].cmdline()
    assert dict(pairwise(vllm_server.command()))["--distributed-executor-backend"] == "uni"


@pytest.fixture(scope="module")
def opinionated_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a generation_config.json that asks for peaked, truncated sampling."""
    model = tmp_path_factory.mktemp("opinionated") / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "generation_config.json").read_text())
    config |= {"temperature": 0.05, "top_p": 0.5, "top_k": 3, "do_sample": True}
    (model / "generation_config.json").write_text(json.dumps(config))
    return model


async def _sampled_and_scored(server: VllmServer, prompt: list[int], **sampling: float) -> list[float]:
    """Each sampled token's reported logprob minus its logprob at temperature 1 (prompt scoring)."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": 16, "ignore_eos": True, "seed": 3}
    sampled = await _post(
        server, "/v1/completions", body | sampling | {"logprobs": 0, "return_token_ids": True}
    )
    choice = sampled["choices"][0]
    tokens = choice["token_ids"]
    assert len(tokens) == 16
    whole = [*prompt, *tokens]
    scoring = {"model": server.model, "prompt": whole, "max_tokens": 1, "prompt_logprobs": 0}
    scored = (await _post(server, "/v1/completions", scoring))["choices"][0]["prompt_logprobs"]
    raw = [scored[len(prompt) + i][str(t)]["logprob"] for i, t in enumerate(tokens)]
    return [a - b for a, b in zip(choice["logprobs"]["token_logprobs"], raw, strict=True)]


async def test_omitted_sampling_parameters_mean_temperature_1_and_top_p_1(
    opinionated_model: Path, tmp_path: Path
) -> None:
    prompt = [1, 269, 201, 305, 291, 223, 19, 20]
    with VllmServer(opinionated_model, log_file=tmp_path / "vllm.log") as server:
        omitted = await _sampled_and_scored(server, prompt)
        cooled = await _sampled_and_scored(server, prompt, temperature=0.5)
    # Nothing given: sampled as at temperature 1 with no truncation, whatever the model's file says.
    assert max(abs(d) for d in omitted) < 1e-5
    # Temperature given: the reported logprobs are those it sampled from (processed), not raw ones.
    assert max(abs(d) for d in cooled) > 1e-2

"""The template zoo: every template renders in transformers as vLLM renders it, and does what it claims.

One vLLM serves the zoo's weights (with `--trust-request-chat-template`, so each template is
sent with the request); the prompt ids it renders must equal transformers' rendering of that zoo
model's own template, and only `plain` renders a past model turn as it was sampled. The model's
replies are read greedily (its most likely answer); each scripted harness runs against the server.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit import template_zoo
from harnessrl.testkit.template_zoo import BASH_TOOL, HARNESSES, TEMPLATES, TOOL_REPLY, Sampling

# As transformers takes it (arguments decoded, as vLLM hands them to the template) and as a client sends it.
TOOL_CALL = {"type": "function", "function": {"name": "bash", "arguments": {"command": template_zoo.COMMAND}}}
SENT_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": template_zoo.SYSTEM},
    {"role": "user", "content": template_zoo.TASK},
    {"role": "assistant", "content": template_zoo.THOUGHT, "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": template_zoo.TOOL_OUTPUT},
]


@pytest.fixture(scope="module")
def zoo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = VllmServer(
        template_zoo.zoo_model("plain"), max_model_len=2048,
        extra_args=["--trust-request-chat-template"], log_file=tmp_path_factory.mktemp("zoo") / "vllm.log",
    )  # fmt: skip
    server.start()
    yield server
    server.stop()


def rendered(model_dir: Path, messages: list[dict[str, Any]]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(
        messages, tools=[BASH_TOOL], add_generation_prompt=True, return_dict=False
    )
    return list(ids)


async def vllm_prompt(server: VllmServer, template: str, messages: list[dict[str, Any]]) -> list[int]:
    body = {
        "model": server.model, "messages": messages, "tools": [BASH_TOOL], "max_tokens": 1,
        "chat_template": TEMPLATES[template].chat_template, "return_token_ids": True,
    }  # fmt: skip
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return list((await r.json())["prompt_token_ids"])


@pytest.mark.parametrize("template", sorted(TEMPLATES))
async def test_vllm_renders_each_template_as_transformers_does_and_only_plain_keeps_the_sampled_turn(
    zoo_server: VllmServer, template: str
) -> None:
    model_dir = template_zoo.zoo_model(template)
    first, full = rendered(model_dir, CONVERSATION[:2]), rendered(model_dir, CONVERSATION)
    assert await vllm_prompt(zoo_server, template, CONVERSATION[:2]) == first
    sent = [*CONVERSATION[:2], {**CONVERSATION[2], "tool_calls": [SENT_CALL]}, CONVERSATION[3]]
    assert await vllm_prompt(zoo_server, template, sent) == full
    sampled = AutoTokenizer.from_pretrained(model_dir).encode(TOOL_REPLY, add_special_tokens=False)
    assert (full[: len(first) + len(sampled)] == first + sampled) is (TEMPLATES[template].breaks is None)
    assert (full[: len(first)] == first) is not TEMPLATES[template].rewrites_history


async def test_the_zoo_model_answers_with_a_tool_call_and_a_bash_block(zoo_server: VllmServer) -> None:
    client = AsyncOpenAI(base_url=zoo_server.url + "/v1", api_key="unused")
    messages = CONVERSATION[:2]
    tool = (await client.chat.completions.create(
        model=zoo_server.model, messages=messages, tools=[BASH_TOOL], max_tokens=64, temperature=0,  # type: ignore[arg-type]
    )).choices[0].message  # fmt: skip
    assert tool.content == template_zoo.THOUGHT
    assert [(c.function.name, c.function.arguments) for c in tool.tool_calls or []] == [
        ("bash", '{"command": "ls -la"}')
    ]
    text = (await client.chat.completions.create(
        model=zoo_server.model, messages=messages, max_tokens=64, temperature=0,  # type: ignore[arg-type]
    )).choices[0].message  # fmt: skip
    assert text.content == template_zoo.TEXT_REPLY
    await client.close()


@pytest.mark.parametrize(
    ("harness", "calls"),
    [("tool_agent", 3), ("text_agent", 3), ("compacting_agent", 3), ("retrying_agent", 4)],
)
async def test_each_harness_runs_its_script_against_vllm(
    zoo_server: VllmServer, harness: str, calls: int
) -> None:
    client = AsyncOpenAI(base_url=zoo_server.url + "/v1", api_key="unused")
    try:
        assert await HARNESSES[harness].run(client, Sampling(model=zoo_server.model, turns=3)) == calls
    finally:
        await client.close()

"""`POST /v1/messages/count_tokens` with the Anthropic SDK against the real vLLM server.

Whatever model name the client sends (as `/v1/messages`, the gateway serves the run's policy), the
count is the prompt length the Messages route sends upstream for the same body: the `prompt_len` of
the span that body produces, in token-in mode (spliced prompts included) and plain.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest
from anthropic import AsyncAnthropic

from harnessrl.shared.bus.base import Bus
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for

MODEL = "claude-sonnet-4-5"  # not a name vLLM serves
SYSTEM = [{"type": "text", "text": "You are terse."}]
BASH = {
    "name": "bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
PLAIN = {"system": SYSTEM, "messages": [{"role": "user", "content": "What is 2*3?"}]}
WITH_TOOLS = {**PLAIN, "tools": [BASH]}
TOOL_RESULT = {  # an earlier turn's thinking and tool_use, and the tool's result
    "system": SYSTEM,
    "tools": [BASH],
    "messages": [
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "ls shows them.", "signature": "sig"},
                {"type": "text", "text": "Listing them."},
                {"type": "tool_use", "id": "toolu_01", "name": "bash", "input": {"command": "ls"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.py\nb.py"}],
        },
    ],
}


@pytest.fixture(params=[True, False], ids=["token-in", "plain"])
async def gateway(
    request: pytest.FixtureRequest, vllm_server: VllmServer, bus: Bus
) -> AsyncIterator[RunningGateway]:
    settings = settings_for([vllm_server.url], served_model=vllm_server.model, token_in=request.param)
    async with serve_gateway(settings, bus) as running:
        yield running


async def counted_then_sent(client: AsyncAnthropic, body: dict[str, Any]) -> tuple[int, Any]:
    """The count for `body`, then the reply to the same body sent to `/v1/messages`."""
    counted = await client.messages.count_tokens(model=MODEL, **body)
    reply = await client.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 0.0}, **body)
    return counted.input_tokens, reply


@pytest.mark.parametrize("body", [PLAIN, WITH_TOOLS, TOOL_RESULT], ids=["plain-turn", "tools", "tool-result"])
async def test_the_count_is_the_prompt_the_messages_route_sends(
    gateway: RunningGateway, bus: Bus, episode: KeyedEpisode, body: dict[str, Any]
) -> None:
    client = AsyncAnthropic(base_url=gateway.url, api_key=episode.key, max_retries=0)
    counted, _ = await counted_then_sent(client, body)
    (span,) = await episode.spans(bus)
    assert counted == span.prompt_len > 0


async def test_a_follow_up_of_a_sampled_turn_counts_the_prompt_it_sends(
    gateway: RunningGateway, bus: Bus, episode: KeyedEpisode
) -> None:
    """In token-in mode the follow-up's prompt is spliced from the sampled turn's ids: that is counted."""
    client = AsyncAnthropic(base_url=gateway.url, api_key=episode.key, max_retries=0)
    _, first = await counted_then_sent(client, WITH_TOOLS)
    answered = [block.model_dump(exclude_none=True) for block in first.content]
    follow_up = {
        **WITH_TOOLS,
        "messages": [
            *WITH_TOOLS["messages"],
            {"role": "assistant", "content": answered or "ok"},
            {"role": "user", "content": "And 3*4?"},
        ],
    }
    counted, _ = await counted_then_sent(client, follow_up)
    spans = await episode.spans(bus)
    assert [s.seq for s in spans] == [0, 1]
    assert counted == spans[1].prompt_len > spans[0].prompt_len


@pytest.mark.parametrize(
    "body",
    [
        {"messages": "hello"},
        {"messages": [{"role": "user", "content": [{"type": "no-such-block"}]}]},
        {"system": SYSTEM},
    ],
    ids=["messages-not-a-list", "unknown-block", "no-messages"],
)
async def test_an_invalid_body_is_a_400_in_anthropics_format(
    gateway: RunningGateway, bus: Bus, episode: KeyedEpisode, body: dict[str, Any]
) -> None:
    client = AsyncAnthropic(base_url=gateway.url, api_key=episode.key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as raised:
        await client.post("/v1/messages/count_tokens", body=body, cast_to=dict)
    assert raised.value.status_code == 400
    assert raised.value.body["type"] == "error"  # type: ignore[index]
    assert raised.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert await episode.spans(bus) == []

"""Anthropic tool use through the gateway (scripted upstream: the tiny model can't call tools)."""

from __future__ import annotations

from typing import Any

from anthropic import AsyncAnthropic

from harnessrl.shared.bus.base import Bus
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import KeyedEpisode, serve_gateway, settings_for

TOOLS = [{"name": "bash", "description": "Run a command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]  # fmt: skip


def _script(path: str, body: dict[str, Any]) -> dict[str, Any]:
    if body["messages"][-1]["role"] == "tool":
        return {"content": "Done.", "finish_reason": "stop"}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls"}'}}  # fmt: skip
    return {"content": "Let me look.", "tool_calls": [call], "finish_reason": "tool_calls"}


async def test_tool_use_round_trip_streamed_and_not(bus: Bus, episode: KeyedEpisode) -> None:
    upstream = CannedUpstream(script=_script)
    await upstream.start()
    try:
        async with serve_gateway(settings_for([upstream.url]), bus) as gateway:
            client = AsyncAnthropic(base_url=gateway.url, api_key=episode.key)
            ask = [{"role": "user", "content": "List files."}]
            reply = await client.messages.create(
                model="x", max_tokens=64, tools=TOOLS, messages=ask,  # type: ignore[arg-type]
                tool_choice={"type": "auto"},
            )  # fmt: skip
            async with client.messages.stream(
                model="x",
                max_tokens=64,
                tools=TOOLS,
                messages=ask,  # type: ignore[arg-type]
            ) as stream:
                streamed = await stream.get_final_message()
            for message in (reply, streamed):
                assert message.stop_reason == "tool_use"
                kinds = [block.type for block in message.content]
                assert kinds == ["text", "tool_use"]
                tool = message.content[1]
                assert (tool.name, tool.input, tool.id) == ("bash", {"command": "ls"}, "call_1")  # type: ignore[union-attr]
            follow_up = [
                *ask,
                {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "a.txt"}]},
            ]  # fmt: skip
            final = await client.messages.create(
                model="x",
                max_tokens=64,
                tools=TOOLS,
                messages=follow_up,  # type: ignore[arg-type]
            )
            assert final.stop_reason == "end_turn"
            assert final.content[0].text == "Done."  # type: ignore[union-attr]
    finally:
        await upstream.stop()
    sent = upstream.bodies[-1]
    assert sent["tools"][0]["function"]["name"] == "bash"
    assert upstream.bodies[0]["tool_choice"] == "auto"
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool"]
    assert sent["messages"][1]["tool_calls"][0]["function"]["name"] == "bash"
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}
    spans = await episode.spans(bus)
    assert [s.api for s in spans] == ["messages"] * 3
    assert spans[2].parent_span == spans[1].span_id
    assert spans[0].completions[0].token_ids  # synthetic ids of the scripted reply were captured

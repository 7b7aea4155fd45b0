"""Claude Code, unmodified, through the gateway to vLLM on the CPU: every call a span, every token trainable.

The real `claude -p` (version `tools.CLAUDE_CODE_VERSION`) runs with only the gateway's base URL
and an episode key, plus the offline flags of `testkit.claude_code` (each one's reason beside it).
It speaks Anthropic Messages, streamed, with its own headers, beta flags, `thinking`, `metadata`,
`context_management`, `cache_control` and billing-header system block. The tiny model is
warm-started on Claude Code's own requests (`claude_code_policy`), and vLLM serves it with the
qwen3 reasoning parser and the hermes tool parser, so its first answer is a Bash call (`ls`), its
second another (`cat notes.txt`), its third a thinking block and the answer: three calls, two tool
turns (sampled, so a run may take a turn more or less).

Between the gateway and vLLM a tap records each chat request the gateway sent. Each one replayed
to vLLM directly (not streamed, same seed) gives the ids and logprobs the span must hold, and the
reasoning and tool call Claude Code must have received. The gateway's run policy samples at
temperature 0.5 with a fixed seed, which the trainer models: every sampled token, tool calls and
thinking included, carries loss in the rows the trainer's sample builder makes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from harnessrl.shared.contracts import Span
from harnessrl.shared.tokens import reconstruct_prompts
from harnessrl.stack.natsserver import NatsServer
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.claude_code import claude_code_policy, claude_command, claude_env, fresh_workdir
from harnessrl.testkit.gateway import KeyedEpisode, serve_gateway, settings_for
from harnessrl.testkit.local_app import LocalApp
from harnessrl.testkit.plugin import open_bus
from harnessrl.trainer.samples import build_rows

# The run's sampling policy (the gateway forces it on every call): sharp enough that the warm-started
# policy follows its turns, random enough to be trained on, seeded so that a replay samples the same.
log = logging.getLogger(__name__)
SAMPLING = {"temperature": 0.5, "seed": 7}
LOGPROB_TOLERANCE = 1e-4
CLAUDE_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM serving the policy warm-started on Claude Code's requests, with reasoning and tool parsers."""
    policy = claude_code_policy(tiny_model, tmp_path_factory.mktemp("claude-capture"))
    log_file = tmp_path_factory.mktemp("claude-vllm") / "vllm.log"
    server = VllmServer(policy, extra_args=["--reasoning-parser", "qwen3"], log_file=log_file)
    server.start()
    yield server
    server.stop()


class Tap:
    """A pass-through in front of vLLM that records every chat request body it forwards."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.bodies: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._forward)
        self._server = LocalApp(app)
        self.url = ""

    async def start(self) -> None:
        self.url = await self._server.start()

    async def stop(self) -> None:
        await self._server.stop()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if request.path in ("/v1/chat/completions", "/v1/completions"):
            self.bodies.append(json.loads(raw))
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                request.method, self.upstream + request.path_qs, data=raw, headers=headers
            ) as reply,
        ):
            response = web.StreamResponse(status=reply.status)
            response.content_type = reply.content_type
            await response.prepare(request)
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


async def replay(
    vllm: VllmServer, body: dict[str, Any], route: str = "/v1/chat/completions"
) -> dict[str, Any]:
    """What vLLM answers to the same request, not streamed."""
    payload = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    async with (
        aiohttp.ClientSession() as session,
        session.post(vllm.url + route, json=payload) as response,
    ):
        assert response.status == 200, await response.text()
        data: dict[str, Any] = await response.json()
        return data


def client_messages(output: bytes) -> list[dict[str, Any]]:
    """Claude Code's assistant messages as it received them (its stream-json output, one block a line)."""
    by_id: dict[str, dict[str, Any]] = {}
    for line in output.decode().splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("type") == "assistant":
            message = event["message"]
            seen = by_id.setdefault(message["id"], {**message, "content": []})
            seen["content"] += message["content"]
    return list(by_id.values())


async def run_claude(gateway_url: str, key: str, home: Path) -> tuple[int, bytes, bytes]:
    process = await asyncio.create_subprocess_exec(
        *claude_command(), cwd=fresh_workdir(), env=claude_env(gateway_url, key, home),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=CLAUDE_TIMEOUT_S)
    assert process.returncode is not None
    return process.returncode, out, err


async def claude_episode(
    served: VllmServer, nats_server: NatsServer, home: Path, *, token_in: bool
) -> dict[str, Any]:
    """One Claude Code episode through the gateway: its output, spans and the tapped requests.

    The replies are vLLM's own answers to each tapped request: chat requests in plain mode,
    completions of token ids in token-in mode (the gateway then parses reasoning and tool calls
    with the server's parsers, `qwen3` and `hermes`).
    """
    episode, tap = KeyedEpisode(), Tap(served.url)
    await tap.start()
    route = "/v1/completions" if token_in else "/v1/chat/completions"
    try:
        settings = settings_for(
            [tap.url],
            served_model=served.model,
            sampling=SAMPLING,
            token_in=token_in,
            reasoning_parser="qwen3",
        )
        async with open_bus(nats_server.url) as bus:
            async with serve_gateway(settings, bus) as gateway:
                code, out, err = await run_claude(gateway.url, episode.key, home)
            replies = [await replay(served, body, route) for body in tap.bodies]
            spans = await episode.spans(bus)
    finally:
        await tap.stop()
    lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    for message in client_messages(out):
        log.info(
            "claude code got %s",
            [(b["type"], b.get("name") or b.get("text") or b.get("thinking")) for b in message["content"]],
        )
    assert code == 0 and lines, (code, out[-2000:], err[-2000:])
    return {"result": lines[-1], "messages": client_messages(out), "spans": spans,
            "bodies": tap.bodies, "replies": replies, "episode": episode}  # fmt: skip


@pytest.fixture(scope="module")
async def episode_run(
    served: VllmServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """A plain-mode episode: each call's chat request replayed on vLLM's own chat route."""
    return await claude_episode(served, nats_server, tmp_path_factory.mktemp("claude-home"), token_in=False)


@pytest.fixture(scope="module")
async def token_in_run(
    served: VllmServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """A token-in episode (the gateway's default)."""
    return await claude_episode(served, nats_server, tmp_path_factory.mktemp("claude-home"), token_in=True)


def _reply_message(reply: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = reply["choices"][0]["message"]
    return message


async def test_claude_code_episode_is_captured_token_exact(episode_run: dict[str, Any]) -> None:
    result, spans, bodies = episode_run["result"], episode_run["spans"], episode_run["bodies"]
    messages, replies = episode_run["messages"], episode_run["replies"]
    # The episode ended cleanly: Claude Code finished its task on an end_turn answer.
    assert (result["subtype"], result["terminal_reason"], result["is_error"]) == (
        "success",
        "completed",
        False,
    )
    # Several calls, each exactly one span (and one assistant message at the client), all complete.
    assert len(bodies) >= 2, bodies
    assert len(spans) == len(bodies) == len(messages), (len(spans), len(bodies), len(messages))
    assert [s.seq for s in spans] == list(range(len(spans)))
    assert {(s.api, s.status, s.stream) for s in spans} == {("messages", "ok", True)}
    prompts = reconstruct_prompts(spans)
    for span, reply in zip(spans, replies, strict=True):
        # Token ids and logprobs equal vLLM's own for the same request.
        completion, choice = span.completions[0], reply["choices"][0]
        assert prompts[span.span_id] == reply["prompt_token_ids"]
        assert completion.token_ids == choice["token_ids"]
        expected = [item["logprob"] for item in choice["logprobs"]["content"]]
        assert completion.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
        assert completion.finish_reason == choice["finish_reason"]
    # The first call was a tool turn, the last an answer (a sampled turn between may be either).
    reasons = [s.completions[0].finish_reason for s in spans]
    assert reasons[0] == "tool_calls" and reasons[-1] == "stop", reasons


async def test_thinking_and_tool_use_reach_claude_code(episode_run: dict[str, Any]) -> None:
    """What Claude Code received is what vLLM produced: thinking text, tool names and inputs, text."""
    for message, reply in zip(episode_run["messages"], episode_run["replies"], strict=True):
        produced = _reply_message(reply)
        blocks = message["content"]
        thinking = [b["thinking"] for b in blocks if b["type"] == "thinking"]
        assert thinking == ([produced["reasoning"]] if produced.get("reasoning") else []), blocks
        assert all(b.get("signature") for b in blocks if b["type"] == "thinking"), blocks
        calls = [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
        expected = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in produced.get("tool_calls") or []
        ]
        assert calls == expected, (blocks, produced)
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        assert text == (produced.get("content") or ""), (blocks, produced)
    kinds = [[b["type"] for b in message["content"]] for message in episode_run["messages"]]
    assert kinds[0] == ["tool_use"] and episode_run["messages"][0]["content"][0]["name"] == "Bash", kinds
    assert ["thinking", "text"] in kinds, kinds  # the answer, thought through first


async def test_tool_turns_carry_loss(episode_run: dict[str, Any]) -> None:
    """The trainer's sample builder trains every sampled token: thinking, tool calls and the answer."""
    spans: list[Span] = episode_run["spans"]
    rows, report = build_rows(episode_run["episode"].episode, spans)
    assert report.sampled_tokens == sum(len(s.completions[0].token_ids) for s in spans)
    assert report.untrained_tokens == 0 and report.trained_tokens == report.sampled_tokens, report
    tool_tokens = sum(
        len(s.completions[0].token_ids) for s in spans if s.completions[0].finish_reason == "tool_calls"
    )
    assert tool_tokens > 0 and sum(row.trained_tokens for row in rows) == report.trained_tokens
    assert {row.temperature for row in rows} == {SAMPLING["temperature"]}


async def test_token_in_episode_is_one_row_of_vllm_sampled_ids(token_in_run: dict[str, Any]) -> None:
    """Token-in (the default): each call extends the last, the episode trains as one row, every id
    and logprob is vLLM's own for the tapped token prompt, and Claude Code got the thinking and
    tool calls the gateway parsed out of the sampled text."""
    result, spans, bodies = token_in_run["result"], token_in_run["spans"], token_in_run["bodies"]
    assert (result["subtype"], result["is_error"]) == ("success", False), result
    assert len(spans) == len(bodies) == len(token_in_run["messages"]) >= 2, (len(spans), len(bodies))
    assert [s.token_in for s in spans] == ["fresh"] + ["extended"] * (len(spans) - 1)
    prompts = reconstruct_prompts(spans)
    for span, body, reply in zip(spans, bodies, token_in_run["replies"], strict=True):
        completion, choice = span.completions[0], reply["choices"][0]
        assert prompts[span.span_id] == body["prompt"] and body["skip_special_tokens"] is False
        assert completion.token_ids == choice["token_ids"]
        assert completion.logprobs == pytest.approx(
            choice["logprobs"]["token_logprobs"], abs=LOGPROB_TOLERANCE
        )
    rows, report = build_rows(token_in_run["episode"].episode, spans)
    assert len(rows) == 1 and report.untrained_tokens == 0, report
    for message, reply in zip(token_in_run["messages"], token_in_run["replies"], strict=True):
        text, blocks = reply["choices"][0]["text"], message["content"]
        thinking = [b["thinking"] for b in blocks if b["type"] == "thinking"]
        assert thinking == (
            [text.split("</think>")[0].removeprefix("<think>").strip()] if "</think>" in text else []
        )
        names = [json.loads(call.split("</tool_call>")[0])["name"] for call in text.split("<tool_call>")[1:]]
        assert [b["name"] for b in blocks if b["type"] == "tool_use"] == names, (blocks, text)
    kinds = [[b["type"] for b in message["content"]] for message in token_in_run["messages"]]
    assert kinds[0] == ["tool_use"] and ["thinking", "text"] in kinds, kinds

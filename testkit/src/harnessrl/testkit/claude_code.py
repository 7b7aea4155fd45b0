"""Claude Code, unmodified, against the gateway: how tests run it, and a tiny policy that drives it.

`claude -p` runs with only `ANTHROPIC_BASE_URL` and `ANTHROPIC_API_KEY` plus what a user sets to
run it offline against a small local model (`FLAGS`, `ENV`; each one's reason beside it).

The tiny model can't use a tool by itself, so `claude_code_policy` warm-starts it on Claude Code's
own requests: the real program runs once against a recorder that answers with the scripted turns
(`TURNS`: `ls`; `cat notes.txt`; think, then answer), each request is converted to the chat request
the gateway sends vLLM (`anthropic.to_chat_request`), and the policy learns to answer each with its
turn, written the way the model samples it (`<think>`, hermes `<tool_call>`). Served with vLLM's
qwen3 reasoning parser and hermes tool parser, it sends Claude Code a thinking block, tool calls
and an answer. The result is cached per machine, keyed on what decides it (base model, Claude Code
version and flags, the turns, the sources that build it); the requests themselves carry the
working directory and today's date, so the working directory is one fixed path (`WORKDIR`).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from aiohttp import web

from harnessrl.gateway import anthropic
from harnessrl.shared.cache import build_once, cache_root
from harnessrl.testkit.local_app import LocalApp
from harnessrl.testkit.policies import fingerprint
from harnessrl.testkit.tools import CLAUDE_CODE

MODEL = "tiny"
TASK = "Read the note in this folder and tell me what it says."
NOTE = "The answer is 42."
ANSWER = f"The note says: {NOTE}"
WORKDIR = Path(tempfile.gettempdir()) / "harnessrl-claude-code" / "work"
FLAGS = (
    "--bare",  # no hooks, plugins, CLAUDE.md or background prefetches; its default system prompt is one line
    "--model", MODEL,  # the served model's name (any name works; the gateway maps it to the served one)
    "--tools", "Bash",  # the default 12 tools are ~48 KB of JSON, past the tiny model's 16k-token context
    "--allowedTools", "Bash",  # -p denies unapproved tools; --dangerously-skip-permissions refuses root
    "--output-format", "stream-json", "--verbose",  # each message as the client received it, blocks included
    "--no-session-persistence",  # nothing saved under HOME
)  # fmt: skip
ENV = {
    # No telemetry, error reports, update checks or connectivity probes (`HEAD /api/hello`).
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    # Claude Code asks for max_tokens 32000, more than the tiny model's whole context.
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
}
WARM_STEPS, WARM_LR = 150, "6e-3"


class Turn(NamedTuple):
    """One scripted assistant turn: its Anthropic content blocks and the text the model samples for it."""

    blocks: list[dict[str, Any]]
    sampled: str


def _bash(command: str, call_id: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": "Bash", "input": {"command": command}}


def _tool_text(command: str) -> str:
    arguments = json.dumps({"command": command})
    return f'<tool_call>\n{{"name": "Bash", "arguments": {arguments}}}\n</tool_call>'


# The thinking comes in the last turn: an earlier turn is also rendered (as the template re-renders it,
# without reasoning) in the later turns' demonstrations, which would teach it both ways.
THOUGHT = "I read the note."
TURNS = (
    Turn([_bash("ls", "toolu_1")], _tool_text("ls")),
    Turn([_bash("cat notes.txt", "toolu_2")], _tool_text("cat notes.txt")),
    Turn([{"type": "thinking", "thinking": THOUGHT, "signature": "s"}, {"type": "text", "text": ANSWER}],
         f"<think>{THOUGHT}</think>{ANSWER}"),
)  # fmt: skip


def claude_command(task: str = TASK) -> list[str]:
    """The command line of one Claude Code run."""
    return [str(CLAUDE_CODE), "-p", task, *FLAGS]


def claude_env(base_url: str, key: str, home: Path) -> dict[str, str]:
    """Claude Code's whole environment: a temp HOME, the gateway's base URL and the episode key."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": key, **ENV}  # fmt: skip


def fresh_workdir() -> Path:
    """`WORKDIR`, emptied, holding only the note."""
    shutil.rmtree(WORKDIR, ignore_errors=True)
    WORKDIR.mkdir(parents=True)
    (WORKDIR / "notes.txt").write_text(NOTE + "\n")
    return WORKDIR


_EMPTY: dict[str, dict[str, Any]] = {
    "text": {"text": ""},
    "thinking": {"thinking": "", "signature": ""},
    "tool_use": {"input": {}},
}


def _deltas(block: dict[str, Any]) -> list[dict[str, Any]]:
    if block["type"] == "tool_use":
        return [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
    if block["type"] == "thinking":
        return [{"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]}]  # fmt: skip
    return [{"type": "text_delta", "text": block["text"]}]


def _sse(turn: Turn, number: int) -> bytes:
    """A scripted turn as Anthropic's stream events (each block started empty, then its deltas)."""
    message: dict[str, Any] = {"id": f"msg_{number}", "type": "message", "role": "assistant", "model": MODEL}
    message |= {"content": [], "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": message}]
    for index, block in enumerate(turn.blocks):
        start = {**block, **_EMPTY[block["type"]]}
        events.append({"type": "content_block_start", "index": index, "content_block": start})
        events += [{"type": "content_block_delta", "index": index, "delta": d} for d in _deltas(block)]
        events.append({"type": "content_block_stop", "index": index})
    stop = "tool_use" if turn.blocks[-1]["type"] == "tool_use" else "end_turn"
    events.append({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                   "usage": {"output_tokens": 1}})  # fmt: skip
    events.append({"type": "message_stop"})
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


async def capture_requests(home: Path) -> list[dict[str, Any]]:
    """Run the real Claude Code against a recorder that answers with `TURNS`; its Messages requests."""
    seen: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_sse(TURNS[min(len(seen), len(TURNS)) - 1], len(seen)))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/messages", answer)
    async with LocalApp(app) as url:
        process = await asyncio.create_subprocess_exec(
            *claude_command(), cwd=fresh_workdir(), env=claude_env(url, "recorder", home),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await asyncio.wait_for(process.wait(), timeout=120)
    if len(seen) != len(TURNS):
        raise RuntimeError(f"Claude Code made {len(seen)} calls against the recorder, not {len(TURNS)}")
    return seen


def demonstrations(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each captured request as the chat request the gateway sends, answered with its turn."""
    demos = []
    for request, turn in zip(requests, TURNS, strict=True):
        chat = anthropic.to_chat_request(copy.deepcopy(request))
        messages = [*chat["messages"], {"role": "assistant", "content": turn.sampled}]
        demos.append({"messages": messages, "tools": chat["tools"]})
    return demos


def claude_code_policy(tiny_model: Path, home: Path) -> Path:
    """The tiny model warm-started to drive Claude Code through `TURNS` (built once per machine).

    Keyed on the demonstrations (today's date left out), so a change in what Claude Code sends or in
    how the gateway converts it makes a new policy.
    """
    from harnessrl.trainer import warmstart

    demos = demonstrations(asyncio.run(capture_requests(home)))
    lines = "".join(json.dumps(d) + "\n" for d in demos)
    args = ["--steps", str(WARM_STEPS), "--batch", str(len(TURNS)), "--lr", WARM_LR, "--threads", "2"]
    digest = hashlib.sha256(re.sub(r"Date: [0-9-]+", "Date:", lines).encode() + " ".join(args).encode())
    target = cache_root() / "claude-code-policy" / fingerprint(digest, tiny_model, [Path(warmstart.__file__)])

    def build(staging: Path) -> None:
        (staging / "demos.jsonl").write_text(lines)
        warm = [sys.executable, "-m", "harnessrl.trainer.warmstart", "--model", str(tiny_model),
                "--demos", str(staging / "demos.jsonl"), "--out", str(staging), *args]  # fmt: skip
        subprocess.run(warm, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    return build_once(target, build, done="config.json")

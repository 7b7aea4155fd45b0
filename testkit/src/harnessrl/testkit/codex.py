"""Codex CLI for tests: the pinned, unmodified `codex exec` against a base URL, and a policy driving it.

`run_codex` gives Codex a fresh work dir and CODEX_HOME whose config.toml defines one model provider
(`wire_api = "responses"`, the given base URL, the key read from `KEY_ENV`), and shortens the prompt
for the tiny model: a one-line instructions file instead of the 11k-token base instructions, no
skills instructions, and the sub-agent, goal and image tools off (together about 10k tokens of
schema). The tiny model's warm start on 2 cores can't afford a 16k-token prompt; the gateway can
(its rendering matches vLLM's own at that length too). The program itself is unchanged.
`codex_policy` warm-starts the tiny model on Codex's own first two requests
(captured against a recorder): the first answered with parallel `exec_command` calls (`COMMANDS`), the
second with `FINAL`. The policy has sliding-window attention (`WINDOW`) in both layers, so training on
the last `CONTEXT` prompt tokens is exact and takes minutes, not hours, on 2 cores. It is cached per
machine, keyed on the captured requests (minus what the commands printed) and the training code.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

from aiohttp import web

from harnessrl.gateway.responses import to_chat_request
from harnessrl.shared.cache import build_once, cache_root
from harnessrl.testkit.local_app import LocalApp
from harnessrl.testkit.policies import fingerprint
from harnessrl.testkit.tools import CODEX, CODEX_VERSION

TASK = "write hi to out.txt"
COMMANDS = ("echo hi > out.txt", "ls")
FINAL = "done"
CALLS = 2  # the policy's episode: the parallel calls, then FINAL
KEY_ENV = "HARNESSRL_EPISODE_KEY"
# Codex's prompt holds its working directory and CODEX_HOME paths: fixed ones keep the captured
# requests (and so the warm start's cache key) the same from run to run.
PLACE = cache_root() / f"codex-{CODEX_VERSION}-run"
# The policy attends to the last WINDOW tokens in each of its 2 layers: the answer depends on the
# CONTEXT prompt tokens before it and nothing further back (a margin covers off-by-one windows).
WINDOW = 256
CONTEXT = 2 * WINDOW + 8
WARM_STEPS, WARM_LR = 120, 5e-3


# Codex's own base instructions (11k tokens) and skills instructions (2k) outgrow what the tiny
# model's warm start can afford on 2 cores: a short instructions file stands in for them.
INSTRUCTIONS = "You are a coding agent. Run shell commands with exec_command.\n"


def codex_config(base_url: str, home: Path) -> str:
    """config.toml: the gateway as the one model provider (its key read from `KEY_ENV`), a short prompt."""
    return f"""model = "policy"
model_provider = "gateway"
model_instructions_file = "{home / "instructions.md"}"
check_for_update_on_startup = false

[analytics]
enabled = false

[features]
multi_agent = false
goals = false
view_image = false

[skills]
include_instructions = false

[model_providers.gateway]
name = "harnessrl gateway"
base_url = "{base_url}"
env_key = "{KEY_ENV}"
wire_api = "responses"
"""


async def run_codex(base_url: str, key: str) -> subprocess.CompletedProcess[str]:
    """Run `codex exec TASK` in a fresh work dir with a fresh CODEX_HOME pointing at `base_url`."""
    work, home = PLACE / "work", PLACE / "home"
    for folder in (work, home):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    (home / "instructions.md").write_text(INSTRUCTIONS)
    (home / "config.toml").write_text(codex_config(base_url, home))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home), KEY_ENV: key}
    process = await asyncio.create_subprocess_exec(
        str(CODEX),
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        TASK,
        cwd=work,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=240)
    return subprocess.CompletedProcess(
        [str(CODEX)], -1 if process.returncode is None else process.returncode, out.decode(), err.decode()
    )


def _events(*events: dict[str, Any]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


async def capture_requests() -> list[dict[str, Any]]:
    """Codex's own requests, against a recorder answering as the policy should: two calls, then FINAL."""
    seen: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        n = len(seen)
        items: list[dict[str, Any]]
        if n == 1:
            items = [
                {
                    "type": "function_call",
                    "id": f"fc{i}",
                    "call_id": f"call_{i}",
                    "name": "exec_command",
                    "arguments": json.dumps({"cmd": c}),
                    "status": "completed",
                }
                for i, c in enumerate(COMMANDS)
            ]
        else:
            part = {"type": "output_text", "text": FINAL, "annotations": []}
            items = [
                {"type": "message", "id": "m", "role": "assistant", "status": "completed", "content": [part]}
            ]
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        done = [
            {"type": "response.output_item.done", "output_index": i, "item": item}
            for i, item in enumerate(items)
        ]
        usage = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}
        final = {"type": "response.completed", "response": {"id": f"r{n}", "output": items, "usage": usage}}
        await response.write(_events({"type": "response.created", "response": {"id": f"r{n}"}}, *done, final))
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", answer)
    async with LocalApp(app) as url:
        result = await run_codex(f"{url}/v1", "recorder-key")
    if result.returncode != 0 or len(seen) != CALLS:
        raise RuntimeError(
            f"codex exited {result.returncode} after {len(seen)} calls: {result.stderr[-2000:]}"
        )
    return seen


def hermes_calls(commands: tuple[str, ...]) -> str:
    """The policy's answer to the first request: parallel `exec_command` calls in the hermes format."""
    calls = [json.dumps({"name": "exec_command", "arguments": {"cmd": c}}) for c in commands]
    return "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the template sees it (vLLM joins text parts with newlines)."""
    content = message.get("content")
    if isinstance(content, list):
        message = {**message, "content": "\n".join(p["text"] for p in content)}
    return message


def as_rendered(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as vLLM hands them to a template that knows no `developer` role.

    vLLM (`renderers.hf`) turns developer messages into system ones and merges all system messages
    into one at the front (joined by a blank line); the warm start must render what vLLM renders.
    """
    plain = [_plain({**m, "role": "system"} if m["role"] == "developer" else m) for m in messages]
    system = [m for m in plain if m["role"] == "system"]
    if len(system) < 2 and (not system or plain[0]["role"] == "system"):
        return plain
    merged = {"role": "system", "content": "\n\n".join(m["content"] for m in system if m["content"])}
    return [merged, *(m for m in plain if m["role"] != "system")]


def demonstrations(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One demonstration per captured request, rendered to chat as the gateway sends it to vLLM."""
    answers = (hermes_calls(COMMANDS), FINAL)
    demos = []
    for request, answer in zip(requests, answers, strict=True):
        chat = to_chat_request(dict(request))
        messages = as_rendered(chat["messages"])
        demos.append(
            {"messages": [*messages, {"role": "assistant", "content": answer}], "tools": chat["tools"]}
        )
    return demos


class CodexPolicy(NamedTuple):
    """The warm-started policy and the Codex requests it was taught to answer."""

    model: Path
    requests: list[dict[str, Any]]


def windowed_copy(tiny_model: Path, out: Path) -> None:
    """The tiny model with sliding-window attention (`WINDOW` tokens) in every layer, into `out`."""
    for path in tiny_model.iterdir():
        if path.is_file():
            shutil.copy(path, out / path.name)
    config = json.loads((out / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=layers,
                  layer_types=["sliding_attention"] * layers)  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


def warm_start(model_dir: Path, demos: list[dict[str, Any]]) -> None:
    """Imitate `demos` in place: each trained on its answer and the `CONTEXT` prompt tokens before it.

    With every layer windowed, nothing further back can reach the answer, so this is exactly the
    computation vLLM does on the whole prompt, at a fraction of the cost (Codex's prompt is 3k tokens).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harnessrl.trainer.warmstart import render

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = []
    for demo in demos:
        ids, mask = render(tokenizer, demo["messages"], demo["tools"])
        start = max(0, mask.index(1) - CONTEXT)
        rows.append((torch.tensor([ids[start:]]), torch.tensor([mask[start:]], dtype=torch.float32), start))
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_LR, weight_decay=0.0)
    model.train()
    for _ in range(WARM_STEPS):
        optimizer.zero_grad(set_to_none=True)
        for tokens, weights, start in rows:
            positions = torch.arange(start, start + tokens.shape[1]).unsqueeze(0)
            logits = model(input_ids=tokens, position_ids=positions).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
            loss = (nll * weights[:, 1:]).sum() / weights[:, 1:].sum()
            loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    model.save_pretrained(model_dir, safe_serialization=True)


def _without_outputs(demo: dict[str, Any]) -> dict[str, Any]:
    messages = [{**m, "content": ""} if m["role"] == "tool" else m for m in demo["messages"]]
    return {**demo, "messages": messages}


def codex_policy(tiny_model: Path) -> CodexPolicy:
    """The tiny model warm-started on Codex's own two requests (built once per machine and input).

    Codex runs against the recorder each time (seconds): its requests are the cache key, so a change
    in Codex's prompt or tools builds a new policy.
    """
    requests = asyncio.run(capture_requests())
    demos = demonstrations(requests)
    # What the commands printed (a random chunk id, a wall time, what `ls` saw of the parallel `echo`)
    # varies from run to run and doesn't decide the policy: it is left out of the key.
    stable = "\n".join(json.dumps(_without_outputs(d)) for d in demos).encode()
    training = inspect.getsource(windowed_copy) + inspect.getsource(warm_start)
    settings = f"{WINDOW} {CONTEXT} {WARM_STEPS} {WARM_LR}"
    digest = hashlib.sha256(stable + training.encode() + settings.encode())
    target = cache_root() / "codex-policy" / fingerprint(digest, tiny_model, [])

    def build(staging: Path) -> None:
        windowed_copy(tiny_model, staging)
        warm_start(staging, demos)

    return CodexPolicy(build_once(target, build, done="model.safetensors"), requests)

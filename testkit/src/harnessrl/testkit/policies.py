"""Warm-started tiny policies that tests train from, each built once per machine.

A random tiny model learns nothing a test can see in a few steps, so tests start from a short
supervised warm start. It takes minutes on 2 cores; the result is cached under the machine cache,
keyed on everything that decides it (the base model's files, the demonstrations or settings, the
sources that train it), so a changed input builds a new policy.

- `demo_warm_start`: what `make demo` leaves in `.harnessrl/demo/warm` (the demo's own warm start).
- `tool_calling_policy`: the tiny model warm-started on mini-swe-agent's own first request for two
  tinyswe tasks, with two demonstrations per task: a bash tool call that makes exactly the task's
  gold one-line fix (a `sed -i` derived from the gold patch and checked against it) and a harmless
  `echo x >> NOTES.md`. Sampled at temperature 1 it solves some attempts and not others, so GRPO
  groups have reward variance.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web

from harnessrl.reward.tinyswe.build import ensure_tinyswe, load_instances
from harnessrl.shared.cache import build_once, cache_root
from harnessrl.stack.demo.swe_demos import MINI_ENV
from harnessrl.stack.demo.swe_tasks import place_tasks
from harnessrl.testkit.local_app import LocalApp
from harnessrl.testkit.tools import MINI_SWE_AGENT

ECHO = "echo x >> NOTES.md"
# Two tasks (different repositories) whose gold fix changes one short line, in code with no loop (a
# broken sample of the fix cannot make the graded tests hang).
TASK_IDS = ("tinyswe__calc-0004", "tinyswe__structkit-0004")
# Warm start: all 4 demonstrations in every batch (so the two behaviours of a task stay balanced).
# 130 steps at this rate bring each demonstration's whole sequence to probability ~0.4 (measured:
# the loss plateaus for ~80 steps, then drops): about 3 minutes with 2 threads on 2 cores.
WARM_STEPS, WARM_LR = 130, "6e-3"
# A demonstration for the warm start: {"messages": [...], "tools": [...]}.
Demo = dict[str, Any]


class ToolCallingPolicy:
    """The warm-started policy with what it was taught: the task rows, their fixes, the demonstrations."""

    def __init__(
        self, rows: list[dict[str, Any]], fixes: dict[str, str], demos: dict[str, Demo], model: Path
    ) -> None:
        self.rows, self.fixes, self.demos, self.model = rows, fixes, demos, model


def fingerprint(digest: Any, model: Path, sources: list[Path]) -> str:
    """`digest` (a hashlib object) updated with a model folder's files and source files; its hex key."""
    for source in sources:
        digest.update(source.read_bytes())
    for path in sorted(p for p in model.iterdir() if p.is_file()):
        digest.update(path.name.encode() + path.read_bytes())
    return str(digest.hexdigest()[:16])


def demo_warm_start(tiny_model: Path) -> Path:
    """The demo's warm-started policy (`make demo`'s `.harnessrl/demo/warm`), built by the demo itself."""
    from harnessrl.stack.demo import run, tasks
    from harnessrl.trainer import warmstart

    settings = run.DemoSettings()
    digest = hashlib.sha256(f"{settings.warm_steps} {settings.warm_examples}".encode())
    sources = [Path(str(module.__file__)) for module in (run, tasks, warmstart)]
    target = cache_root() / "demo-warm" / fingerprint(digest, tiny_model, sources)
    build_once(
        target, lambda staging: run.warm_start(staging, tiny_model, settings), done="demo/warm/config.json"
    )
    return target / "demo" / "warm"


def tool_call(command: str) -> str:
    """A hermes-style bash tool call, as the policy writes it."""
    arguments = json.dumps({"command": command})
    return f'<tool_call>\n{{"name": "bash", "arguments": {arguments}}}\n</tool_call>'


def changed_lines(patch: str) -> list[str]:
    """The removed and added lines of a unified diff (headers left out)."""
    return [line for line in patch.splitlines() if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))]


def fix_command(patch: str) -> str:
    """A `sed -i` command that makes the one-line change of `patch` (a gold patch)."""
    path = re.findall(r"^\+\+\+ b/(\S+)$", patch, flags=re.MULTILINE)
    lines = changed_lines(patch)
    if not (len(path) == 1 and len(lines) == 2 and lines[0][0] == "-" and lines[1][0] == "+"):
        raise ValueError(f"not a one-line change of one file:\n{patch}")
    old = re.sub(r"([\\/.*\[\]^$])", r"\\\1", lines[0][1:].strip())
    new = re.sub(r"([\\/&])", r"\\\1", lines[1][1:].strip())
    return f"sed -i {shlex.quote(f's/{old}/{new}/')} {path[0]}"


def check_fix(repo: Path, row: dict[str, Any], command: str) -> None:
    """Run `command` in a fresh clone of `repo` at the base commit: its diff must be the gold change."""
    with tempfile.TemporaryDirectory(prefix="fix-") as tmp:
        subprocess.run(["git", "clone", "-q", str(repo), tmp], check=True)
        subprocess.run(["git", "checkout", "-q", row["base_commit"]], cwd=tmp, check=True)
        subprocess.run(["sh", "-c", command], cwd=tmp, check=True)
        diff = subprocess.run(["git", "diff"], cwd=tmp, check=True, capture_output=True, text=True).stdout
    if changed_lines(diff) != changed_lines(row["patch"]):
        raise ValueError(f"{command} does not make the gold change; it made:\n{diff}")


async def capture_first_request(task: str, workdir: Path) -> dict[str, Any]:
    """Run the real mini-swe-agent against a recorder that answers with the submit command."""
    seen: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(await request.json())
        command = ECHO if len(seen) == 1 else "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
        arguments = json.dumps({"command": command})
        function = {"name": "bash", "arguments": arguments}
        call = {"id": f"c{len(seen)}", "type": "function", "function": function}
        message = {"role": "assistant", "content": "", "tool_calls": [call]}
        choice = {"index": 0, "finish_reason": "tool_calls", "message": message}
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        body = {"id": "x", "object": "chat.completion", "created": 0, "model": "policy"}
        return web.json_response({**body, "choices": [choice], "usage": usage})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with LocalApp(app) as url:
        env = {**os.environ, **MINI_ENV, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "k"}
        process = await asyncio.create_subprocess_exec(
            str(MINI_SWE_AGENT), "-m", "openai/policy", "-t", task, "-y", "--exit-immediately", cwd=workdir,
            env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await asyncio.wait_for(process.wait(), timeout=120)
    return seen[0]


def demonstrations(home: Path, rows: list[dict[str, Any]], fixes: dict[str, str]) -> dict[str, Demo]:
    """A fix and an echo per task, each answering mini-swe-agent's own first request for the task.

    Each row's `repo_path` is relative to `home`.
    """
    demos: dict[str, Demo] = {}
    for row in rows:
        check_fix(home / row["repo_path"], row, fixes[row["instance_id"]])
        first = asyncio.run(capture_first_request(row["problem_statement"], home))
        for kind, command in (("fix", fixes[row["instance_id"]]), ("echo", ECHO)):
            messages = [*first["messages"], {"role": "assistant", "content": tool_call(command)}]
            demos[f"{row['instance_id']}/{kind}"] = {"messages": messages, "tools": first["tools"]}
    return demos


def warm_start(tiny_model: Path, demos: dict[str, Demo]) -> Path:
    """The tiny model warm-started on `demos`, trained once per machine (it takes minutes).

    The cache key is everything that decides the result: the base model's files, the demonstrations
    (so a change in mini-swe-agent's prompt makes a new policy), the arguments and the warm-start
    module's source.
    """
    from harnessrl.trainer import warmstart

    lines = "\n".join(json.dumps(d) for d in demos.values()).encode()
    args = ["--steps", str(WARM_STEPS), "--batch", str(len(demos)), "--lr", WARM_LR, "--threads", "2"]
    digest = hashlib.sha256(lines + " ".join(args).encode())
    target = cache_root() / "mswea-policy" / fingerprint(digest, tiny_model, [Path(warmstart.__file__)])

    def build(staging: Path) -> None:
        (staging / "demos.jsonl").write_bytes(lines)
        warm = [sys.executable, "-m", "harnessrl.trainer.warmstart", "--model", str(tiny_model),
                "--demos", str(staging / "demos.jsonl"), "--out", str(staging), *args]  # fmt: skip
        subprocess.run(warm, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    return build_once(target, build, done="config.json")


def tool_calling_policy(tiny_model: Path, home: Path) -> ToolCallingPolicy:
    """The tinyswe tasks of `TASK_IDS`, their gold fixes, the demonstrations and the warm-started policy."""
    root = ensure_tinyswe()
    by_id = {row["instance_id"]: row for row in load_instances(root)}
    # Rows of a task file in `home`: their repositories copied under it.
    rows = place_tasks([dict(by_id[i], repo_path=str(root / by_id[i]["repo_path"])) for i in TASK_IDS], home)
    fixes = {row["instance_id"]: fix_command(row["patch"]) for row in rows}
    demos = demonstrations(home, rows, fixes)
    return ToolCallingPolicy(rows, fixes, demos, warm_start(tiny_model, demos))

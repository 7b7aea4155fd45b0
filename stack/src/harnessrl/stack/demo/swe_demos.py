"""mini-swe-agent for the coding demo: its configuration, its command line and captured demonstrations.

The program is the unmodified `mini` from PyPI; what the demo sets is configuration, through its
own `-c` files: a short system and instance template (the tiny model's context is small and the
CPU is slow), a wide terminal for pytest's summary line and no third-party pytest plugins.

Demonstrations are captured from the real program: it runs in a checkout of a training instance
against a recorder that answers with scripted bash tool calls (look: run the tests; act: the fix
and the submit command), and every request it sends is kept. A demonstration is the last request's
messages plus the scripted last answer, in exactly the format mini-swe-agent sends through the
gateway. Failed trajectories (a wrong edit) are captured the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web

from harnessrl.shared.cache import cache_root
from harnessrl.stack.demo.swe_tasks import (
    TEST_COMMAND,
    TESTS,
    SweInstanceSpec,
    edit_command,
    expectation,
    problem_statement,
)

# Where `scripts/tools.sh` installs mini-swe-agent 2.4.6 (its own environment).
MINI_SWE_AGENT = cache_root() / "harness-mini-swe-agent-2.4.6" / "bin" / "mini"

# What mini-swe-agent needs to run non-interactively, offline.
MINI_ENV = {
    "MSWEA_CONFIGURED": "true",
    "MSWEA_COST_TRACKING": "ignore_errors",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}
CONFIG = """\
agent:
  system_template: |
    You fix bugs with bash.
  instance_template: |
    {{task}}
    Submit with `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`.
  step_limit: STEP_LIMIT
environment:
  env: AGENT_ENV
"""
# The environment of the agent's commands. pytest prints whole assertion messages in its "CI mode"
# (any non-empty CI or BUILD_NUMBER), so the failing line would differ from the demonstrations'
# when the demo runs under CI: both are set empty.
AGENT_ENV = {
    "COLUMNS": "150",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "CI": "",
    "BUILD_NUMBER": "",
}
STEP_LIMIT = 3
MAX_TOKENS = 192
Demo = dict[str, Any]


def write_config(path: Path, step_limit: int = STEP_LIMIT) -> Path:
    """The demo's mini-swe-agent configuration file (applied on top of its own `mini.yaml`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CONFIG.replace("STEP_LIMIT", str(step_limit)).replace("AGENT_ENV", json.dumps(AGENT_ENV)))
    return path


def mini_options(config: Path, temperature: float) -> list[str]:
    """The `mini` flags of one non-interactive episode."""
    return [
        "-c", "mini.yaml", "-c", str(config), "-c", f"model.model_kwargs.temperature={temperature}",
        "-c", f"model.model_kwargs.max_tokens={MAX_TOKENS}", "-y", "--exit-immediately",
    ]  # fmt: skip


def harness_command(mini: Path, config: Path, temperature: float) -> list[str]:
    """The episode's command: `mini` on the task, with this Python's pytest first on PATH."""
    options = " ".join(mini_options(config, temperature))
    python_bin = Path(sys.executable).parent
    script = f'PATH={python_bin}:$PATH exec {mini} -m openai/policy -t "$HARNESSRL_TASK" {options}'
    script += " -o ../trajectory.json"
    return ["sh", "-c", script]


def wrong_fix(spec: SweInstanceSpec) -> str:
    """A failed trajectory's edit: the right substitution, run on the tests instead of the code."""
    return edit_command(spec.old, spec.new, TESTS)


def tool_call(command: str) -> str:
    """A hermes-style bash tool call, as the policy writes it."""
    arguments = json.dumps({"command": command})
    return f'<tool_call>\n{{"name": "bash", "arguments": {arguments}}}\n</tool_call>'


def _answer(command: str, n: int) -> dict[str, Any]:
    function = {"name": "bash", "arguments": json.dumps({"command": command})}
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": f"c{n}", "type": "function", "function": function}],
    }
    choice = {"index": 0, "finish_reason": "tool_calls", "message": message}
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "policy"}
    return {**body, "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}


async def capture(
    mini: Path, config: Path, task: str, workdir: Path, commands: list[str]
) -> list[dict[str, Any]]:
    """Run the real mini-swe-agent in `workdir`, answering with `commands`; every request it sent."""
    seen: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(_answer(commands[min(len(seen), len(commands)) - 1], len(seen)))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    env = {**os.environ, **MINI_ENV, "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": "k"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    try:
        process = await asyncio.create_subprocess_exec(
            str(mini), "-m", "openai/policy", "-t", task, *mini_options(config, 1.0),
            "-o", str(workdir.parent / "t.json"),
            cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await asyncio.wait_for(process.wait(), timeout=120)
    finally:
        await runner.cleanup()
    return seen


def checkout(row: dict[str, Any], dest: Path) -> Path:
    """A fresh clone of the instance's repository at its base commit."""
    subprocess.run(["git", "clone", "-q", row["repo_path"], str(dest)], check=True)
    subprocess.run(["git", "checkout", "-q", row["base_commit"]], cwd=dest, check=True)
    return dest


def trajectory(mini: Path, config: Path, row: dict[str, Any], edit: str) -> Demo:
    """One captured two-call trajectory (look, then `edit`) as a warm-start demonstration."""
    with tempfile.TemporaryDirectory(prefix="swe-demo-") as tmp:
        work = checkout(row, Path(tmp) / "work")
        seen = asyncio.run(capture(mini, config, row["problem_statement"], work, [TEST_COMMAND, edit]))
    if len(seen) != 2:
        raise RuntimeError(f"mini-swe-agent sent {len(seen)} requests for {row['instance_id']}, expected 2")
    last = seen[-1]
    messages = [*last["messages"], {"role": "assistant", "content": tool_call(edit)}]
    return {"messages": messages, "tools": last["tools"]}


def failure_line(spec: SweInstanceSpec) -> str:
    """The summary line pytest prints for the instance's failing visible test."""
    message = expectation(spec, str(spec.old))
    return f"FAILED {spec.test_path}::test_{spec.constant.lower()} - AssertionError: {message}\n"


def replay(captured: Demo, captured_spec: SweInstanceSpec, spec: SweInstanceSpec, edit: str) -> Demo:
    """A demonstration for `spec` in the exact shape of a captured one (checked by `check_replay`).

    The system prompt, tools, the first tool call and pytest's header lines are the captured
    ones (they do not depend on the instance); the task text, the summary line and the edit are
    the instance's own.
    """
    system, user, look, observation, _ = captured["messages"]
    header = json.loads(observation["content"])["output"].removesuffix(failure_line(captured_spec))
    output = header + failure_line(spec)
    content = '{\n  "returncode": 1,\n  "output": ' + json.dumps(output) + "\n}"
    instance = user["content"].replace(problem_statement(captured_spec), problem_statement(spec), 1)
    messages = [
        system, {**user, "content": instance}, look, {**observation, "content": content},
        {"role": "assistant", "content": tool_call(edit)},
    ]  # fmt: skip
    return {"messages": messages, "tools": captured["tools"]}


def tokenizer_corpus(demos: list[Demo], template_model: Path, names: list[str]) -> list[str]:
    """The demonstrations as the chat template renders them, each of `names` blanked out.

    The coding demo's model gets a tokenizer trained on this (plus the default synthetic corpus):
    what every episode repeats (the tool preamble, mini's task text, pytest's output, the commands)
    becomes few tokens, while repository, file and constant names, blanked here, stay spelled in
    short pieces, the same for training and held-out instances.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(template_model)
    blanked = sorted({*names, *(n.upper() for n in names)}, key=len, reverse=True)
    texts = []
    for demo in demos:
        text = str(tokenizer.apply_chat_template(demo["messages"], tools=demo["tools"], tokenize=False))
        for name in blanked:
            text = text.replace(name, " ")
        texts.append(text)
    return texts

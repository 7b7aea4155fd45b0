"""Held-out evaluation of the coding demo through the gateway, graded SWE-bench style.

Starting the real `mini` costs about 10 s of CPU per episode (litellm's import), too much for 100+
held-out instances several times on two cores. So evaluation runs mini-swe-agent's loop in
process: the captured system prompt, instance template and tools, each bash tool call run in a
fresh checkout with mini's environment settings, its output in mini's observation template, at
most `STEP_LIMIT` calls, the end when a command's first output line is the submit marker. One
difference from the program: an answer without exactly one bash tool call ends the episode (mini
would send its format-error turn and go on). The work tree's diff is graded by the reward
package's SWE-bench grader (fresh clone, test patch, pytest in the sandbox). Each instance is one
episode of a separate evaluation run with its own signed key, so its calls are spans the trainer
never trains on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
from openai import OpenAI

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.graders.swebench import SweBenchGrader
from harnessrl.reward.settings import SandboxLimits
from harnessrl.reward.swe.sandbox import available_limits
from harnessrl.shared.contracts import TaskSpec
from harnessrl.shared.ids import new_id
from harnessrl.shared.keys import sign_episode_key
from harnessrl.stack.demo.swe_demos import AGENT_ENV, MAX_TOKENS, STEP_LIMIT, Demo, checkout

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def observation(returncode: int, output: str) -> str:
    """mini-swe-agent's observation template (outputs under 10,000 characters)."""
    return '{\n  "returncode": ' + str(returncode) + ',\n  "output": ' + json.dumps(output) + "\n}"


def run_command(command: str, work: Path) -> tuple[int, str]:
    """Run one bash command as mini's local environment does (stderr folded into stdout)."""
    env = {**os.environ, **AGENT_ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    try:
        done = subprocess.run(
            ["bash", "-c", command], cwd=work, env=env, text=True, timeout=30,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    return done.returncode, done.stdout


def episode(
    client: OpenAI, model: str, captured: Demo, row: dict[str, Any], temperature: float, work: Path
) -> int:
    """mini-swe-agent's loop on one instance in `work`; returns how many model calls it made."""
    system, user = captured["messages"][:2]
    task = captured["task"]
    messages: list[Any] = [
        system,
        {**user, "content": user["content"].replace(task, row["problem_statement"], 1)},
    ]
    for call in range(1, STEP_LIMIT + 1):
        response = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=captured["tools"],
            temperature=temperature,
            max_tokens=MAX_TOKENS,
        )
        message = response.choices[0].message
        calls = message.tool_calls or []
        if len(calls) != 1 or calls[0].type != "function":
            return call
        function = calls[0].function
        try:
            command = str(json.loads(function.arguments)["command"])
        except (json.JSONDecodeError, KeyError, TypeError):
            return call
        code, output = run_command(command, work)
        if output.lstrip().splitlines()[:1] == [SUBMIT_MARKER]:
            return call
        function_call = {"arguments": function.arguments, "name": function.name}
        tool_call = {"function": function_call, "id": calls[0].id, "type": "function"}
        messages.append({"content": message.content or "", "role": "assistant", "tool_calls": [tool_call]})
        messages.append({"content": observation(code, output), "tool_call_id": calls[0].id, "role": "tool"})
    return STEP_LIMIT


def diff(work: Path, base: str) -> bytes:
    """What the episode runner uploads: everything changed since the base commit."""
    subprocess.run(["git", "add", "-A"], cwd=work, check=True, capture_output=True)
    return subprocess.run(
        ["git", "diff", "--cached", "--binary", base], cwd=work, check=True, capture_output=True
    ).stdout


class Evaluation:
    """Resolve rate of the served policy on held-out instances, at one temperature."""

    def __init__(self, gateway_url: str, secret: str, run: str, model: str, captured: Demo) -> None:
        self.gateway_url, self.secret, self.run, self.model, self.captured = (
            gateway_url,
            secret,
            run,
            model,
            captured,
        )
        limits = available_limits(SandboxLimits(), sys.executable)
        self.context = GradingContext(python=sys.executable, limits=limits)

    def one(self, base: OpenAI, row: dict[str, Any], temperature: float) -> tuple[bool, int]:
        """Resolved, and the number of calls, for one instance."""
        key = sign_episode_key(self.secret.encode(), self.run, new_id("eval"), ttl_s=600)
        with tempfile.TemporaryDirectory(prefix="swe-eval-") as tmp:
            work = checkout(row, Path(tmp) / "work")
            calls = episode(base.with_options(api_key=key), self.model, self.captured, row, temperature, work)
            patch = diff(work, row["base_commit"])
        # Graded as a task file next to the repository would be: its repo_path under the task folder.
        repo = Path(row["repo_path"])
        task = TaskSpec(
            task_id=row["instance_id"],
            kind="swe",
            prompt=row["problem_statement"],
            grader="swebench",
            instance=row | {"repo_path": repo.name},
        )
        grader = SweBenchGrader(msgspec.structs.replace(self.context, tasks_root=str(repo.parent)))
        grade = asyncio.run(grader.grade(task, patch))
        return bool(grade.resolved), calls

    def resolve_rate(
        self, rows: list[dict[str, Any]], temperature: float, workers: int = 8
    ) -> tuple[float, float]:
        """(resolve rate, mean calls per episode) over `rows`."""
        base = OpenAI(base_url=f"{self.gateway_url}/v1", api_key="unused", max_retries=3, timeout=120)
        with base, ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda row: self.one(base, row, temperature), rows))
        return sum(r for r, _ in results) / len(results), sum(c for _, c in results) / len(results)

"""The unmodified mini-swe-agent trained on tinyswe: the whole loop, once around and into the next step.

The tiny model cannot solve a task, so it is first warm-started on mini-swe-agent's own first request
(captured from the real program) to answer with one bash tool call that edits a file and submits.
Then a real run: mini-swe-agent as local episodes with only base URL and key, its calls captured as
spans, its patch uploaded through the gateway and graded SWE-bench style by the reward service,
rollout-complete, a training step, a new weight version served by vLLM, and the next episodes
stamped with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from harnessrl.reward.tinyswe.build import ensure_tinyswe, load_instances
from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import (
    AgentExited,
    EpisodeScored,
    LauncherSpec,
    RolloutComplete,
    RunSpec,
    Span,
    WeightVersion,
    decode,
    decode_event,
    event_kind,
)
from harnessrl.shared.train import TrainSession

MINI = Path.home() / ".cache/harnessrl/harness-mini-swe-agent-2.4.6/bin/mini"
COMMAND = "echo x >> NOTES.md"
TOOL_CALL = (
    '<tool_call>\n{"name": "bash", "arguments": {"command": ' + json.dumps(COMMAND) + "}}\n</tool_call>"
)
MINI_ENV = {
    "MSWEA_CONFIGURED": "true",
    "MSWEA_COST_TRACKING": "ignore_errors",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}
TASKS, GROUP, STEPS = 2, 2, 2


async def capture_first_request(task: str, workdir: Path) -> dict[str, Any]:
    """Run the real mini-swe-agent against a recorder that answers with the submit command."""
    seen: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(await request.json())
        command = COMMAND if len(seen) == 1 else "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
        arguments = json.dumps({"command": command})
        call = {
            "id": f"c{len(seen)}",
            "type": "function",
            "function": {"name": "bash", "arguments": arguments},
        }
        message = {"role": "assistant", "content": "", "tool_calls": [call]}
        choice = {"index": 0, "finish_reason": "tool_calls", "message": message}
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "policy",
                "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    env = {**os.environ, **MINI_ENV, "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": "k"}
    process = await asyncio.create_subprocess_exec(
        str(MINI), "-m", "openai/policy", "-t", task, "-y", "--exit-immediately", cwd=workdir, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    await asyncio.wait_for(process.wait(), timeout=120)
    await runner.cleanup()
    return seen[0]


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("mswea")
    root = ensure_tinyswe()
    rows = [dict(row, repo_path=str(root / row["repo_path"])) for row in load_instances(root)[:TASKS]]
    tasks = home / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))

    demos = []
    for row in rows:
        first = asyncio.run(capture_first_request(row["problem_statement"], home))
        messages = [*first["messages"], {"role": "assistant", "content": TOOL_CALL}]
        demos.append({"messages": messages, "tools": first["tools"]})
    (home / "demos.jsonl").write_text("\n".join(json.dumps(d) for d in demos))
    policy = home / "policy"
    warm = [sys.executable, "-m", "harnessrl.trainer.warmstart", "--model", str(tiny_model), "--demos",
            str(home / "demos.jsonl"), "--out", str(policy), "--steps", "100", "--batch", "2"]  # fmt: skip
    subprocess.run(warm, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    options = "-c mini.yaml -c agent.step_limit=2 -c model.model_kwargs.temperature=0 -o ../trajectory.json"
    options += " -y --exit-immediately"
    command = ["sh", "-c", f'exec {MINI} -m openai/policy -t "$HARNESSRL_TASK" {options}']
    spec = RunSpec(
        run="mswea", tasks=str(tasks), group_size=GROUP, batch_tasks=TASKS, max_concurrent=TASKS * GROUP,
        mode="sync", staleness=0, max_steps=STEPS, episode_timeout_s=240, model=str(policy),
        launcher=LauncherSpec(kind="local", command=command, env=MINI_ENV),
    )  # fmt: skip
    session = TrainSession(spec, home)
    try:
        session.start_stack()
        asyncio.run(asyncio.wait_for(session.follow(live=False), timeout=900))
        with urllib.request.urlopen(f"{session.stack.vllm.url}/weight_info", timeout=10) as info:  # type: ignore[union-attr]
            served = json.loads(info.read())["weight_version"]
        records = asyncio.run(read_run(session.stack.nats_url, spec.run))
    finally:
        session.stop()
    return {"served": served, **records}


async def read_run(url: str, run: str) -> dict[str, list[bytes]]:
    bus = NatsBus(url)
    await bus.connect()
    try:
        where = {
            "spans": (subjects.SPANS.name, subjects.spans_of_run(run)),
            "events": (subjects.EPISODES.name, subjects.episode_events_of_run(run)),
            "rollouts": (subjects.ROLLOUTS.name, subjects.rollout(run)),
            "weights": (subjects.WEIGHTS.name, subjects.weights(run)),
        }
        return {name: [d.data for d in await bus.replay(*w)] for name, w in where.items()}
    finally:
        await bus.close()


def test_calls_patches_grades_and_rollouts(loop_run: dict[str, Any]) -> None:
    events = [decode_event(raw) for raw in loop_run["events"]]
    episodes = TASKS * GROUP * STEPS
    kinds = Counter(event_kind(e) for e in events)
    assert kinds["completed"] == episodes and kinds["failed"] == 0, kinds
    spans = [decode(raw, Span) for raw in loop_run["spans"]]
    per_episode = Counter(s.episode for s in spans)
    assert len(per_episode) == episodes, per_episode
    exits = [e for e in events if isinstance(e, AgentExited)]
    assert all(e.artifact is not None and e.artifact.kind == "patch" for e in exits), "patch uploaded"
    scored = [e for e in events if isinstance(e, EpisodeScored)]
    # The bash tool call ran (NOTES.md in the patch), so the patch applied and the tests ran.
    assert [s.outcome for s in scored] == ["graded"] * episodes, [(s.outcome, s.details) for s in scored]
    assert all(s.resolved is False and s.reward == 0.0 for s in scored)
    rollouts = [decode(raw, RolloutComplete) for raw in loop_run["rollouts"]]
    assert len(rollouts) == episodes
    assert all(r.span_count == per_episode[r.episode] for r in rollouts)


def test_new_version_served_and_stamped_on_the_next_episodes(loop_run: dict[str, Any]) -> None:
    versions = [decode(raw, WeightVersion).version for raw in loop_run["weights"]]
    assert versions == list(range(1, STEPS + 1))
    assert loop_run["served"] == str(STEPS)
    spans = [decode(raw, Span) for raw in loop_run["spans"]]
    assert {s.weight_version_start for s in spans} == set(range(STEPS))

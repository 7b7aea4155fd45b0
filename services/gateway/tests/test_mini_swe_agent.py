"""mini-swe-agent (unmodified, its own venv) runs an episode through the gateway: one span per call.

The tiny model can't produce valid tool calls, so a scripted upstream plays the model: a bash tool
call that writes a file, then the submit command. Token ids are synthetic but consistent, so the
episode's spans still delta-decode.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.shared.bus.base import Bus
from harnessrl.shared.tokens import reconstruct_prompts
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.gateway import KeyedEpisode, serve_gateway, settings_for
from harnessrl.testkit.tools import MINI_SWE_AGENT as MINI

COMMANDS = ["echo gateway > proof.txt", "cat proof.txt", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]


def _bash_call(index: int, command: str) -> dict[str, Any]:
    arguments = msgspec.json.encode({"command": command}).decode()
    return {
        "content": f"Step {index}: running a command.",
        "tool_calls": [{
            "id": f"call_{index}", "type": "function",
            "function": {"name": "bash", "arguments": arguments},
        }],
        "finish_reason": "tool_calls",
    }  # fmt: skip


async def test_mini_swe_agent_episode_has_one_span_per_call(
    bus: Bus, episode: KeyedEpisode, tmp_path: Path
) -> None:
    calls: list[int] = []

    def script(path: str, body: dict[str, Any]) -> dict[str, Any]:
        calls.append(len(body.get("messages", [])))
        step = min(len(calls) - 1, len(COMMANDS) - 1)
        return _bash_call(step, COMMANDS[step])

    upstream = CannedUpstream(script=script)
    await upstream.start()
    try:
        async with serve_gateway(settings_for([upstream.url]), bus) as gateway:
            env = {
                **os.environ,
                "OPENAI_BASE_URL": gateway.url + "/v1",
                "OPENAI_API_KEY": episode.key,
                "MSWEA_CONFIGURED": "true",
                "MSWEA_COST_TRACKING": "ignore_errors",
            }
            process = await asyncio.create_subprocess_exec(
                str(MINI), "-m", "openai/policy", "-t", "Write proof.txt and submit.", "-y",
                "--exit-immediately", "-o", str(tmp_path / "trajectory.json"),
                cwd=tmp_path, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            output, _ = await asyncio.wait_for(process.communicate(), timeout=180)
    finally:
        await upstream.stop()
    log = output.decode(errors="replace")[-3000:]
    assert process.returncode == 0, log
    assert (tmp_path / "proof.txt").read_text().strip() == "gateway", log
    spans = await episode.spans(bus)
    assert len(calls) == len(COMMANDS), log
    assert len(spans) == len(calls)
    assert [s.seq for s in spans] == list(range(len(calls)))
    assert all(s.api == "chat" and s.status == "ok" for s in spans)
    # The agent's growing conversation is stored as deltas that decode to every full prompt.
    prompts = reconstruct_prompts(spans)
    assert [len(prompts[s.span_id]) for s in spans] == [s.prompt_len for s in spans]
    assert spans[-1].parent_span == spans[-2].span_id

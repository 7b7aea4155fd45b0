"""The local sandbox: timeouts are their own outcome, the network is cut where possible."""

import asyncio
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.service import RewardService
from harnessrl.reward.settings import RewardSettings, SandboxLimits
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.pipeline import grade_patch
from harnessrl.reward.swe.sandbox import base_environment, network_isolation_available, run_sandboxed
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import AgentExited, ArtifactRef, EpisodeFailed, TaskSpec, decode_event

HANG = (
    "diff --git a/calc/__init__.py b/calc/__init__.py\n--- a/calc/__init__.py\n"
    "+++ b/calc/__init__.py\n@@ -1,3 +1,5 @@\n"
    ' """calc: a tokenizer and evaluator for arithmetic expressions."""\n'
    "+while True:\n+    pass\n \n from calc.evaluator import CalcError, evaluate\n"
)


async def test_hanging_tests_time_out_as_their_own_outcome(
    calc_row: dict[str, Any], context: GradingContext
) -> None:
    quick = GradingContext(
        tasks_root=context.tasks_root,
        python=context.python,
        limits=msgspec.structs.replace(context.limits, timeout_s=3.0),
    )
    grade = await grade_patch(
        SweInstance.from_row(calc_row), quick.resolve(calc_row["repo_path"]), HANG.encode(), quick
    )
    assert grade.outcome == "timeout"
    assert grade.resolved is False and not grade.scored


async def test_service_fails_a_timed_out_grading_as_reward_error(
    calc_row: dict[str, Any], tinyswe_root: Path, bus: Bus, context: GradingContext
) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    settings = RewardSettings(
        durable=f"reward-{run}",
        runs=run,
        tasks_root=str(tinyswe_root),
        test_timeout_s=3.0,
        drop_privileges=context.limits.drop_privileges,
    )
    service = RewardService(bus, settings)
    await service.start()
    try:
        task = TaskSpec(task_id=calc_row["instance_id"], kind="swe", instance=calc_row)
        event = AgentExited(
            run=run,
            episode=f"{run}-hang",
            task=task.task_id,
            group="g",
            artifact=ArtifactRef(inline=HANG.encode()),
            task_spec=task,
        )
        await bus.publish(
            f"hrl.episode.{run}.{run}-hang.agent_exited", event, msg_id=f"{run}-hang:agent_exited"
        )
        published = []
        for _ in range(300):
            published = await bus.replay("EPISODES", f"hrl.episode.{run}.*.failed")
            if published:
                break
            await asyncio.sleep(0.1)
    finally:
        await service.stop()
    failed = decode_event(published[0].data)
    assert isinstance(failed, EpisodeFailed)
    assert failed.cause == "reward-error" and failed.reason.startswith("timeout")


async def test_network_is_cut_inside_the_sandbox(tmp_path: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = [
        sys.executable,
        "-I",
        "-c",
        f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)",
    ]

    async def connect(isolate: bool) -> int:
        run = await run_sandboxed(
            probe,
            cwd=tmp_path,
            log_path=tmp_path / "log",
            env=base_environment(tmp_path),
            limits=SandboxLimits(timeout_s=10, isolate_network=isolate, drop_privileges=False),
        )
        return run.exit_code

    try:
        assert await connect(isolate=False) == 0
        assert network_isolation_available()  # `unshare -n` works on this machine (root)
        assert await connect(isolate=True) != 0
    finally:
        server.close()
    await asyncio.sleep(0)

"""The reward service over a real nats-server: grading, idempotence, failures, queue group."""

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from harnessrl.reward import service as reward_service
from harnessrl.reward.graders.base import Grade, GradingContext
from harnessrl.reward.service import RewardService
from harnessrl.reward.settings import RewardSettings
from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import (
    AgentExited,
    ArtifactRef,
    EpisodeFailed,
    EpisodeScored,
    TaskSpec,
    decode_event,
)

NUMERIC = TaskSpec(task_id="mul-17-24", kind="qa", prompt="What is 17*24?", answer="408", grader="numeric")


def exited(run: str, episode: str, task: TaskSpec, artifact: ArtifactRef | None) -> AgentExited:
    # Episode ids are globally unique (result msg ids are "<episode>:scored"): prefix the run.
    return AgentExited(
        run=run,
        episode=f"{run}-{episode}",
        task=task.task_id,
        group="g0",
        exit_code=0,
        artifact=artifact,
        task_spec=task,
    )


def inline(data: bytes) -> ArtifactRef:
    return ArtifactRef(kind="answer", size=len(data), sha256=hashlib.sha256(data).hexdigest(), inline=data)


async def send(bus: Bus, event: AgentExited, copy: int = 0) -> None:
    subject = subjects.episode_event(event.run, event.episode, "agent_exited")
    await bus.publish(subject, event, msg_id=f"{event.episode}:agent_exited:{copy}")


async def results(bus: Bus, run: str, count: int) -> list[Any]:
    """Wait until `count` scored/failed events of `run` are stored, then return them all."""
    for _ in range(600):
        found = [
            decode_event(d.data)
            for kind in ("scored", "failed")
            for d in await bus.replay("EPISODES", subjects.episode_events_of_run(run, kind))
        ]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"only {len(found)} of {count} results arrived")


@pytest.fixture
def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def service(
    bus: Bus, run_id: str, tinyswe_root: Any, context: GradingContext
) -> AsyncIterator[RewardService]:
    settings = RewardSettings(
        durable=f"reward-{run_id}",
        runs=run_id,
        tasks_root=str(tinyswe_root),
        log_format="console",
        drop_privileges=context.limits.drop_privileges,
    )
    worker = RewardService(bus, settings)
    await worker.start()
    yield worker
    await worker.stop()


async def test_numeric_answer_is_scored(bus: Bus, service: RewardService, run_id: str) -> None:
    await send(bus, exited(run_id, "ep-1", NUMERIC, inline(b"CALC 17*24\nANSWER 408")))
    [scored] = await results(bus, run_id, 1)
    assert isinstance(scored, EpisodeScored)
    assert (scored.reward, scored.resolved, scored.outcome) == (1.0, True, "graded")


async def test_swe_patch_from_the_object_store_resolves(
    bus: Bus, service: RewardService, run_id: str, calc_row: dict[str, Any]
) -> None:
    patch = calc_row["patch"].encode()
    await bus.put_object(subjects.ARTIFACTS_BUCKET, f"{run_id}-ep-1.diff", patch)
    task = TaskSpec(task_id=calc_row["instance_id"], kind="swe", instance=calc_row)
    ref = ArtifactRef(kind="patch", size=len(patch), object_name=f"{run_id}-ep-1.diff")
    await send(bus, exited(run_id, "ep-1", task, ref))
    [scored] = await results(bus, run_id, 1)
    assert isinstance(scored, EpisodeScored)
    assert scored.resolved is True and scored.reward == 1.0
    assert scored.details["FAIL_TO_PASS"]["failure"] == []
    assert scored.details["durations"]["test_s"] > 0


async def test_redelivered_event_publishes_one_result_without_regrading(
    bus: Bus, service: RewardService, run_id: str
) -> None:
    event = exited(run_id, "ep-1", NUMERIC, inline(b"ANSWER 407"))
    await send(bus, event, copy=1)
    await results(bus, run_id, 1)
    await send(bus, event, copy=2)  # a second delivery of the same episode's event
    for _ in range(300):
        if service.republished:
            break
        await asyncio.sleep(0.1)
    found = await results(bus, run_id, 1)
    assert (service.graded, service.republished) == (1, 1)
    assert len(found) == 1 and found[0].reward == 0.0


async def test_garbage_patch_is_scored_zero_not_crashed(
    bus: Bus, service: RewardService, run_id: str, calc_row: dict[str, Any]
) -> None:
    task = TaskSpec(task_id=calc_row["instance_id"], kind="swe", instance=calc_row)
    await send(bus, exited(run_id, "ep-1", task, inline(b"\x00\xff" * 500)))
    [scored] = await results(bus, run_id, 1)
    assert isinstance(scored, EpisodeScored)
    assert (scored.outcome, scored.reward, scored.resolved) == ("invalid-artifact", 0.0, False)


async def test_unknown_grader_and_missing_artifact_fail_with_a_cause(
    bus: Bus, service: RewardService, run_id: str
) -> None:
    odd = TaskSpec(task_id="t", kind="qa", answer="1", grader="no-such-grader")
    await send(bus, exited(run_id, "ep-1", odd, inline(b"1")))
    missing = ArtifactRef(kind="answer", object_name=f"{run_id}-nothing-here")
    await send(bus, exited(run_id, "ep-2", NUMERIC, missing))
    found = {e.episode.removeprefix(f"{run_id}-"): e for e in await results(bus, run_id, 2)}
    assert isinstance(found["ep-1"], EpisodeFailed) and found["ep-1"].cause == "reward-error"
    assert isinstance(found["ep-2"], EpisodeFailed) and found["ep-2"].cause == "infra"


class _NanGrader:
    async def grade(self, task: TaskSpec, artifact: bytes) -> Grade:
        return Grade(reward=float("nan"), resolved=False)


async def test_a_non_finite_reward_is_refused_and_counted(
    bus: Bus, service: RewardService, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reward_service, "build_grader", lambda name, context: _NanGrader())
    await send(bus, exited(run_id, "ep-1", NUMERIC, inline(b"ANSWER 408")))
    [failed] = await results(bus, run_id, 1)
    assert isinstance(failed, EpisodeFailed) and failed.cause == "reward-error"
    assert "non-finite reward (nan)" in failed.reason
    assert service.refused == {"non_finite_reward": 1}


async def test_workers_share_the_durable_as_a_queue_group(
    bus: Bus, service: RewardService, run_id: str
) -> None:
    second = RewardService(bus, service.settings)
    await second.start()
    try:
        for n in range(12):
            answer = b"ANSWER 408" if n % 2 else b"ANSWER 1"
            await send(bus, exited(run_id, f"ep-{n}", NUMERIC, inline(answer)))
        found = await results(bus, run_id, 12)
    finally:
        await second.stop()
    assert len(found) == 12
    assert service.graded + second.graded == 12
    assert sum(e.reward for e in found) == 6.0


async def test_a_grading_longer_than_the_ack_wait_is_graded_once(
    bus: Bus, run_id: str, tinyswe_root: Any, context: GradingContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer waits `ack_wait_s` (short) for a worker that died; a slow grading keeps its
    episode by telling NATS it is still working, so the second worker never grades it again."""
    settings = RewardSettings(
        durable=f"slow-{run_id}", runs=run_id, tasks_root=str(tinyswe_root), log_format="console",
        drop_privileges=context.limits.drop_privileges, ack_wait_s=1.0,
    )  # fmt: skip
    original = RewardService._run_grader

    async def slow(worker: RewardService, task: TaskSpec, artifact: bytes, log: Any) -> Grade:
        await asyncio.sleep(3.0)
        return await original(worker, task, artifact, log)

    monkeypatch.setattr(RewardService, "_run_grader", slow)
    workers = [RewardService(bus, settings), RewardService(bus, settings)]
    for worker in workers:
        await worker.start()
    try:
        await send(bus, exited(run_id, "ep-slow", NUMERIC, inline(b"ANSWER 408")))
        found = await results(bus, run_id, 1)
        await asyncio.sleep(1.5)
    finally:
        for worker in workers:
            await worker.stop()
    assert [e.reward for e in found] == [1.0]
    assert sum(worker.graded for worker in workers) == 1
    assert sum(worker.republished for worker in workers) == 0

"""The worker's metrics: `app.serve` against a real nats-server, scraped over HTTP and read on METRICS."""

import asyncio
import hashlib
import urllib.error
import urllib.request
import uuid

import pytest

from harnessrl.reward import app
from harnessrl.reward import service as reward_service
from harnessrl.reward.graders.base import Grade
from harnessrl.reward.settings import RewardSettings
from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import AgentExited, ArtifactRef, ServiceMetrics, TaskSpec
from harnessrl.shared.net import free_port
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.prometheus import scrape

NUMERIC = TaskSpec(task_id="mul-17-24", kind="qa", prompt="What is 17*24?", answer="408", grader="numeric")
NAN = TaskSpec(task_id="nan", kind="qa", answer="1", grader="nan")
UNKNOWN = TaskSpec(task_id="odd", kind="qa", answer="1", grader="no-such-grader")


class _NanGrader:
    async def grade(self, task: TaskSpec, artifact: bytes) -> Grade:
        return Grade(reward=float("nan"), resolved=False)


def agent_exited(run: str, episode: str, task: TaskSpec, answer: bytes) -> AgentExited:
    artifact = ArtifactRef(
        kind="answer", size=len(answer), sha256=hashlib.sha256(answer).hexdigest(), inline=answer
    )
    return AgentExited(
        run=run, episode=f"{run}-{episode}", task=task.task_id, group="g0", exit_code=0,
        artifact=artifact, task_spec=task,
    )  # fmt: skip


async def send(bus: Bus, event: AgentExited, copy: int = 0) -> None:
    subject = subjects.episode_event(event.run, event.episode, "agent_exited")
    await bus.publish(subject, event, msg_id=f"{event.episode}:agent_exited:{copy}")


async def until(check, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.1)


async def test_gradings_latency_refusals_and_republishes_are_served_and_summarised(
    bus: Bus, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = reward_service.build_grader
    monkeypatch.setattr(
        reward_service, "build_grader", lambda name, ctx: _NanGrader() if name == "nan" else real(name, ctx)
    )
    run = f"run-{uuid.uuid4().hex[:8]}"
    settings = RewardSettings(
        nats_url=nats_server.url, durable=f"reward-{run}", runs=run, log_format="console",
        metrics_port=free_port(), metrics_interval_s=0.2,
    )  # fmt: skip
    url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
    stop = asyncio.Event()
    served = asyncio.create_task(app.serve(settings, stop))
    try:
        await until(lambda: _answers(url))
        first = agent_exited(run, "ep-1", NUMERIC, b"ANSWER 408")
        for event in (first, agent_exited(run, "ep-2", NAN, b"1"), agent_exited(run, "ep-3", UNKNOWN, b"1")):
            await send(bus, event)
        await until(lambda: _value(url, "harnessrl_reward_results_total", event="failed", want=2.0))
        await send(bus, first, copy=1)  # redelivered: answered from the stored result
        await until(lambda: _value(url, "harnessrl_reward_results_republished_total", want=1.0))
        samples = await scrape(url)
        summary = await _summary_with(bus, "harnessrl_reward_results_republished_total", 1.0)
    finally:
        stop.set()
        await asyncio.wait_for(served, 30)

    assert samples[("harnessrl_reward_gradings_total", (("outcome", "graded"),))] == 2.0  # 408 and the NaN
    assert samples[("harnessrl_reward_gradings_total", (("outcome", "grader-error"),))] == 1.0
    assert samples[("harnessrl_reward_verdicts_refused_total", (("reason", "non_finite_reward"),))] == 1.0
    assert samples[("harnessrl_reward_results_total", (("event", "scored"),))] == 1.0
    assert samples[("harnessrl_reward_results_total", (("event", "failed"),))] == 2.0
    assert samples[("harnessrl_reward_grading_duration_seconds_count", ())] == 3.0
    assert samples[("harnessrl_reward_grading_duration_seconds_sum", ())] > 0
    assert samples[("harnessrl_reward_gradings_in_flight", ())] == 0.0
    assert summary.service == "reward" and summary.run == ""
    assert summary.values['harnessrl_reward_gradings_total{outcome="graded"}'] == 2.0
    assert summary.values["harnessrl_reward_grading_duration_seconds_count"] == 3.0
    assert not any("_bucket" in key for key in summary.values)


async def test_the_endpoint_serves_only_metrics(nats_server: NatsServer) -> None:
    settings = RewardSettings(
        nats_url=nats_server.url, durable=f"reward-{uuid.uuid4().hex[:8]}", runs="none", log_format="console",
        metrics_port=free_port(), metrics_interval_s=0,
    )  # fmt: skip
    stop = asyncio.Event()
    served = asyncio.create_task(app.serve(settings, stop))
    try:
        await until(lambda: _answers(f"http://127.0.0.1:{settings.metrics_port}/metrics"))
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{settings.metrics_port}/")
        assert refused.value.code == 404
    finally:
        stop.set()
        await asyncio.wait_for(served, 30)


async def _answers(url: str) -> bool:
    try:
        await scrape(url)
    except OSError:
        return False
    return True


async def _value(url: str, name: str, want: float, **labels: str) -> bool:
    return (await scrape(url)).get((name, tuple(sorted(labels.items())))) == want


async def _summary_with(bus: Bus, key: str, want: float) -> ServiceMetrics:
    """The newest reward summary, once one shows `key` at `want`."""
    for _ in range(100):
        stored = await bus.replay(subjects.METRICS.name, subjects.service_metrics("reward"))
        summaries = [item.decode(ServiceMetrics) for item in stored]
        if summaries and summaries[-1].values.get(key) == want:
            return summaries[-1]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no reward summary with {key} = {want}")

"""The demo pipeline, shortened: every stage of the real system happens, in order, for two steps.

Real nats-server, real vLLM on the CPU, the four services as processes, the OpenAI-SDK harness as
local episodes through the gateway. Checks what the bus recorded: spans for every episode, scored
events, rollout-complete, monotonic weight versions, the replica reloaded and stamping the next
episodes with the new version.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import urllib.request
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import (
    HELDOUT_GREEDY,
    HELDOUT_SAMPLED,
    RolloutComplete,
    Span,
    StepMetrics,
    WeightVersion,
    decode,
    decode_event,
    event_kind,
)
from harnessrl.stack.demo.run import DemoSettings, evaluate, run_spec, warm_start
from harnessrl.stack.train import TrainSession
from harnessrl.testkit.split_reward_harness import split_rewards


def load_example(relative: str) -> ModuleType:
    path = Path(__file__).parents[1] / "examples" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEPS, GROUP, TASKS = 2, 4, 2
span_stats = load_example("analytics/span_stats.py")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> TrainSession:
    home = tmp_path_factory.mktemp("demo")
    settings = DemoSettings(
        run="pipeline", steps=STEPS, group_size=GROUP, tasks_per_step=TASKS, warm_steps=60, warm_examples=2000
    )
    warm = warm_start(home, tiny_model, settings)
    session = TrainSession(split_rewards(run_spec(home, settings, warm)), home)
    try:
        session.start_stack()
        evaluate(session, 0)
        asyncio.run(asyncio.wait_for(session.follow(live=False), timeout=600))
        session.finish()
        weight_info = urllib.request.urlopen(f"{session.stack.vllm.url}/weight_info", timeout=10)  # type: ignore[union-attr]
        session.replica_version = json.loads(weight_info.read())["weight_version"]  # type: ignore[attr-defined]
        session.bus_dump = asyncio.run(dump(session.stack.nats_url, session.spec.run))  # type: ignore[attr-defined]
        analytics = asyncio.run(  # the analytics example, as a user would run it against the live bus
            asyncio.wait_for(
                span_stats.follow(session.stack.nats_url, "pipeline", "t", STEPS * GROUP * TASKS), 60
            )
        )
        session.analytics = analytics  # type: ignore[attr-defined]
    finally:
        session.stop()
    return session


async def dump(url: str, run: str) -> dict[str, list[bytes]]:
    bus = NatsBus(url)
    await bus.connect()
    try:
        read = {
            "spans": (subjects.SPANS.name, subjects.spans_of_run(run)),
            "events": (subjects.EPISODES.name, subjects.episode_events_of_run(run)),
            "rollouts": (subjects.ROLLOUTS.name, subjects.rollout(run)),
            "weights": (subjects.WEIGHTS.name, subjects.weights(run)),
            "heldout": (subjects.METRICS.name, subjects.metrics(run, subjects.HELDOUT_SOURCE)),
        }
        return {name: [d.data for d in await bus.replay(*where)] for name, where in read.items()}
    finally:
        await bus.close()


def test_every_episode_ran_through_every_stage(finished_run: TrainSession) -> None:
    events = [decode_event(raw) for raw in finished_run.bus_dump["events"]]  # type: ignore[attr-defined]
    kinds = Counter(event_kind(e) for e in events)
    episodes = STEPS * GROUP * TASKS
    for kind in ("scheduled", "started", "agent_exited", "scored", "completed"):
        assert kinds[kind] == episodes, (kind, kinds)
    assert kinds["failed"] == 0
    terminal = Counter(e.episode for e in events if event_kind(e) in ("completed", "failed"))
    assert set(terminal.values()) == {1}, "exactly one terminal event per episode"


def test_spans_and_rollouts_agree(finished_run: TrainSession) -> None:
    spans = [decode(raw, Span) for raw in finished_run.bus_dump["spans"]]  # type: ignore[attr-defined]
    rollouts = [decode(raw, RolloutComplete) for raw in finished_run.bus_dump["rollouts"]]  # type: ignore[attr-defined]
    assert len(rollouts) == STEPS * GROUP * TASKS
    per_episode = Counter(s.episode for s in spans)
    for rollout in rollouts:
        assert rollout.span_count == per_episode[rollout.episode] >= 1
        assert rollout.last_seq == rollout.span_count - 1
    assert all(s.status == "ok" and s.completions and s.completions[0].token_ids for s in spans)


def test_weight_versions_are_monotonic_and_served(finished_run: TrainSession) -> None:
    versions = [decode(raw, WeightVersion).version for raw in finished_run.bus_dump["weights"]]  # type: ignore[attr-defined]
    assert versions == list(range(1, STEPS + 1))
    assert finished_run.replica_version == str(STEPS)  # type: ignore[attr-defined]


def test_next_episodes_are_stamped_with_the_new_version(finished_run: TrainSession) -> None:
    spans = [decode(raw, Span) for raw in finished_run.bus_dump["spans"]]  # type: ignore[attr-defined]
    assert {s.weight_version_start for s in spans} == set(range(STEPS))


def test_progress_plot_and_summary_written(finished_run: TrainSession) -> None:
    assert (finished_run.run_dir / "progress.png").stat().st_size > 10_000
    summary = json.loads((finished_run.run_dir / "summary.json").read_text())
    assert summary["run"] == "pipeline" and summary["heldout"][0]["step"] == 0


def test_heldout_evaluations_are_on_the_bus(finished_run: TrainSession) -> None:
    published = [decode(data, StepMetrics) for data in finished_run.bus_dump["heldout"]]  # type: ignore[attr-defined]
    assert [(m.step, m.values[HELDOUT_GREEDY], m.values[HELDOUT_SAMPLED]) for m in published] == [
        (point.step, point.greedy, point.sampled) for point in finished_run.progress.heldout
    ]


def test_analytics_example_summarises_every_episode(finished_run: TrainSession) -> None:
    rows = finished_run.analytics  # type: ignore[attr-defined]
    assert len(rows) == STEPS * GROUP * TASKS
    assert all(
        r["calls"] >= 1 and r["completion_tokens"] >= 1 and r["prompt_tokens"] > 0 for r in rows.values()
    )
    assert {v for r in rows.values() for v in r["versions"]} == set(range(STEPS))

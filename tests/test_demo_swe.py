"""`make demo-swe`, shortened: the unmodified mini-swe-agent, several calls per episode, the whole loop.

The tiny model is warm-started on mini-swe-agent's own requests (captured from the real program)
for two training instances of the demo's task family, with a fix and a failed edit each. Then a
real run: mini-swe-agent as local episodes with only base URL and key, each episode looking first
(it runs the tests) and acting second (the edit and the submit command); every call a span; the
patch uploaded through the gateway and graded SWE-bench style by the reward service; rollouts;
GRPO steps that move the policy; the new version served and stamped on later episodes. The served
policy is scored on the demonstrations before and after the run: its weights moved, and on every
instance whose group had mixed rewards it now prefers the fix over the failed edit more than the warm
start did. After the run, held-out instances (never trained on) are evaluated through the gateway as
their own run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from harnessrl.reward.graders.base import SCORED_OUTCOMES
from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import (
    AgentExited,
    EpisodeScored,
    LauncherSpec,
    RolloutComplete,
    RunSpec,
    Span,
    StepMetrics,
    WeightVersion,
    decode,
    decode_event,
    event_kind,
)
from harnessrl.stack.demo import swe_demos, swe_tasks
from harnessrl.stack.demo.swe_evaluate import Evaluation
from harnessrl.stack.local import SERVED_MODEL
from harnessrl.stack.train import TrainSession
from harnessrl.testkit.swe_demo import TRAIN_TASKS, swe_demo_policy
from harnessrl.trainer.replica import VllmReplica

log = logging.getLogger(__name__)
GROUP, STEPS, HELDOUT = 4, 2, 6
FOLLOW_S = 420
# A rendered demonstration: token ids and the mask of the assistant's tokens.
Rendered = tuple[list[int], list[int]]


class Scored(NamedTuple):
    """A demonstration's assistant tokens and their log-probabilities under the served policy."""

    tokens: list[int]
    logprobs: list[float]


async def score_demos(vllm_url: str, served_model: str, rendered: dict[str, Rendered]) -> dict[str, Scored]:
    """Score each rendered demonstration (prompt and assistant turns) with vLLM's prompt logprobs."""
    out: dict[str, Scored] = {}
    async with VllmReplica(vllm_url, served_model) as replica:
        for name, (ids, mask) in rendered.items():
            probe = await replica.probe_logprobs(ids)
            # probe.prompt[i] is log p(ids[i + 1] | ids[: i + 1]); mask marks the assistant's tokens.
            learned = [i for i in range(1, len(ids)) if mask[i]]
            out[name] = Scored([ids[i] for i in learned], [probe.prompt[i - 1] for i in learned])
    return out


async def read_run(url: str, run: str) -> dict[str, list[bytes]]:
    bus = NatsBus(url)
    await bus.connect()
    try:
        where = {
            "spans": (subjects.SPANS.name, subjects.spans_of_run(run)),
            "events": (subjects.EPISODES.name, subjects.episode_events_of_run(run)),
            "rollouts": (subjects.ROLLOUTS.name, subjects.rollout(run)),
            "weights": (subjects.WEIGHTS.name, subjects.weights(run)),
            "metrics": (subjects.METRICS.name, subjects.metrics(run, "trainer")),
            "heldout_spans": (subjects.SPANS.name, subjects.spans_of_run(f"{run}-heldout")),
        }
        return {name: [d.data for d in await bus.replay(*w)] for name, w in where.items()}
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def swe_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    # Imported here: torch and transformers take seconds, and collecting the suite needn't pay them.
    from transformers import AutoTokenizer

    from harnessrl.trainer.warmstart import render

    home = tmp_path_factory.mktemp("demo-swe")
    taught = swe_demo_policy(tiny_model, home)
    tokenizer = AutoTokenizer.from_pretrained(taught.model)
    demos = taught.demos.items()
    rendered = {name: render(tokenizer, demo["messages"], demo["tools"]) for name, demo in demos}
    tasks = home / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in swe_tasks.place_tasks(taught.rows, home)))
    command = swe_demos.harness_command(swe_demos.MINI_SWE_AGENT, taught.config, 1.0)
    spec = RunSpec(
        run="demo-swe", tasks=str(tasks), group_size=GROUP, batch_tasks=TRAIN_TASKS, max_concurrent=GROUP,
        mode="sync", staleness=0, max_steps=STEPS, episode_timeout_s=240, model=str(taught.model),
        launcher=LauncherSpec(kind="local", command=command, env=swe_demos.MINI_ENV),
    )  # fmt: skip
    heldout = swe_tasks.load_rows(swe_tasks.ensure_split("heldout", 100))[:HELDOUT]
    session = TrainSession(spec, home)
    try:
        session.start_stack()
        vllm = session.stack.vllm
        assert vllm is not None
        # The served policy before the run (version 0, the warm start; twice, for the probe's noise)
        # and after its last step.
        before = asyncio.run(score_demos(vllm.url, vllm.model, rendered))
        again = asyncio.run(score_demos(vllm.url, vllm.model, rendered))
        try:
            asyncio.run(asyncio.wait_for(session.follow(live=False), timeout=FOLLOW_S))
        except TimeoutError:
            progress = session.progress
            pytest.fail(f"run stuck at step {progress.step}, version {progress.version}: see {home}/logs")
        after = asyncio.run(score_demos(vllm.url, vllm.model, rendered))
        stack = session.stack
        evaluation = Evaluation(
            stack.gateway_url, stack.key_secret, f"{spec.run}-heldout", SERVED_MODEL, taught.captured
        )
        resolved, calls = evaluation.resolve_rate(heldout, 0.0, workers=2)
        with urllib.request.urlopen(f"{vllm.url}/weight_info", timeout=10) as info:
            served = json.loads(info.read())["weight_version"]
        records = asyncio.run(read_run(stack.nats_url, spec.run))
    finally:
        session.stop()
    return {
        "served": served, "heldout": (resolved, calls), "rows": taught.rows,
        "before": before, "again": again, "after": after, **records,
    }  # fmt: skip


def test_episodes_look_then_act_and_every_call_is_a_span(swe_run: dict[str, Any]) -> None:
    events = [decode_event(raw) for raw in swe_run["events"]]
    episodes = TRAIN_TASKS * GROUP * STEPS
    kinds = Counter(event_kind(e) for e in events)
    assert kinds["completed"] == episodes and kinds["failed"] == 0, kinds
    spans = [decode(raw, Span) for raw in swe_run["spans"]]
    per_episode = Counter(s.episode for s in spans)
    assert len(per_episode) == episodes, per_episode
    multi = sum(n >= 2 for n in per_episode.values())
    assert multi >= episodes * 0.75, per_episode  # most episodes make at least two calls
    rollouts = [decode(raw, RolloutComplete) for raw in swe_run["rollouts"]]
    assert len(rollouts) == episodes
    assert all(r.span_count == per_episode[r.episode] for r in rollouts)


def test_patches_are_graded_swe_bench_style(swe_run: dict[str, Any]) -> None:
    events = [decode_event(raw) for raw in swe_run["events"]]
    exits = {e.episode: e for e in events if isinstance(e, AgentExited)}
    scored = [e for e in events if isinstance(e, EpisodeScored)]
    assert scored
    for score in scored:
        artifact = exits[score.episode].artifact
        assert artifact is None or artifact.kind == "patch", artifact
        assert score.outcome in SCORED_OUTCOMES and score.reward == float(bool(score.resolved)), score
        if artifact is None:
            assert score.outcome == "empty-patch", score
    outcomes = Counter((s.outcome, s.resolved) for s in scored)
    assert outcomes[("graded", True)] > 0, outcomes  # real fixes, applied and tested in a fresh sandbox


def test_a_step_moves_the_policy_and_the_new_version_is_served(swe_run: dict[str, Any]) -> None:
    metrics = sorted((decode(raw, StepMetrics) for raw in swe_run["metrics"]), key=lambda m: m.step)
    assert [m.step for m in metrics] == list(range(1, STEPS + 1)), metrics
    learned = [m.values for m in metrics if m.values["groups/trained"] > 0]
    assert learned, "no step had a group with mixed rewards"
    for values in learned:
        assert values["reward/std"] > 0 and values["tokens/trained"] > 0 and values["grad_norm"] > 0, values
        assert values["rollouts/rows_per_rollout"] >= 1, values
    weights = sorted((decode(raw, WeightVersion) for raw in swe_run["weights"]), key=lambda w: w.step)
    trained = [m.trained for m in metrics]
    assert [w.version for w in weights] == list(itertools.accumulate(int(t) for t in trained))
    assert swe_run["served"] == str(weights[-1].version) and weights[-1].version >= 1
    spans = [decode(raw, Span) for raw in swe_run["spans"]]
    assert {s.weight_version_start for s in spans} == {0, *(w.version for w in weights[:-1])}


def _branch(fix: list[int], wrong: list[int]) -> int:
    """Tokens up to and including the first one where the fix and the failed edit part."""
    return next(i for i, (a, b) in enumerate(zip(fix, wrong, strict=False)) if a != b) + 1


def test_policy_moved_toward_the_fix(swe_run: dict[str, Any]) -> None:
    """The served policy now chooses the fix more often than the failed edit on every instance that
    taught it.

    Measured where the two edits part (the file the substitution runs on): that choice is what the
    rewards ranked. The look turn before it is the same in both demonstrations.
    """
    before, again, after = swe_run["before"], swe_run["again"], swe_run["after"]
    noise = max(abs(sum(again[n].logprobs) - sum(before[n].logprobs)) for n in before)
    assert noise < 1e-3, noise
    events = [decode_event(raw) for raw in swe_run["events"]]
    groups: dict[str, set[float]] = {}
    for e in events:
        if isinstance(e, EpisodeScored):
            groups.setdefault(e.group, set()).add(e.reward)
    taught = {e.task for e in events if isinstance(e, EpisodeScored) and len(groups[e.group]) > 1}
    assert taught, groups
    for task in (row["instance_id"] for row in swe_run["rows"]):
        fix, wrong = f"{task}/fix", f"{task}/wrong"
        # The served weights changed: the same sequences score differently, far beyond the noise
        # (ten times what scoring the unchanged weights twice moved them, and at least 1e-3).
        for name in (fix, wrong):
            moved = abs(sum(after[name].logprobs) - sum(before[name].logprobs))
            assert moved > max(10 * noise, 1e-3), (name, moved, noise)
        k = _branch(before[fix].tokens, before[wrong].tokens)
        margin_before = sum(before[fix].logprobs[:k]) - sum(before[wrong].logprobs[:k])
        margin_after = sum(after[fix].logprobs[:k]) - sum(after[wrong].logprobs[:k])
        log.info("%s taught=%s choice margin %.3f -> %.3f (noise %.1e)",
                 task, task in taught, margin_before, margin_after, noise)  # fmt: skip
        if task in taught:
            assert margin_after > margin_before, (task, margin_before, margin_after)


def test_heldout_instances_are_evaluated_through_the_gateway(swe_run: dict[str, Any]) -> None:
    resolved, calls = swe_run["heldout"]
    assert 0.0 <= resolved <= 1.0 and calls >= 1, swe_run["heldout"]
    spans = [decode(raw, Span) for raw in swe_run["heldout_spans"]]
    assert len({s.episode for s in spans}) == HELDOUT, spans
    trained = {row["instance_id"] for row in swe_run["rows"]}
    assert not trained & {
        row["instance_id"] for row in swe_tasks.load_rows(swe_tasks.ensure_split("heldout", 100))
    }

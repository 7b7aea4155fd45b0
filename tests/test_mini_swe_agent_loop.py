"""The unmodified mini-swe-agent trained on tinyswe: the whole loop, with steps that really learn.

The tiny model cannot solve a task by itself, so it is first warm-started on mini-swe-agent's own
first request (captured from the real program) for two tinyswe tasks, with two demonstrations per
task: a bash tool call that makes exactly the task's gold one-line fix (a `sed -i` derived from the
gold patch and checked against it) and a harmless `echo x >> NOTES.md`. Sampled at temperature 1,
the warm-started policy solves some attempts and not others, so GRPO groups have reward variance.
(The warm start, `harnessrl.testkit.policies.tool_calling_policy`, takes minutes on 2 cores; its
result is cached per machine, keyed on its inputs.)

Then a real run: mini-swe-agent as local episodes with only base URL and key (one model call each,
`agent.step_limit=1`), its calls captured as spans, its patch uploaded through the gateway and graded
SWE-bench style by the reward service (the sampled fix resolves the task, reward 1; the echo does
not, reward 0), rollout-complete, training steps on groups with mixed rewards (nonzero gradient), new
weight versions served by vLLM and stamped on the next episodes. The served policy is scored on the
demonstrations before and after the run: its weights moved, and on every task whose group had
mixed rewards it now prefers the fix over the echo more than the warm start did.
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
from harnessrl.stack.train import TrainSession
from harnessrl.testkit.policies import ECHO, MINI_ENV, TASK_IDS, tool_call, tool_calling_policy
from harnessrl.testkit.tools import MINI_SWE_AGENT as MINI
from harnessrl.trainer.replica import VllmReplica

log = logging.getLogger(__name__)
TASKS = len(TASK_IDS)
# After the warm start an attempt resolves its task with probability p ~ 0.4 (about as many echo, the
# rest a sample that went wrong); a group of 5 then has uniform rewards with probability
# p^5 + (1-p)^5 ~ 0.09, and all 4 groups of the run (2 tasks x 2 steps) with ~1e-4.
GROUP, STEPS = 5, 2
# One group's episodes at a time: each starts a Python process (litellm's import alone takes seconds of
# CPU), and 10 at once on 2 busy cores once starved nats-server into a KV-write timeout after which
# the controller could not finish an episode (its cached revision went stale) and the run never
# ended. The run takes 1.5-2 min; past `FOLLOW_S` it fails with its logs, before pytest's timeout.
FOLLOW_S = 300
# A rendered demonstration: token ids and the mask of the assistant's tokens.
Rendered = tuple[list[int], list[int]]


class Scored(NamedTuple):
    """A demonstration's assistant tokens and their log-probabilities under the served policy."""

    tokens: list[int]
    logprobs: list[float]


async def score_demos(vllm_url: str, served_model: str, rendered: dict[str, Rendered]) -> dict[str, Scored]:
    """Score each rendered demonstration (prompt and assistant turn) with vLLM's prompt logprobs."""
    out: dict[str, Scored] = {}
    async with VllmReplica(vllm_url, served_model) as replica:
        for name, (ids, mask) in rendered.items():
            probe = await replica.probe_logprobs(ids)
            # probe.prompt[i] is log p(ids[i + 1] | ids[: i + 1]); mask marks the assistant's tokens.
            learned = [i for i in range(1, len(ids)) if mask[i]]
            out[name] = Scored([ids[i] for i in learned], [probe.prompt[i - 1] for i in learned])
    return out


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    # Imported here: torch and transformers take seconds, and collecting the suite needn't pay them.
    from transformers import AutoTokenizer

    from harnessrl.trainer.warmstart import render

    home = tmp_path_factory.mktemp("mswea")
    taught = tool_calling_policy(tiny_model, home)
    rows, fixes, demos, policy = taught.rows, taught.fixes, taught.demos, taught.model
    tasks = home / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))

    # One model call per episode, sampled at temperature 1 (bounded, should a sample run on).
    options = "-c mini.yaml -c agent.step_limit=1 -c model.model_kwargs.temperature=1.0"
    options += " -c model.model_kwargs.max_tokens=200 -o ../trajectory.json -y --exit-immediately"
    harness = ["sh", "-c", f'exec {MINI} -m openai/policy -t "$HARNESSRL_TASK" {options}']
    spec = RunSpec(
        run="mswea", tasks=str(tasks), group_size=GROUP, batch_tasks=TASKS, max_concurrent=GROUP,
        mode="sync", staleness=0, max_steps=STEPS, episode_timeout_s=240, model=str(policy),
        launcher=LauncherSpec(kind="local", command=harness, env=MINI_ENV),
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(policy)
    rendered = {name: render(tokenizer, demo["messages"], demo["tools"]) for name, demo in demos.items()}
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
        with urllib.request.urlopen(f"{vllm.url}/weight_info", timeout=10) as info:
            served = json.loads(info.read())["weight_version"]
        records = asyncio.run(read_run(session.stack.nats_url, spec.run))
    finally:
        session.stop()
    # What each call sampled, as text (the tool call itself: vLLM's parser takes it out of `content`).
    sampled = {
        span.episode: str(tokenizer.decode(span.completions[0].token_ids, skip_special_tokens=True)).strip()
        for span in (decode(raw, Span) for raw in records["spans"])
    }
    calls = {row["instance_id"]: tool_call(fixes[row["instance_id"]]) for row in rows}
    return {
        "served": served, "before": before, "again": again, "after": after, "sampled": sampled,
        "fix_calls": calls, **records,
    }  # fmt: skip


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
    assert len(per_episode) == episodes and set(per_episode.values()) == {1}, per_episode
    rollouts = [decode(raw, RolloutComplete) for raw in loop_run["rollouts"]]
    assert len(rollouts) == episodes
    assert all(r.span_count == per_episode[r.episode] for r in rollouts)
    exits = {e.episode: e for e in events if isinstance(e, AgentExited)}
    for exited in exits.values():
        assert exited.artifact is None or exited.artifact.kind == "patch", exited


def test_sampled_fixes_resolve_for_real_and_the_rest_do_not(loop_run: dict[str, Any]) -> None:
    events = [decode_event(raw) for raw in loop_run["events"]]
    exits = {e.episode: e for e in events if isinstance(e, AgentExited)}
    scored = {e.episode: e for e in events if isinstance(e, EpisodeScored)}
    sampled, fix_calls = loop_run["sampled"], loop_run["fix_calls"]
    kinds: Counter[str] = Counter()
    for episode, score in sorted(scored.items()):
        log.info("%s %s %s %r", score.task, score.outcome, score.reward, sampled[episode][:160])
        artifact = exits[episode].artifact
        assert artifact is None or artifact.kind == "patch", artifact
        if sampled[episode] in (fix_calls[score.task], tool_call(ECHO)):
            # The patch was uploaded, and the reward service applied it and ran the task's tests,
            # SWE-bench style: the fix resolves the task, the echo does not.
            kind = "fix" if sampled[episode] == fix_calls[score.task] else "echo"
            assert artifact is not None and score.outcome == "graded", (score.outcome, score.details)
            assert (score.resolved, score.reward) == ((True, 1.0) if kind == "fix" else (False, 0.0)), score
        else:  # a sample that went wrong somewhere: whatever it did is scored, never failed
            kind = "other"
            assert score.outcome in SCORED_OUTCOMES and score.reward == float(bool(score.resolved)), score
            if artifact is None:  # it changed nothing
                assert score.outcome == "empty-patch", score
        kinds[kind] += 1
    assert kinds["fix"] > 0 and kinds["echo"] > 0, kinds


def test_steps_learn_from_groups_with_reward_variance(loop_run: dict[str, Any]) -> None:
    metrics = sorted((decode(raw, StepMetrics) for raw in loop_run["metrics"]), key=lambda m: m.step)
    assert [m.step for m in metrics] == list(range(1, STEPS + 1)), metrics
    for m in metrics:
        log.info("step %d %s", m.step, {k: round(v, 4) for k, v in sorted(m.values.items())})
    learned = [m.values for m in metrics if m.values["groups/trained"] > 0]
    assert learned, "no step had a group with mixed rewards"
    for values in learned:
        assert "step/skipped" not in values, values
        assert values["reward/std"] > 0 and values["rollouts/trained"] == GROUP * values["groups/trained"]
        # The loss *value* says nothing here: on-policy (ratio 1), with advantages summing to zero
        # in each group and each rollout's tokens normalised by its length, it is 0. Its gradient:
        assert values["tokens/trained"] > 0 and values["grad_norm"] > 0, values


def _branch(fix: list[int], echo: list[int]) -> int:
    """Tokens up to and including the first one where the fix and the echo tool calls part."""
    return next(i for i, (a, b) in enumerate(zip(fix, echo, strict=False)) if a != b) + 1


def test_policy_moved_toward_the_fix(loop_run: dict[str, Any]) -> None:
    """The served policy now chooses the fix more often than the echo on every task that taught it.

    Measured where the two tool calls part (`sed` vs `echo`): that choice is what the rewards
    ranked. The rest of a sampled fix varies (e.g. `value% right` also resolves the task), so the
    demonstration's exact spelling is not what a step pushes up.
    """
    before, again, after = loop_run["before"], loop_run["again"], loop_run["after"]
    noise = max(abs(sum(again[n].logprobs) - sum(before[n].logprobs)) for n in before)
    assert noise < 1e-3, noise
    events = [decode_event(raw) for raw in loop_run["events"]]
    groups: dict[str, set[float]] = {}
    for e in events:
        if isinstance(e, EpisodeScored):
            groups.setdefault(e.group, set()).add(e.reward)
    taught = {e.task for e in events if isinstance(e, EpisodeScored) and len(groups[e.group]) > 1}
    assert taught, groups
    for task in TASK_IDS:
        fix, echo = f"{task}/fix", f"{task}/echo"
        # The served weights changed: the same sequences score differently, far beyond the noise
        # (ten times what scoring the unchanged weights twice moved them, and at least 1e-3).
        for name in (fix, echo):
            moved = abs(sum(after[name].logprobs) - sum(before[name].logprobs))
            assert moved > max(10 * noise, 1e-3), (name, moved, noise)
        k = _branch(before[fix].tokens, before[echo].tokens)
        margin_before = sum(before[fix].logprobs[:k]) - sum(before[echo].logprobs[:k])
        margin_after = sum(after[fix].logprobs[:k]) - sum(after[echo].logprobs[:k])
        whole = (sum(before[fix].logprobs), sum(after[fix].logprobs))
        log.info("%s taught=%s choice margin %.3f -> %.3f, whole fix %.3f -> %.3f (noise %.1e)",
                 task, task in taught, margin_before, margin_after, *whole, noise)  # fmt: skip
        if task in taught:
            assert margin_after > margin_before, (task, margin_before, margin_after)


def test_new_version_served_and_stamped_on_the_next_episodes(loop_run: dict[str, Any]) -> None:
    """Every step is announced; each one that trained makes the next version, served and stamped.

    A step whose groups all had uniform rewards (about one run in a hundred here, seen in CI) trains
    nothing: it carries the previous version over instead of making an empty one.
    """
    weights = sorted((decode(raw, WeightVersion) for raw in loop_run["weights"]), key=lambda w: w.step)
    metrics = sorted((decode(raw, StepMetrics) for raw in loop_run["metrics"]), key=lambda m: m.step)
    trained = [m.trained for m in metrics]
    assert [w.step for w in weights] == list(range(1, STEPS + 1))
    assert [w.version for w in weights] == list(itertools.accumulate(int(t) for t in trained))
    assert [w.carries_previous for w in weights] == [not t for t in trained]
    assert loop_run["served"] == str(weights[-1].version)
    spans = [decode(raw, Span) for raw in loop_run["spans"]]
    assert {s.weight_version_start for s in spans} == {0, *(w.version for w in weights[:-1])}

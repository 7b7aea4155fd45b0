"""The follower's bookkeeping: failures by cause and the last error, a stopped run, steps that
trained nothing (warned about after three in a row, with their reasons), and what the summary says."""

from __future__ import annotations

import asyncio
import json

import msgspec
from rich.console import Console

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import (
    EpisodeCompleted,
    EpisodeFailed,
    EpisodeStarted,
    FailureCause,
    RunStopped,
    StepMetrics,
    WeightVersion,
)
from harnessrl.stack.follow import RunFollower, RunProgress, render, step_line
from harnessrl.stack.health import untrained_tokens, untrained_warnings

MISSING = "python: can't open file 'h.py': [Errno 2] No such file\n\nexit 2\nrunner.logged a line\n"


def failed(episode: str, cause: FailureCause = "agent", detail: str = "") -> EpisodeFailed:
    return EpisodeFailed(
        run="r", episode=episode, task="t", group="g", cause=cause, reason=f"harness exited 2 ({episode})",
        detail=detail, logs=f"/logs/{episode}",
    )  # fmt: skip


def step(number: int, *, trained: bool = True, version: int | None = None, **dropped: int) -> StepMetrics:
    return StepMetrics(
        run="r", step=number, version=number if version is None else version, values={"reward/mean": 0.0},
        dropped=dropped, trained=trained,
    )  # fmt: skip


def shown(progress: RunProgress) -> str:
    console = Console(width=200, record=True)
    console.print(render(progress))
    return " ".join(console.export_text().replace("│", " ").split())


def test_failures_are_counted_by_cause_and_the_last_error_shows_its_stderr() -> None:
    progress = RunProgress(run="r")
    progress.observe_episode(EpisodeStarted(run="r", episode="e0", task="t", group="g"))
    for episode, cause in (("e1", "agent"), ("e2", "infra"), ("e3", "agent")):
        progress.observe_episode(failed(episode, cause, MISSING if episode == "e3" else ""))
    progress.observe_episode(EpisodeCompleted(run="r", episode="e4", task="t", group="g", reward=1.0))
    assert progress.failures == {"agent": 2, "infra": 1}
    assert progress.last_failure is not None and progress.last_failure.episode == "e3"
    view = shown(progress)
    assert "episodes running 1, completed 1, failed 3" in view  # e0 still runs
    assert "failures by cause agent 2, infra 1" in view
    assert "agent: harness exited 2 (e3)" in view
    assert "can't open file 'h.py': [Errno 2]" in view and "exit 2" in view  # its first two lines
    assert "runner.logged" not in view
    assert progress.problems() == []  # failures alone (retried, outnumbered) are no verdict


def test_three_untrained_steps_in_a_row_warn_with_the_reason_counts() -> None:
    progress = RunProgress(run="r", max_steps=9)
    progress.observe_step(step(1, trained=False, version=0, no_trainable_tokens=4))
    progress.observe_step(step(2, trained=False, version=0, no_trainable_tokens=4))
    assert progress.warnings == [] and "warning" not in shown(progress)
    progress.observe_step(step(3, trained=False, version=0, no_trainable_tokens=2, zero_variance=2))
    [warning] = progress.warnings
    assert warning.counts == {"no_trainable_tokens": 10, "zero_variance": 2}
    said = "steps 1-3 (3 in a row) trained nothing: no_trainable_tokens 10, zero_variance 2"
    assert said in shown(progress)
    progress.observe_step(step(4, trained=False, version=0, no_trainable_tokens=4))
    assert [w.last_step for w in progress.warnings] == [4]  # the same streak grows


def test_a_trained_step_ends_a_streak_and_reasons_fall_back_to_skipped_groups() -> None:
    quiet = StepMetrics(run="r", step=5, version=1, values={"groups/zero_variance": 2.0}, trained=False)
    steps = [step(1, trained=False, version=0), step(2, trained=False, version=0), step(3, version=1)]
    steps += [step(4, trained=False, version=1), quiet, step(6, trained=False, version=1, stale=3)]
    [warning] = untrained_warnings(steps)
    assert (warning.first_step, warning.last_step) == (4, 6)
    assert warning.counts == {"groups/zero_variance": 2, "stale": 3}
    assert "no reason reported" in untrained_warnings(steps[:2], after=2)[0].message()


def test_a_run_that_trained_nothing_says_why_in_the_summary() -> None:
    progress = RunProgress(run="r", max_steps=3)
    for number in (1, 2, 3):
        progress.observe_step(step(number, trained=False, version=0, no_trainable_tokens=8))
        progress.observe_weights(WeightVersion(run="r", version=0, step=number, carries_previous=True))
    assert progress.finished() and progress.version == 0  # carried versions raise nothing
    [problem] = progress.problems()
    assert "nothing was trained" in problem and "no_trainable_tokens 24" in problem
    summary = json.loads(msgspec.json.encode(progress.summary()))
    assert summary["trained_steps"] == 0 and "no_trainable_tokens 24" in summary["why"]
    assert summary["warnings"][0]["counts"] == {"no_trainable_tokens": 24}
    assert "trained nothing" in summary["warnings"][0]["message"]


def test_a_trained_step_waits_for_its_weights_and_a_good_run_has_no_why() -> None:
    progress = RunProgress(run="r", max_steps=2)
    progress.observe_step(step(1, trained=False, version=0))
    progress.observe_step(step(2, version=1))
    assert not progress.finished()  # step 2 made version 1, not yet announced
    progress.observe_weights(WeightVersion(run="r", version=1, step=2))
    assert progress.finished() and progress.problems() == []
    summary = progress.summary()
    assert summary["trained_steps"] == 1 and summary["why"] is None and summary["stopped"] is None


def test_a_stopped_run_is_a_problem_with_its_cause_and_reason() -> None:
    progress = RunProgress(run="r", max_steps=5)
    progress.stopped = RunStopped(
        run="r", cause="agent", reason="harness exited 2", episodes=8, detail="cannot start", logs="/l"
    )
    assert progress.problems() == ["run r stopped: 8 episodes failed (agent): harness exited 2"]
    assert "stopped 8 episodes failed (agent): harness exited 2" in shown(progress)
    summary = json.loads(msgspec.json.encode(progress.summary()))
    stopped = summary["stopped"]
    assert {key: stopped[key] for key in ("cause", "reason", "episodes", "logs", "detail")} == {
        "cause": "agent", "reason": "harness exited 2", "episodes": 8, "logs": "/l", "detail": "cannot start",
    }  # fmt: skip


def test_the_view_shows_what_the_last_steps_left_untrained_by_reason() -> None:
    progress = RunProgress(run="r", max_steps=9)
    counts = {"tokens/sampled": 1000.0, "tokens/trainable": 1000.0, "tokens/dead_end": 0.0}
    progress.observe_step(StepMetrics(run="r", step=1, version=1, values=counts))
    assert untrained_tokens(progress.steps) is None and "untrained tokens" not in shown(progress)
    for number, (dead_end, unmodeled) in enumerate(((30.0, 0.0), (0.0, 0.0), (10.0, 50.0)), start=2):
        values = {**counts, "tokens/dead_end": dead_end, "tokens/unmodeled_sampling": unmodeled}
        progress.observe_step(StepMetrics(run="r", step=number, version=number, values=values))
    note = untrained_tokens(progress.steps)
    assert note is not None and note.counts == {"dead_end": 40, "unmodeled_sampling": 50}
    assert (
        "untrained tokens steps 1-4: 90 of 4,000 sampled (2.2%): unmodeled_sampling 50, dead_end 40"
        in shown(progress)
    )
    assert untrained_tokens(progress.steps, window=1) == msgspec.structs.replace(
        note, first_step=4, sampled=1000, counts={"unmodeled_sampling": 50, "dead_end": 10}
    )


async def test_the_follower_reads_failures_steps_and_the_stop_from_the_bus(bus: NatsBus) -> None:
    run = "follow-unit"
    follower = RunFollower(bus, run, max_steps=3)
    await follower.start()
    event = msgspec.structs.replace(failed("e1", "agent", "cannot start"), run=run)
    await bus.publish(subjects.episode_event(run, "e1", "failed"), event, msg_id=f"{run}-e1")
    metrics = msgspec.structs.replace(step(1, trained=False, version=0, no_trainable_tokens=2), run=run)
    await bus.publish(subjects.metrics(run, "trainer"), metrics, msg_id=f"{run}-m1")
    stop = RunStopped(run=run, cause="agent", reason="harness exited 2", episodes=1, detail="cannot start")
    await bus.publish(subjects.run_event(run, "stopped"), stop, msg_id=f"{run}-stopped")
    progress = follower.progress
    for _ in range(100):
        if progress.stopped is not None and progress.steps and progress.failures:
            break
        await asyncio.sleep(0.05)
    assert progress.stopped == stop
    assert progress.failures == {"agent": 1} and progress.last_failure is not None
    assert progress.last_failure.detail == "cannot start" and not progress.steps[0].trained


def test_without_a_terminal_each_step_is_one_line_with_what_the_view_shows() -> None:
    progress = RunProgress(run="r", max_steps=9)
    progress.observe_step(
        StepMetrics(run="r", step=3, version=3, values={"reward/mean": 0.25, "reward/pass_rate": 0.5})
    )
    line = step_line(progress)
    assert "\n" not in line and "phase" not in line
    assert line.startswith("step 3/9 (policy version 0) | reward mean 0.250 | pass rate 50.0% |")
    assert "episodes running 0, completed 0, failed 0" in line
    # The same rows as the live view, bar the phase.
    assert all(value in shown(progress) for value in ("3/9", "0.250", "50.0%"))

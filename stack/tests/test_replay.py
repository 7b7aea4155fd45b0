"""`harnessrl replay` against a real nats-server: its numbers are `build_rows`' on the same spans, and they
move when a policy flag does (a shorter `--max-seq-len` truncates, `--train-dead-ends` trains retries)."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections import Counter
from typing import Any

import pytest

from harnessrl.shared.bus import NatsBus
from harnessrl.stack.cli import main
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.span_sequences import EpisodeRecorder, RecordedEpisode, publish_episodes, record_group
from harnessrl.trainer.samples import build_rows
from harnessrl.trainer.settings import SampleLimits

PROMPT = [11, 12, 13, 14, 15, 16]


def retried(run: str, attempt: int) -> RecordedEpisode:
    """An episode whose harness re-sent its one call: the first completion is a dead end."""
    recorder = EpisodeRecorder(run, f"{run}-retry-a{attempt}")
    recorder.call(PROMPT, [20 + attempt, 21, 22])
    recorder.call(PROMPT, [30 + attempt, 31, 32, 33])
    return recorder, recorder.rollout(task="retry", group="retry", reward=float(attempt), group_size=2)


async def logged_run(bus: NatsBus) -> tuple[str, list[RecordedEpisode]]:
    """A run's log: one well-behaved group of four (rewards 0/1) and one group of two retries."""
    run = f"replay-{uuid.uuid4().hex[:8]}"
    episodes = [*record_group(run, "g0", random.Random(7), size=4), retried(run, 0), retried(run, 1)]
    await publish_episodes(bus, episodes)
    return run, episodes


async def replay(
    capsys: pytest.CaptureFixture[str], server: NatsServer, run: str, *flags: str
) -> dict[str, Any]:
    """Run `harnessrl replay --json` as a user would; the report."""
    capsys.readouterr()
    code = await asyncio.to_thread(main, ["replay", "--nats-url", server.url, "--run", run, "--json", *flags])
    assert code == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def expected(episodes: list[RecordedEpisode], limits: SampleLimits) -> dict[str, Any]:
    """What `build_rows` makes of the same spans, summed as the report sums it."""
    rows, counts, mismatches = Counter[int](), Counter[str](), Counter[str]()
    for recorder, rollout in episodes:
        built, report = build_rows(rollout.episode, recorder.spans, limits, temperature=1.0)
        rows[len(built)] += 1
        counts.update(
            sampled=report.sampled_tokens, trained=report.trained_tokens, truncated=report.truncated_rows,
            dead_end=report.dead_end_tokens, prompt_too_long=report.prompt_too_long_tokens,
            truncated_tokens=report.truncated_tokens,
        )  # fmt: skip
        mismatches.update(report.mismatches)
    return {"rows": rows, "counts": counts, "mismatches": dict(mismatches)}


def assert_matches(report: dict[str, Any], want: dict[str, Any]) -> None:
    tokens, untrained = report["tokens"], report["tokens"]["untrained_by_reason"]
    counts = want["counts"]
    assert report["rows"]["per_rollout"] == {str(n): count for n, count in sorted(want["rows"].items())}
    assert report["rows"]["built"] == sum(n * count for n, count in want["rows"].items())
    assert report["rows"]["truncated"] == counts["truncated"]
    assert (tokens["sampled"], tokens["trained"]) == (counts["sampled"], counts["trained"])
    assert (untrained["dead_end"], untrained["truncated"]) == (counts["dead_end"], counts["truncated_tokens"])
    assert untrained["prompt_too_long"] == counts["prompt_too_long"]
    assert tokens["sampled"] == tokens["trained"] + tokens["untrained"]
    assert report["mismatches"] == want["mismatches"]


async def test_the_report_is_what_build_rows_makes_of_the_logged_spans(
    bus: NatsBus, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run, episodes = await logged_run(bus)

    report = await replay(capsys, nats_server, run)

    assert_matches(report, expected(episodes, SampleLimits()))
    assert report["rollouts"] == {"logged": 6, "assembled": 6, "spans_incomplete": 0, "undecodable": 0}
    assert report["rows"]["single_row_rate"] == 1.0 and report["mismatches"] == {"retry": 2}
    assert report["tokens"]["untrained_by_reason"]["dead_end"] == 2 * 3
    assert report["tokens"]["masked_share"] == pytest.approx(6 / report["tokens"]["sampled"])
    assert report["temperature_used"] == 1.0
    assert report["groups"] == {"total": 2, "trained": 2, "zero_variance": 0, "too_small": 0, "dropped": {}}
    spread = report["advantages"]
    assert spread["count"] == 6 and spread["min"] < 0 < spread["max"]
    assert spread["mean"] == pytest.approx(0.0, abs=1e-6)


async def test_a_shorter_max_seq_len_truncates_and_dead_ends_can_be_trained(
    bus: NatsBus, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run, episodes = await logged_run(bus)
    default = await replay(capsys, nats_server, run)

    short = await replay(capsys, nats_server, run, "--max-seq-len", "14")
    assert_matches(short, expected(episodes, SampleLimits(max_seq_len=14, max_prompt_len=13)))
    assert short["policy"]["limits"] == {"max_seq_len": 14, "max_prompt_len": 13, "train_dead_ends": False}
    assert short["rows"]["truncated"] == 4  # each first call of g0 is cut at 14 tokens
    assert short["tokens"]["trained"] < default["tokens"]["trained"]

    dead_ends = await replay(capsys, nats_server, run, "--train-dead-ends", "--estimator", "rloo")
    assert_matches(dead_ends, expected(episodes, SampleLimits(train_dead_ends=True)))
    assert dead_ends["tokens"]["untrained_by_reason"]["dead_end"] == 0
    assert dead_ends["tokens"]["trained"] == default["tokens"]["trained"] + 2 * 3
    assert dead_ends["rows"]["per_rollout"] == {"1": 4, "2": 2}  # a retry's rows both train now
    assert dead_ends["policy"]["advantages"]["estimator"] == "rloo"


async def test_the_table_shows_rows_break_classes_and_masked_share(
    bus: NatsBus, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = await logged_run(bus)
    capsys.readouterr()

    code = await asyncio.to_thread(main, ["replay", "--nats-url", nats_server.url, "--run", run])

    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert code == 0
    assert "single-row rate 100.0%" in out and "break classes retry 2" in out
    assert "masked share 11.1%: dead_end 6 (11.1%)" in out
    assert "groups 2: trained 2, zero variance 0, too small 0" in out


async def test_a_run_with_nothing_logged_and_impossible_limits_are_errors(
    nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = nats_server.url
    assert await asyncio.to_thread(main, ["replay", "--nats-url", url, "--run", "nobody-ran-this"]) == 1
    assert "no rollout of run nobody-ran-this" in capsys.readouterr().err
    limits = ["--max-seq-len", "10", "--max-prompt-len", "20"]
    assert await asyncio.to_thread(main, ["replay", "--nats-url", url, "--run", "r", *limits]) == 2
    assert "max_seq_len" in capsys.readouterr().err

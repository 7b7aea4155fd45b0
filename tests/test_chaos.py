"""`make chaos`, shortened: every kind of process killed -9 once under real traffic, nothing lost.

The run is the benchmark itself (`python -m harnessrl.benchmarks.chaos`) on real processes: a 3-node
NATS cluster, two gateways behind HAProxy, two controllers, two reward workers, the real trainer on
the tiny model and a canned upstream; five kills (a NATS node, a gateway, the active controller, a
reward worker, the trainer) inside one step of 16 eight-call episodes. Its last line must report
every invariant held. Beside it, the plan is checked to be the seed's alone, and the reconciliation
to catch each fault it exists to catch (a lost span, a span stored twice, a second terminal event,
a version that does not increase), so a green chaos run means something.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec

from harnessrl.benchmarks.chaos_plan import KINDS, TrainedLedger, plan
from harnessrl.benchmarks.reconcile import BusRecord, verify, versions_increase
from harnessrl.shared.contracts import EpisodeCompleted, EpisodeScheduled, Span, WeightVersion


def test_a_short_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "harnessrl.benchmarks.chaos",
        "--calls",
        "128",
        "--kills",
        "5",
        "--seed",
        "7",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=420, check=False)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    assert last.startswith("{"), (done.returncode, done.stdout[-3000:], done.stderr[-5000:])
    report = json.loads(last)
    why = {k: report.get(k) for k in ("invariants_failed", "stalled", "error", "episode_phases_at_end",
                                      "kill_log", "unplanned_restarts", "wall_s")}  # fmt: skip
    assert done.returncode == 0, (json.dumps(why), done.stderr[-3000:])
    assert report["invariants_failed"] == []
    assert report["calls"] >= 128 and report["episodes"] >= 16
    assert report["kills"] == 5 and sorted(report["kills_by_kind"]) == sorted(KINDS)
    assert report["lost_spans"] == 0 and report["duplicate_spans"] == 0
    assert report["terminal_exactly_once"] and report["finished"]
    assert report["rollouts_trained_twice"] == 0 and report["rollouts_trained"] >= 1


def test_the_plan_is_the_seeds_alone() -> None:
    first = plan(3, 10, 2000, (0.5, 3.0))
    assert first == plan(3, 10, 2000, (0.5, 3.0))
    assert first != plan(4, 10, 2000, (0.5, 3.0))
    assert sorted(kill.kind for kill in first) == sorted(KINDS * 2)  # each kind in turn, twice
    points = [kill.at_calls for kill in first]
    assert points == sorted(points) and points[0] >= 100 and points[-1] <= 1700


def _span(episode: str, seq: int, span_id: str) -> Span:
    return Span(span_id=span_id, run="r", episode=episode, seq=seq, api="chat")


def _record(spans: list[Span], *, second_terminal: bool = False, weights: list[int] = [1, 2]) -> BusRecord:  # noqa: B006
    scheduled = EpisodeScheduled(run="r", episode="e", task="t", group="g")
    completed = EpisodeCompleted(run="r", episode="e", task="t", group="g", reward=1.0)
    return BusRecord(
        spans=spans, events=[scheduled, completed, *([completed] if second_terminal else [])], rollouts=[],
        weights=[WeightVersion(run="r", version=v, step=i + 1) for i, v in enumerate(weights)], steps=[],
        load_spans=[],
    )  # fmt: skip


def test_the_reconciliation_catches_each_fault() -> None:
    spans = [_span("e", 0, "s0"), _span("e", 1, "s1")]
    clean = verify(_record(spans), ["s0", "s1"])
    assert clean["spans_missing"] == clean["seq_gaps"] == clean["span_ids_stored_twice"] == 0
    assert clean["terminal_exactly_once"] and clean["versions_strictly_increase"]
    assert verify(_record(spans[:1]), ["s0", "s1"])["spans_missing"] == 1
    assert verify(_record([spans[0], spans[1], spans[1]]), ["s0", "s1"])["span_ids_stored_twice"] == 1
    assert verify(_record([spans[0], _span("e", 2, "s2")]), ["s0", "s2"])["seq_gaps"] == 1
    assert not verify(_record(spans, second_terminal=True), ["s0", "s1"])["terminal_exactly_once"]
    assert not verify(_record(spans, weights=[1, 1]), ["s0", "s1"])["versions_strictly_increase"]
    carried = [
        WeightVersion(run="r", version=1, step=1),
        WeightVersion(run="r", version=1, step=2, carries_previous=True),
    ]
    assert versions_increase(carried)


def test_the_ledger_counts_a_rollout_trained_under_two_versions(tmp_path: Path) -> None:
    for step, trained in ((1, {0: ["a", "b"]}), (2, {0: ["a", "b"], 1: ["c", "a"]})):
        directory = tmp_path / f"step-{step:06d}"
        directory.mkdir()
        (directory / "trainer_state.json").write_bytes(msgspec.json.encode({"trained": trained}))
    ledger = TrainedLedger(tmp_path)
    ledger.read()
    assert ledger.trained() == 3 and ledger.trained_twice() == 1

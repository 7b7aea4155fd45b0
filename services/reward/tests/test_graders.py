"""Simple graders, the plug-in interface, and the rules and log parsing they rely on."""

import asyncio
import sys
import tomllib
from pathlib import Path

import pytest

from harnessrl.reward.errors import UnknownGraderError
from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.graders.simple import last_number
from harnessrl.reward.grading import build_grader
from harnessrl.reward.settings import GradingRules
from harnessrl.reward.swe.rules import evaluate, exit_code_agrees, log_agrees, reward_of
from harnessrl.shared.contracts import TaskSpec

CONTEXT = GradingContext()


def qa(answer: str, grader: str) -> TaskSpec:
    return TaskSpec(task_id="t", kind="qa", prompt="?", answer=answer, grader=grader)


@pytest.mark.parametrize(
    ("grader", "answer", "artifact", "reward"),
    [
        ("numeric", "408", b"CALC 17*24\nRESULT 408\nANSWER 408", 1.0),
        ("numeric", "408", b"ANSWER 407", 0.0),
        ("numeric", "408", b"ANSWER 408.0", 1.0),
        ("numeric", "1234", b"the answer is 1,234", 1.0),
        ("numeric", "-3.5", b"ANSWER -3.5", 1.0),
        ("numeric", "408", b"408 ... no wait, ANSWER 409", 0.0),
        ("numeric", "408", b"no number at all", 0.0),
        ("exact", "Paris", b"  paris \n", 1.0),
        ("exact", "Paris", b"Paris, France", 0.0),
        ("regex", r"\bANSWER\s+408\b", b"ANSWER 408", 1.0),
        ("regex", r"\bANSWER\s+408\b", b"ANSWER 4080", 0.0),
    ],
)
async def test_simple_graders(grader: str, answer: str, artifact: bytes, reward: float) -> None:
    grade = await build_grader(grader, CONTEXT).grade(qa(answer, grader), artifact)
    assert grade.reward == reward
    assert grade.resolved is (reward == 1.0)
    assert grade.outcome == "graded"


@pytest.mark.parametrize("artifact", [b"\xff\xfe ANSWER 408", b"ANSWER \x00408", b"9" * 70000])
async def test_simple_graders_reject_garbage(artifact: bytes) -> None:
    grade = await build_grader("numeric", CONTEXT).grade(qa("408", "numeric"), artifact)
    assert (grade.outcome, grade.reward) == ("invalid-artifact", 0.0)


def test_last_number() -> None:
    assert last_number("CALC 3*4 RESULT 12 ANSWER 12.") == 12.0
    assert last_number("nothing") is None


PLUGIN = '''
from harnessrl.reward.graders.base import Grade


class LengthGrader:
    """Rewards short answers: a custom reward someone ships in their own package."""

    async def grade(self, task, artifact):
        return Grade(reward=1.0 / (1 + len(artifact)), resolved=None, details={"len": len(artifact)})
'''


async def test_plugin_grader_is_found_by_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "shortness.py").write_text(PLUGIN)
    dist = tmp_path / "shortness-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shortness\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[harnessrl.graders]\nshortness = shortness:LengthGrader\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    grade = await build_grader("shortness", CONTEXT).grade(qa("", "shortness"), b"abc")
    assert grade.reward == 0.25 and grade.details == {"len": 3}
    monkeypatch.delitem(sys.modules, "shortness")


def test_unknown_grader() -> None:
    with pytest.raises(UnknownGraderError):
        build_grader("no-such-grader", CONTEXT)


def test_unknown_grader_names_the_registered_ones() -> None:
    with pytest.raises(UnknownGraderError, match=r"'no-such-grader'.*known: exact, numeric, regex, swebench"):
        build_grader("no-such-grader", CONTEXT)


async def test_custom_reward_example_is_found_by_its_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`examples/custom-reward`, registered exactly as its pyproject.toml says, grades like a built-in."""
    example = Path(__file__).parents[3] / "examples" / "custom-reward"
    project = tomllib.loads((example / "pyproject.toml").read_text())["project"]
    registered = project["entry-points"]["harnessrl.graders"]
    dist = tmp_path / "tokenbudget_grader-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: 0.1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in registered.items())
    (dist / "entry_points.txt").write_text(f"[harnessrl.graders]\n{lines}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(example / "src"))
    grader = build_grader("tokenbudget", CONTEXT)
    short = await grader.grade(qa("408", "tokenbudget"), b"ANSWER 408")
    long = await grader.grade(qa("408", "tokenbudget"), b"x" * 54 + b"ANSWER 408")
    assert (short.reward, short.resolved) == (1.0, True)
    assert (long.reward, long.details["length_penalty"]) == (0.5, 0.5)
    monkeypatch.delitem(sys.modules, "tokenbudget_grader")


def test_f2p_statuses() -> None:
    f2p = ["t::pass", "t::xfail", "t::skip", "t::fail", "t::error", "t::missing"]
    statuses = {
        "t::pass": "PASSED",
        "t::xfail": "XFAIL",
        "t::skip": "SKIPPED",
        "t::fail": "FAILED",
        "t::error": "ERROR",
    }
    report = evaluate(statuses, f2p, [])
    assert report.f2p_success == ["t::pass"]
    assert report.resolution == "RESOLVED_PARTIAL"
    assert not report.resolved


def test_p2p_statuses_and_partial_credit() -> None:
    statuses = {"t::a": "PASSED", "t::b": "SKIPPED", "t::c": "FAILED", "t::d": "PASSED"}
    report = evaluate(statuses, ["t::a", "t::c"], ["t::b", "t::d"])
    assert report.p2p_failure == [] and report.f2p_rate == 0.5
    assert reward_of(report) == 0.0
    assert reward_of(report, GradingRules(partial_credit=True)) == 0.5
    broken = evaluate(statuses, ["t::a"], ["t::c"])
    assert broken.resolution == "RESOLVED_NO"


def test_exit_code_and_log_must_agree_with_the_report() -> None:
    assert exit_code_agrees(0, {"t::a": "PASSED"})
    assert not exit_code_agrees(0, {"t::a": "FAILED"})
    assert not exit_code_agrees(1, {"t::a": "PASSED"})
    assert not exit_code_agrees(0, {})
    assert exit_code_agrees(2, {"t.py": "ERROR"})
    assert log_agrees({"t::a": "FAILED"}, {"t::a": "ERROR"}, ["t::a"])
    assert not log_agrees({"t::a": "FAILED"}, {"t::a": "PASSED"}, ["t::a"])
    assert not log_agrees({}, {"t::a": "PASSED"}, ["t::a"])


async def test_a_backtracking_pattern_times_out_without_stalling_other_gradings() -> None:
    """`^(a|aa)+$` on 60 a's and a b takes ages to fail; the grade gives up and the loop keeps going."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    beat = asyncio.create_task(ticker())
    try:
        grader = build_grader("regex", CONTEXT)
        grade = await asyncio.wait_for(grader.grade(qa(r"^(a|aa)+$", "regex"), b"a" * 60 + b"b"), 30)
        quick = await grader.grade(qa(r"^a+b$", "regex"), b"a" * 60 + b"b")
    finally:
        beat.cancel()
    assert (grade.outcome, grade.reward, grade.scored) == ("timeout", 0.0, False), grade
    assert "ran past" in grade.details["reason"]
    assert (quick.outcome, quick.reward) == ("graded", 1.0)
    assert ticks >= 10  # the event loop ran other work while the search was stuck (1 s at 20 Hz)

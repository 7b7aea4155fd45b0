"""The coding demo's task family: disjoint splits, real SWE-bench grading, demonstrations as captured.

- Training and held-out instances share no repository, file, function, constant or value.
- The reward service's SWE-bench grader (fresh clone at the base commit, test patch, pytest in the
  sandbox) resolves the gold patch, and neither a wrong edit nor an empty patch.
- What the agent sees when it runs the tests names the fix: file, constant, current and expected value.
- `replay` rebuilds exactly what the real mini-swe-agent sends for a trajectory (captured live).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.graders.swebench import SweBenchGrader
from harnessrl.reward.settings import SandboxLimits
from harnessrl.reward.swe.sandbox import available_limits
from harnessrl.shared.contracts import TaskSpec
from harnessrl.stack.demo import swe_demos, swe_tasks
from harnessrl.stack.demo.swe_run import SweDemoSettings
from harnessrl.testkit.tools import MINI_SWE_AGENT

TRAIN, HELDOUT = 40, 100


def identifiers(spec: swe_tasks.SweInstanceSpec) -> dict[str, set[Any]]:
    return {
        "repo": {spec.name},
        "file": {spec.path, spec.test_path, spec.package, spec.module},
        "name": {spec.function, spec.constant, spec.helper},
        "value": {spec.old, spec.new},
    }


def test_training_and_heldout_share_no_repo_file_function_or_value() -> None:
    # Every training instance the demo imitates or trains on, against the held-out set.
    demos = SweDemoSettings().demo_instances
    train = swe_tasks.instance_specs("train", demos)
    heldout = swe_tasks.instance_specs("heldout", 120)
    assert len({s.name for s in heldout}) == 120 and len({s.name for s in train}) == demos
    # The RL tasks (repositories built) are the first training instances, so imitated too.
    assert [s.name for s in swe_tasks.instance_specs("train", TRAIN)] == [s.name for s in train[:TRAIN]]
    for kind in ("repo", "file", "name", "value"):
        seen_train = set().union(*(identifiers(s)[kind] for s in train))
        seen_heldout = set().union(*(identifiers(s)[kind] for s in heldout))
        assert not seen_train & seen_heldout, (kind, sorted(seen_train & seen_heldout)[:5])
    # The rows say which split they are, and the controller reads that.
    rows = swe_tasks.load_rows(swe_tasks.ensure_split("heldout", HELDOUT))
    assert len(rows) == HELDOUT and all(row["heldout"] for row in rows)
    assert not any(row["heldout"] for row in swe_tasks.load_rows(swe_tasks.ensure_split("train", TRAIN)))


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return swe_tasks.load_rows(swe_tasks.ensure_split("train", TRAIN))


def task_of(row: dict[str, Any]) -> TaskSpec:
    """The row as its split's task file has it: `repo_path` relative to the split's folder."""
    return TaskSpec(
        task_id=row["instance_id"],
        kind="swe",
        prompt=row["problem_statement"],
        grader="swebench",
        instance=row | {"repo_path": str(Path(row["repo_path"]).relative_to(split_folder()))},
    )


def split_folder() -> Path:
    return swe_tasks.ensure_split("train", TRAIN).parent


def agent_patch(row: dict[str, Any], command: str) -> bytes:
    """What the episode runner uploads after `command` ran in a fresh checkout."""
    with tempfile.TemporaryDirectory() as tmp:
        work = swe_demos.checkout(row, Path(tmp) / "w")
        subprocess.run(["sh", "-c", command], cwd=work, check=True, capture_output=True)
        subprocess.run(["git", "add", "-A"], cwd=work, check=True)
        return subprocess.run(
            ["git", "diff", "--cached", row["base_commit"]], cwd=work, check=True, capture_output=True
        ).stdout


async def test_gold_fix_resolves_and_wrong_or_empty_patches_do_not(rows: list[dict[str, Any]]) -> None:
    # What this machine's sandbox gives (the reward service's tests do the same).
    limits = available_limits(SandboxLimits(), sys.executable)
    context = GradingContext(tasks_root=str(split_folder()), python=sys.executable, limits=limits)
    grader = SweBenchGrader(context)
    for row in rows[:3]:
        spec = swe_tasks.spec_of(row)
        fixed = await grader.grade(task_of(row), agent_patch(row, spec.fix_command()))
        assert (fixed.outcome, fixed.resolved, fixed.reward) == ("graded", True, 1.0), fixed
        wrong = await grader.grade(
            task_of(row), agent_patch(row, f"sed -i 's/= {spec.old}/= {spec.old}1/' {spec.path}")
        )
        assert (wrong.outcome, wrong.resolved, wrong.reward) == ("graded", False, 0.0), wrong
        empty = await grader.grade(task_of(row), b"")
        assert (empty.outcome, empty.reward) == ("empty-patch", 0.0), empty


def test_the_failing_test_names_the_fix(rows: list[dict[str, Any]]) -> None:
    row = rows[0]
    spec = swe_tasks.spec_of(row)
    with tempfile.TemporaryDirectory() as tmp:
        work = swe_demos.checkout(row, Path(tmp) / "w")
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "COLUMNS": "150",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        }
        seen = subprocess.run(
            ["sh", "-c", swe_tasks.TEST_COMMAND],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    assert seen.returncode == 1
    assert seen.stdout.endswith(swe_demos.failure_line(spec)), seen.stdout
    assert f"{spec.constant} = {spec.old} should be {spec.new}" in seen.stdout


def test_replay_is_exactly_what_mini_swe_agent_sends(rows: list[dict[str, Any]], tmp_path: Path) -> None:
    config = swe_demos.write_config(tmp_path / "mini-demo.yaml")
    first, other = rows[0], rows[1]
    captured = swe_demos.trajectory(MINI_SWE_AGENT, config, first, swe_tasks.spec_of(first).fix_command())
    spec = swe_tasks.spec_of(other)
    for edit in (spec.fix_command(), swe_demos.wrong_fix(spec)):
        real = swe_demos.trajectory(MINI_SWE_AGENT, config, other, edit)
        assert swe_demos.replay(captured, swe_tasks.spec_of(first), spec, edit) == real
    # Two calls: look (the test command), then act; the second request carries the observation.
    assert [m["role"] for m in captured["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert swe_demos.failure_line(swe_tasks.spec_of(first)).strip() in captured["messages"][3]["content"]


def test_the_demo_tokenizer_spells_training_and_heldout_names_alike(
    rows: list[dict[str, Any]], tmp_path: Path, tiny_model: Path
) -> None:
    from transformers import AutoTokenizer

    from harnessrl.stack.demo.tiny_model import build_tiny_model

    config = swe_demos.write_config(tmp_path / "mini-demo.yaml")
    reference = swe_tasks.spec_of(rows[0])
    captured = swe_demos.trajectory(MINI_SWE_AGENT, config, rows[0], reference.fix_command())
    specs = swe_tasks.instance_specs("train", 40)
    demos = [swe_demos.replay(captured, reference, spec, spec.fix_command()) for spec in specs]
    words = swe_tasks.split_of()[0]
    corpus = swe_demos.tokenizer_corpus(demos, tiny_model, words["train"])
    assert all(swe_tasks.TEST_COMMAND in text for text in corpus)
    assert not [w for w in words["train"] for text in corpus if w in text or w.upper() in text]
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "model", corpus, vocab_size=1024))
    # The fixed text is a few tokens; names are spelled in short pieces, alike in both splits.
    assert len(tokenizer(swe_tasks.TEST_COMMAND)["input_ids"]) <= 12

    def chars_per_token(split: str) -> float:
        names = [f"{w}_{w.upper()}" for w in words[split]]
        return sum(map(len, names)) / sum(len(tokenizer(n)["input_ids"]) for n in names)

    assert abs(chars_per_token("train") / chars_per_token("heldout") - 1) < 0.2

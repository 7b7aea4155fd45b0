"""The coding demo's task family: tiny Python repositories with one wrong constant each.

Each instance is its own git repository (a package with one module and one test module). The module
defines a constant whose value is wrong; the visible test fails with a message that names the file,
the constant, its current value and the value it should have, e.g.

    FAILED tests/test_kettle.py::test_max_lamp - AssertionError: fern_moss/kettle.py: MAX_LAMP = 41
    should be 67

so an agent that runs the tests (call 1) can read the one-line fix off what it sees and make it
with `sed` (call 2): `sed -i 's/= 41$/= 67/' $(git ls-files '*.py')`. Graded SWE-bench style: the
test patch adds a hidden test of the function that uses the constant; FAIL_TO_PASS is the visible
test and the hidden one, PASS_TO_PASS a test of an unrelated helper in the same file.

Training and held-out instances are built from disjoint word lists and disjoint value sets, so they
share no repository, file, function, constant or value (`tests/test_demo_swe_tasks.py` checks it).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any, Literal

import msgspec

from harnessrl.reward.tinyswe.instances import git_diff
from harnessrl.reward.tinyswe.repos import Snapshot, write_repository
from harnessrl.shared.cache import build_once, cache_root

Split = Literal["train", "heldout"]
SEED = 20260
# The command the problem statement asks for: it prints one short summary line per failing test.
TEST_COMMAND = "python -m pytest -qq --tb=no"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
WORDS = (
    "amber", "anvil", "aspen", "badge", "basil", "birch", "bison", "cedar", "cider", "clove",
    "cobra", "comet", "coral", "crane", "daisy", "delta", "dune", "eagle", "ember", "fable",
    "fern", "flint", "frost", "gecko", "ginger", "glade", "grove", "harbor", "hazel", "heron",
    "iris", "ivory", "jade", "jasper", "juniper", "kettle", "koala", "lamp", "larch", "lemon",
    "lotus", "lunar", "maple", "marsh", "meadow", "mint", "moss", "nectar", "noble", "oak",
    "olive", "onyx", "orbit", "otter", "pebble", "pepper", "pine", "plum", "quartz", "quill",
    "raven", "reed", "ridge", "river", "robin", "sage", "salt", "shell", "slate", "spruce",
    "stone", "swan", "thistle", "tiger", "topaz", "tulip", "umber", "valley", "velvet", "violet",
    "walnut", "willow", "wren", "yarrow", "zephyr", "zinc", "acorn", "bramble", "cinder", "dove",
)  # fmt: skip
VALUES = tuple(range(10, 100))
# A third of the words and values are held out.
HELDOUT_SHARE = 3


class SweInstanceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What decides one instance: its names and values."""

    split: str
    package: str
    module: str
    constant: str
    function: str
    helper: str
    old: int
    new: int

    @property
    def name(self) -> str:
        """The repository and instance name."""
        return self.package.replace("_", "-") + "-" + self.module

    @property
    def path(self) -> str:
        """The module the fix edits."""
        return f"{self.package}/{self.module}.py"

    @property
    def test_path(self) -> str:
        """The test module (visible at the base commit, extended by the test patch)."""
        return f"tests/test_{self.module}.py"

    def fix_command(self) -> str:
        """The gold one-line fix as the agent would write it, submitting in the same command."""
        return edit_command(self.old, self.new)


# Where the edit looks: every tracked Python file (the fix), or only the tests (a failed edit).
SOURCES, TESTS = "$(git ls-files '*.py')", "tests/*.py"


def edit_command(old: int, new: int, where: str = SOURCES) -> str:
    """A one-line edit that sets the constant assigned `old` to `new` in the files `where` names."""
    return f"sed -i 's/= {old}$/= {new}/' {where} && {SUBMIT}"


def split_of(seed: int = SEED) -> tuple[dict[Split, list[str]], dict[Split, list[int]]]:
    """The disjoint word and value sets of the two splits."""
    rng = random.Random(seed)  # noqa: S311 - reproducible task set, not security
    words, values = list(WORDS), list(VALUES)
    rng.shuffle(words)
    rng.shuffle(values)
    w, v = len(words) // HELDOUT_SHARE, len(values) // HELDOUT_SHARE
    return (
        {"heldout": words[:w], "train": words[w:]},
        {"heldout": values[:v], "train": values[v:]},
    )


def instance_specs(split: Split, count: int, seed: int = SEED) -> list[SweInstanceSpec]:
    """`count` distinct instances of `split` (their repository names are unique)."""
    words, values = split_of(seed)
    rng = random.Random(f"{seed}-{split}")  # noqa: S311 - reproducible task set, not security
    found: dict[str, SweInstanceSpec] = {}
    for _ in range(count * 50):
        if len(found) == count:
            break
        a, b, c, d, e = rng.sample(words[split], 5)
        old, new = rng.sample(values[split], 2)
        spec = SweInstanceSpec(
            split=split, package=f"{a}_{b}", module=c, constant=f"MAX_{d.upper()}",
            function=f"{d}_total", helper=f"clean_{e}", old=old, new=new,
        )  # fmt: skip
        found.setdefault(spec.name, spec)
    if len(found) < count:
        raise ValueError(f"only {len(found)} distinct {split} instances, asked for {count}")
    return list(found.values())


def module_source(spec: SweInstanceSpec, value: int) -> str:
    """The module with the constant set to `value`."""
    return (
        f'"""The {spec.module} helpers of {spec.package}."""\n\n'
        f"{spec.constant} = {value}\n\n\n"
        f"def {spec.function}(count):\n"
        f'    """Return `count` times {spec.constant}."""\n'
        f"    return count * {spec.constant}\n\n\n"
        f"def {spec.helper}(text):\n"
        f'    """Return `text` without surrounding blanks."""\n'
        "    return text.strip()\n"
    )


def expectation(spec: SweInstanceSpec, current: str) -> str:
    """The visible test's assertion message, the constant's value shown as `current`."""
    return f"{spec.path}: {spec.constant} = {current} should be {spec.new}"


def test_source(spec: SweInstanceSpec, *, hidden: bool) -> str:
    """The test module; `hidden` adds the function's test (the test patch)."""
    names = [spec.constant, spec.helper] + ([spec.function] if hidden else [])
    message = expectation(spec, f"{{{spec.constant}}}")
    text = f"from {spec.package}.{spec.module} import {', '.join(names)}\n\n\n"
    text += f"def test_{spec.constant.lower()}():\n"
    text += f'    assert {spec.constant} == {spec.new}, f"{message}"\n\n\n'
    text += f'def test_{spec.helper}():\n    assert {spec.helper}("  {spec.module} ") == "{spec.module}"\n'
    if hidden:
        text += f"\n\ndef test_{spec.function}():\n    assert {spec.function}(3) == {3 * spec.new}\n"
    return text


def scaffold(spec: SweInstanceSpec) -> dict[str, str]:
    """Packaging, pytest configuration and ignores of every repository."""
    return {
        "pyproject.toml": (
            f'[project]\nname = "{spec.name}"\nversion = "0.1.0"\n\n'
            '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["."]\n'
        ),
        ".gitignore": "__pycache__/\n*.pyc\n.pytest_cache/\n",
        f"{spec.package}/__init__.py": "",
    }


def problem_statement(spec: SweInstanceSpec) -> str:
    """The issue text: which project, and how to see what is wrong."""
    return f"A test of {spec.name} fails. Run `{TEST_COMMAND}` to see it, then fix the code."


def write_instance(spec: SweInstanceSpec, repos: Path) -> dict[str, Any]:
    """Write the instance's repository under `repos`; returns its SWE-bench row."""
    files = scaffold(spec) | {
        spec.path: module_source(spec, spec.old),
        spec.test_path: test_source(spec, hidden=False),
    }
    snapshot = Snapshot(tag="base", message=f"{spec.name}: base\n", files=files)
    repo = repos / spec.name
    root, commits = write_repository(repo, scaffold(spec), [snapshot])
    test_id = f"{spec.test_path}::test_"
    return {
        "instance_id": f"swegen__{spec.name}",
        "repo": f"swegen/{spec.name}",
        "base_commit": commits["base"],
        "environment_setup_commit": root,
        "patch": git_diff(spec.path, module_source(spec, spec.old), module_source(spec, spec.new)),
        "test_patch": git_diff(
            spec.test_path, test_source(spec, hidden=False), test_source(spec, hidden=True)
        ),
        "problem_statement": problem_statement(spec),
        "FAIL_TO_PASS": json.dumps([f"{test_id}{spec.constant.lower()}", f"{test_id}{spec.function}"]),
        "PASS_TO_PASS": json.dumps([f"{test_id}{spec.helper}"]),
        "repo_path": f"repos/{spec.name}",
        "version": "0.1",
        "heldout": spec.split == "heldout",
        "spec": msgspec.to_builtins(spec),
    }


def build_split(out: Path, split: Split, count: int) -> Path:
    """Write `count` instances of `split` into `out` (repos/ and instances.jsonl); returns the JSONL."""
    rows = [write_instance(spec, out / "repos") for spec in instance_specs(split, count)]
    path = out / "instances.jsonl"
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    return path


def ensure_split(split: Split, count: int) -> Path:
    """The cached instances of `split` (built once per machine); returns the JSONL path."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + f"{split} {count}".encode()).hexdigest()[:16]
    target = cache_root() / "swe-demo-tasks" / f"{split}-{count}-{digest}"
    build_once(target, lambda staging: build_split(staging, split, count), done="instances.jsonl")
    return target / "instances.jsonl"


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of an instances file, their `repo_path` made absolute (for this process to clone)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row | {"repo_path": str(path.parent / row["repo_path"])} for row in rows]


def place_tasks(rows: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """`rows` (absolute `repo_path`) as rows of a task file in `folder`, which services read.

    A task file's repositories must lie under its folder (`harnessrl.shared.taskpaths`): each is
    copied to `folder/repos/<name>`, and the row's `repo_path` says so, relative.
    """
    placed = []
    for row in rows:
        source = Path(row["repo_path"])
        relative = f"repos/{source.name}"
        shutil.copytree(source, folder / relative, symlinks=True, dirs_exist_ok=True)
        placed.append(row | {"repo_path": relative})
    return placed


def spec_of(row: dict[str, Any]) -> SweInstanceSpec:
    """The spec an instance row was built from."""
    return msgspec.convert(row["spec"], SweInstanceSpec)

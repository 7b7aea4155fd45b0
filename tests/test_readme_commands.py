"""Every README command, run as written, and what the README promises about it.

The commands come from the READMEs themselves (`harnessrl.testkit.readme`: fenced blocks tagged
`sh`; `examples/README.md` states the convention), so a changed README is a changed test. Each
section runs in a fresh copy of the repository with `.venv/bin` first on PATH; the one change made to
a command is `--max-steps N` on `harnessrl train`, which README.md documents as the way to try a run
shorter than its spec. What a section needs that the README says a reader already has is provided
the cheap way (`harnessrl.testkit.policies`, each built once per machine): `.harnessrl/demo/warm`
(after `make demo`) is the demo's warm start; `MODEL` of the mini-swe-agent example is the
tiny policy warm-started to answer mini-swe-agent's first tinyswe request with a bash tool call;
`pip` installs into a throwaway environment layered over `.venv`, so the shared dev environment is
left as it was. Then the section's promise is checked.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from harnessrl.shared.runspec import load_run_spec
from harnessrl.testkit import policies
from harnessrl.testkit.readme import ReadmeError, Section, blocks, sections, shorten
from harnessrl.testkit.readme_run import BlockRun, SectionRun

log = logging.getLogger(__name__)
ROOT = Path(__file__).parents[1]
READMES = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted(ROOT.glob("examples/*/README.md"))]
SECTIONS = {section.id: section for readme in READMES for section in sections(readme, ROOT)}


# --- the extractor ------------------------------------------------------------------------------------

SAMPLE = """# Title

```text
harnessrl train run.toml   # a template: shown, not run
```

## Deploy it

````sh background ready="up:"
harnessrl up --nats-port 4222
````

```sh
harnessrl train a.toml --nats-url nats://x   # follow it
```

## Other

~~~toml
run = "x"
~~~
"""


def test_blocks_keep_tag_heading_attributes_and_line() -> None:
    found = blocks(SAMPLE)
    assert [(b.tag, b.heading, b.line, b.background, b.ready) for b in found] == [
        ("text", "Title", 3, False, ""),
        ("sh", "Deploy it", 9, True, "up:"),
        ("sh", "Deploy it", 13, False, ""),
        ("toml", "Other", 19, False, ""),
    ]
    assert found[1].text == "harnessrl up --nats-port 4222\n"
    assert [b.runs for b in found] == [False, True, True, False]


def test_sections_group_runnable_blocks_by_heading(tmp_path: Path) -> None:
    readme = tmp_path / "docs" / "README.md"
    readme.parent.mkdir()
    readme.write_text(SAMPLE)
    (section,) = sections(readme, tmp_path)
    assert section.id == "docs/README.md#deploy-it"
    assert [b.line for b in section.blocks] == [9, 13]


@pytest.mark.parametrize(
    ("markdown", "message"),
    [
        ("# T\n```\nls\n```\n", "README.md:2: a fenced block without a tag"),
        ("```sh background\nx\n```\n", 'needs ready="TEXT"'),
        ('```sh ready="x"\nx\n```\n', 'needs ready="TEXT"'),
        ("```sh loud\nx\n```\n", "unknown block attribute 'loud'"),
        ("# T\n```sh\nls\n", "README.md:2: a fenced block is never closed"),
    ],
)
def test_convention_breaks_are_named(tmp_path: Path, markdown: str, message: str) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(markdown)
    with pytest.raises(ReadmeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sections(readme, tmp_path)


def test_shorten_adds_max_steps_to_train_commands_only() -> None:
    text = (
        "harnessrl train a.toml --model m   # local\n"
        "harnessrl train b.toml --max-steps 5\n"
        "harnessrl up --trainer a.toml\n"
        "  harnessrl train c.toml\n"
    )
    assert shorten(text, 2) == (
        "harnessrl train a.toml --model m --max-steps 2   # local\n"
        "harnessrl train b.toml --max-steps 5\n"
        "harnessrl up --trainer a.toml\n"
        "  harnessrl train c.toml --max-steps 2\n"
    )


def test_the_readmes_have_runnable_sections() -> None:
    """The READMEs parse under the convention (collecting this module did) and hold commands."""
    assert {section.readme for section in SECTIONS.values()} >= {
        "README.md",
        "examples/multiply/README.md",
        "examples/mini-swe-agent/README.md",
        "examples/custom-reward/README.md",
        "examples/analytics/README.md",
    }
    # The one change the test makes to a command is a flag README.md documents.
    assert "`--max-steps N`" in (ROOT / "README.md").read_text()


# --- what a section needs that its reader already has -------------------------------------------------


@pytest.fixture(scope="session")
def demo_warm(tiny_model: Path) -> Path:
    """What `make demo` leaves in `.harnessrl/demo/warm`: its warm start, built once per machine."""
    return policies.demo_warm_start(tiny_model)


@pytest.fixture(scope="session")
def tool_calling_policy(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy warm-started to answer mini-swe-agent with bash tool calls (cached per machine)."""
    return policies.tool_calling_policy(tiny_model, tmp_path_factory.mktemp("mswea-demos")).model


def throwaway_environment(where: Path) -> Path:
    """A virtualenv that sees everything in `.venv` and installs into itself; returns its bin folder."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)], check=True)  # type: ignore[attr-defined]
    purelib = Path(sysconfig.get_paths(vars={"base": str(where), "platbase": str(where)})["purelib"])
    dev = sysconfig.get_paths()["purelib"]
    (purelib / "_harnessrl_dev.pth").write_text(f"import site; site.addsitedir({dev!r})\n")
    pip = where / "bin" / "pip"
    shim = "import sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n"
    pip.write_text(f"#!{where / 'bin' / 'python'}\n{shim}")
    pip.chmod(0o755)
    return where / "bin"


def place_demo_warm(request: pytest.FixtureRequest, workdir: Path) -> dict[str, str]:
    """`.harnessrl/demo/warm` in the copy, as after `make demo`."""
    shutil.copytree(request.getfixturevalue("demo_warm"), workdir / ".harnessrl" / "demo" / "warm")
    return {}


# --- what each section promises -----------------------------------------------------------------------


def summary(workdir: Path, spec: str) -> dict[str, Any]:
    """The summary `harnessrl train` wrote for the run of `spec` (default home `.harnessrl`)."""
    run = load_run_spec(workdir / spec).run
    path = workdir / ".harnessrl" / "runs" / run / "summary.json"
    assert path.exists(), f"no summary at {path}"
    return dict(json.loads(path.read_text()))


def stdout_json(result: BlockRun) -> Any:
    """The last stdout line of a block, as JSON."""
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_trained(done: dict[str, Any], steps: int, episodes_per_step: int) -> None:
    """Every step ran, every episode completed, and the run trained on rewards above zero."""
    assert [s["step"] for s in done["steps"]] == list(range(1, steps + 1)), done["steps"]
    episodes = done["episodes"]
    assert episodes.get("completed", 0) >= steps * episodes_per_step and not episodes.get("failed"), episodes
    last = done["steps"][-1]
    assert last["values"]["reward/mean"] > 0, last
    assert last.get("trained", True) and last["values"].get("tokens/trained", 0) > 0, last


def check_multiply(run: SectionRun) -> None:
    """The run completes its episodes and trains: reward above zero by its last step."""
    spec = load_run_spec(run.workdir / "examples/multiply/run.toml")
    done = summary(run.workdir, "examples/multiply/run.toml")
    assert_trained(done, MULTIPLY_STEPS, spec.group_size * spec.batch_tasks)
    assert (run.workdir / ".harnessrl/runs/multiply/progress.png").stat().st_size > 10_000
    # The tasks, written again as the README says, are the ones the example ships.
    assert (run.workdir / "examples/multiply/tasks.jsonl").read_bytes() == (
        ROOT / "examples/multiply/tasks.jsonl"
    ).read_bytes()


def json_lines(text: str) -> list[Any]:
    """The lines of `text` that are JSON objects."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def check_running_locally(run: SectionRun) -> None:
    """The deployment trains the submitted run; a harness started by hand is graded like any other."""
    deployment, byo = run.results[1], run.results[2]
    table = deployment.stdout.split("\n{", 1)[0]  # `harnessrl status`: every service alive
    services = ("gateway", "reward", "controller", "trainer")
    assert all(name in table for name in services) and " NO " not in table, deployment.tail()
    steps = DEPLOYMENT_STEPS
    assert {"run": "multiply", "steps": steps, "version": steps} in json_lines(deployment.stdout)
    done = summary(run.workdir, "examples/multiply/run.toml")
    assert_trained(done, steps, 64)
    assert "\nmultiply: " in deployment.stdout, deployment.tail()
    said = " ".join(deployment.stderr.split())  # rich wraps long lines
    assert "no trainer has subscribed" not in said, "`up:` came before its trainer subscribed"
    assert "closed: exited" in byo.stdout, byo.tail()
    # The run's own episodes completed before `train` returned; the hand-started one is graded after.
    graded = steps * 64 + 1
    assert wait_for(lambda: phase_count(run, "multiply", "completed") >= graded, 60), (
        f"the hand-started episode was never graded: {phase_count(run, 'multiply', 'completed')} completed"
    )


def phase_count(run: SectionRun, name: str, phase: str) -> int:
    """How many of a run's episodes are in `phase`, as `harnessrl run status --json` says."""
    asked = subprocess.run(
        ["harnessrl", "run", "status", name, "--json"],
        cwd=run.workdir, env=run.env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    return int(json.loads(asked.stdout)["runs"][name]["phases"].get(phase, 0))


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `condition` for up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
    return True


def check_analytics(run: SectionRun) -> None:
    """One line per finished episode: its calls, tokens, versions and reward, read from the stream."""
    out = run.results[1].stdout.splitlines()
    assert out[0].startswith("run multiply submitted: 400 tasks"), out[:3]
    rows = [ast.literal_eval(line.split(" ", 1)[1]) for line in out if " {'calls'" in line]
    assert len(rows) == 64, run.results[1].tail()
    assert all(r["calls"] in (1, 2) and r["prompt_tokens"] > 0 and r["completion_tokens"] > 0 for r in rows)
    assert any(r["reward"] > 0 for r in rows), rows
    assert out[-1].startswith("multiply: "), out[-3:]


def check_export(run: SectionRun) -> None:
    """The export holds the run; DuckDB reports on it; tool calls and tokens per turn are counted."""
    lines = json_lines(run.results[1].stdout)
    rows = next(line for line in lines if "out" in line)["rows"]
    assert rows["spans"] >= 64 and rows["rollouts"] >= 64 and rows["weights"] >= 1, rows
    calls = [line for line in lines if line.get("query") == "calls" and line["run"] == "multiply"]
    assert calls and calls[0]["episodes"] >= 64 and calls[0]["completion_tokens_per_call"] > 0, calls
    assert any(line.get("query") == "steps" and line["step"] == 1 for line in lines)
    assert any(line.get("query") == "sql" and line["kind"] == "completed" for line in lines)
    summary = [line for line in lines if "tool_call_error_rate" in line][-1]
    assert summary["episodes"] == 64 and summary["per_turn"][0]["completion_tokens"] > 0, summary


def check_mini_swe_agent(run: SectionRun) -> None:
    """The task set is built; every episode completes with its patch graded SWE-bench style.

    The step trains when one of its groups has reward variance; when none has, the README says
    `harnessrl train` exits 1 and why, and so must the summary.
    """
    built, followed = json_lines(run.results[0].stdout)
    assert built["instances"] >= 100, built
    done = summary(run.workdir, "examples/mini-swe-agent/run.toml")
    episodes = done["episodes"]
    assert episodes.get("completed", 0) >= 16 and not episodes.get("failed"), episodes
    assert episodes.get("scored", 0) >= episodes["completed"], episodes
    if run.results[0].returncode == 0:
        assert followed == {"run": "mini-swe-agent", "steps": 1, "version": 1}, followed
        assert done["trained_steps"] == 1, done
    else:
        assert followed == {"run": "mini-swe-agent", "steps": 1, "version": 0}, followed
        assert done["trained_steps"] == 0 and set(done["steps"][0]["dropped"]) == {"zero_variance"}, done
        assert done["why"].startswith("nothing was trained: none of the 1 steps"), done["why"]


def check_custom_reward(run: SectionRun) -> None:
    """The grader the tasks name is found and grades as the README shows."""
    shown = next(b for b in blocks((ROOT / run.section.readme).read_text()) if b.tag == "text")
    assert stdout_json(run.results[0]) == json.loads(shown.text)


def custom_reward_env(request: pytest.FixtureRequest, workdir: Path) -> dict[str, str]:
    """`pip` and `python` of a throwaway environment over `.venv`."""
    return {"PATH": str(throwaway_environment(workdir.parent / "venv"))}


MULTIPLY_STEPS = 2
DEPLOYMENT_STEPS = 1


@dataclass(frozen=True)
class Promise:
    """What a section needs before it runs, how long its runs are, and what it promises."""

    check: Callable[[SectionRun], None]
    # Output with which a block may exit 1 because its README says so (the check then looks closer).
    documented_failure: str = ""
    prepare: Callable[[pytest.FixtureRequest, Path], dict[str, str]] = lambda _request, _workdir: {}
    max_steps: int | None = None


def mini_swe_agent_env(request: pytest.FixtureRequest, workdir: Path) -> dict[str, str]:
    """`MODEL`: a policy that writes hermes-style tool calls."""
    return {"MODEL": str(request.getfixturevalue("tool_calling_policy"))}


PROMISES = {
    "examples/multiply/README.md#training-an-openai-sdk-harness": Promise(
        check=check_multiply, prepare=place_demo_warm, max_steps=MULTIPLY_STEPS
    ),
    "README.md#running-locally": Promise(
        check=check_running_locally, prepare=place_demo_warm, max_steps=DEPLOYMENT_STEPS
    ),
    "examples/analytics/README.md#tapping-the-event-stream": Promise(
        check=check_analytics, prepare=place_demo_warm
    ),
    "examples/analytics/README.md#exporting-the-streams-to-parquet-and-querying-them-with-duckdb": Promise(
        check=check_export, prepare=place_demo_warm
    ),
    "examples/mini-swe-agent/README.md#training-the-unmodified-mini-swe-agent-on-tinyswe": Promise(
        check=check_mini_swe_agent,
        prepare=mini_swe_agent_env,
        max_steps=1,
        documented_failure="error: nothing was trained: none of the 1 steps updated the policy",
    ),
    "examples/custom-reward/README.md#a-custom-reward-plug-in": Promise(
        check=check_custom_reward, prepare=custom_reward_env
    ),
}


def test_every_section_has_a_promise() -> None:
    missing = sorted(set(SECTIONS) - set(PROMISES))
    assert not missing, f"README sections with commands but no promise in PROMISES: {missing}"
    stale = sorted(set(PROMISES) - set(SECTIONS))
    assert not stale, f"PROMISES for sections no README has any more: {stale}"


# --- running them -------------------------------------------------------------------------------------


def leftovers(workdir: Path) -> list[str]:
    """Processes still running in the copy (working folder or command line inside it)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd", "status"]):
        info = proc.info
        if proc.pid == os.getpid() or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = " ".join(info["cmdline"] or [])
        if str(workdir) in cmdline or str(info["cwd"] or "").startswith(str(workdir)):
            found.append(f"{proc.pid} {cmdline[:160]}")
    return found


def wait_until_gone(workdir: Path, timeout_s: float) -> list[str]:
    """What still runs in the copy after `timeout_s` (harnesses in flight end on their own)."""
    wait_for(lambda: not leftovers(workdir), timeout_s)
    return leftovers(workdir)


def finished(run: SectionRun, promise: Promise) -> bool:
    """Every block ran and did its part, or failed the one way its README documents."""
    if run.ok:
        return True
    last = run.results[-1]
    said = " ".join((last.stdout + last.stderr).split())  # rich wraps long lines
    documented = bool(promise.documented_failure) and promise.documented_failure in said
    return len(run.results) == len(run.section.blocks) and last.returncode == 1 and documented


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("section_id", sorted(PROMISES))
def test_readme_section_runs_as_written(
    section_id: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    section: Section = SECTIONS[section_id]
    promise = PROMISES[section_id]
    workdir = tmp_path / "repo"
    run = SectionRun(
        section, ROOT, workdir, max_steps=promise.max_steps,
        prepare=lambda copy: promise.prepare(request, copy),
    )  # fmt: skip
    with run:
        assert finished(run, promise), run.failure()
        promise.check(run)
    for result in run.results:
        log.info(
            "%s line %d: exit %s after %.1f s",
            section_id,
            result.block.line,
            result.returncode,
            result.seconds,
        )
        assert "Traceback" not in result.stdout + result.stderr, result.tail()
        if result.block.background:
            assert result.returncode == 0, f"Ctrl-C did not stop it cleanly:\n{result.tail()}"
    assert wait_until_gone(workdir, 60) == []

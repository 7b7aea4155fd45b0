"""Run spec parsing: the sampling policy, and what relative paths in a launcher's command mean."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

from harnessrl.shared.contracts import LauncherSpec
from harnessrl.shared.runspec import (
    RunSpecError,
    check_local_launcher,
    command_roles,
    load_run_spec,
    parse_run_spec,
)

BASE = 'run = "r"\ntasks = "t.jsonl"\n'
LAUNCHER = '[launcher]\ncommand = ["true"]\n'


def test_sampling_is_read_from_the_spec() -> None:
    spec = parse_run_spec(
        tomllib.loads(BASE + "sampling = { temperature = 1.0, top_p = 0.9, seed = 3 }\n" + LAUNCHER)
    )
    assert spec.sampling == {"temperature": 1.0, "top_p": 0.9, "seed": 3}
    assert parse_run_spec(tomllib.loads(BASE + LAUNCHER)).sampling == {}


def test_a_sampling_value_that_is_not_a_scalar_names_the_field() -> None:
    with pytest.raises(RunSpecError, match="sampling"):
        parse_run_spec(tomllib.loads(BASE + "sampling = { temperature = { low = 1 } }\n" + LAUNCHER))


# --- paths: what a relative path in a local launcher's command means --------------------------


@pytest.mark.parametrize(
    ("command", "roles"),
    [
        (["python", "h.py", "-v", "data"], ["program", "script", "option", "operand"]),
        (["python3.11", "-u", "-W", "error", "h.py"], ["program", "option", "option", "value", "script"]),
        (["python", "-Xdev", "h.py"], ["program", "option", "script"]),
        (["python", "-m", "pkg", "x"], ["program", "option", "inline", "operand"]),
        (["sh", "-c", "echo hi", "x"], ["program", "option", "inline", "operand"]),
        (["bash", "-eo", "pipefail", "run.sh"], ["program", "option", "value", "script"]),
        (["node", "--eval", "1"], ["program", "option", "inline"]),
        ([".venv/bin/python", "--", "-odd.py"], ["program", "option", "script"]),
        (["mini", "-c", "mini.yaml", "-y"], ["program", "option", "operand", "option"]),
    ],
)
def test_command_roles(command: list[str], roles: list[str]) -> None:
    assert command_roles(command) == roles


def spec_dir(tmp_path: Path, command: list[str], kind: str = "local") -> Path:
    folder = tmp_path / "specs" / "mine"
    folder.mkdir(parents=True)
    (folder / "tasks.jsonl").write_text('{"task_id": "a", "prompt": "p"}\n')
    launcher = f'kind = "{kind}"\nimage = "h:1"\ncommand = {json.dumps(command)}\n'
    (folder / "run.toml").write_text(BASE.replace("t.jsonl", "tasks.jsonl") + "[launcher]\n" + launcher)
    return folder


def test_relative_paths_resolve_against_the_spec_folder_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "specs" / "harness.py"
    folder = spec_dir(tmp_path, ["python", "-u", "../harness.py", "conf.yaml", "-m", "openai/policy", "."])
    shared.write_text("print(1)\n")
    (folder / "conf.yaml").write_text("x: 1\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = load_run_spec(Path("..") / "specs" / "mine" / "run.toml")
    assert spec.launcher.command == [
        "python",
        "-u",
        str(shared),
        str(folder / "conf.yaml"),
        "-m",
        "openai/policy",
        ".",
    ]


def test_a_program_path_resolves_and_keeps_symlinks(tmp_path: Path) -> None:
    folder = spec_dir(tmp_path, [".venv/bin/python", "-m", "harness"])
    (folder / ".venv" / "bin").mkdir(parents=True)
    (folder / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (folder / "harness").mkdir()  # a module folder: `-m`'s value stays a module name
    spec = load_run_spec(folder / "run.toml")
    assert spec.launcher.command == [str(folder / ".venv" / "bin" / "python"), "-m", "harness"]


def test_a_missing_script_is_refused_at_load_naming_field_and_path(tmp_path: Path) -> None:
    folder = spec_dir(tmp_path, ["python", "../../x.py"])
    with pytest.raises(RunSpecError) as caught:
        load_run_spec(folder / "run.toml")
    expected = f"`launcher.command[1]`: script ../../x.py (resolved to {tmp_path / 'x.py'}) does not exist"
    assert expected in str(caught.value)


def test_a_program_path_that_is_not_executable_is_refused(tmp_path: Path) -> None:
    folder = spec_dir(tmp_path, ["./agent"])
    (folder / "agent").write_text("#!/bin/sh\n")
    with pytest.raises(RunSpecError, match=r"`launcher.command\[0\]`: program ./agent .* not an executable"):
        load_run_spec(folder / "run.toml")


def test_kubernetes_commands_run_in_the_image_and_stay_as_written(tmp_path: Path) -> None:
    folder = spec_dir(tmp_path, ["python", "missing.py"], kind="kubernetes")
    assert load_run_spec(folder / "run.toml").launcher.command == ["python", "missing.py"]


def test_the_controllers_check_finds_programs_and_scripts_on_its_machine(tmp_path: Path) -> None:
    script = tmp_path / "h.py"
    script.write_text("")
    check_local_launcher(LauncherSpec(command=["sh", "-c", "true"]), source="run r")
    check_local_launcher(LauncherSpec(command=[sys.executable, str(script)]), source="run r")
    refused = {
        "program nosuch-harness-bin is not on the controller's PATH": ["nosuch-harness-bin"],
        f"script {tmp_path / 'gone.py'} does not exist": ["python3", str(tmp_path / "gone.py")],
        "script h.py is a relative path": ["python3", "h.py"],
        "program bin/agent is a relative path": ["bin/agent"],
    }
    for message, command in refused.items():
        with pytest.raises(RunSpecError, match=r"run r: `launcher\.command\[") as caught:
            check_local_launcher(LauncherSpec(command=command), source="run r")
        assert message in str(caught.value)
    # The harness's PATH is the launcher's own when its `env` sets one.
    with pytest.raises(RunSpecError, match="not on the controller's PATH"):
        check_local_launcher(LauncherSpec(command=["sh"], env={"PATH": str(tmp_path)}), source="run r")

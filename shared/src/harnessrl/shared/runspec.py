"""Run specs: read a TOML or YAML file into a validated `RunSpec`, with errors that name the field.

Relative paths mean the spec's folder, never the episode's working folder: `load_run_spec` makes
`tasks` (a file, or a dataset folder) and a local launcher's program, script and file arguments
absolute (see `resolve_command`), and `check_local_launcher` is what the controller asks at submit,
on the machine that launches.
"""

from __future__ import annotations

import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from harnessrl.shared.contracts import LauncherSpec, RunSpec
from harnessrl.shared.datasetspec import DatasetSpec

# A run name becomes a subject token, a KV key part and a Kubernetes label value.
_RUN_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")

# What each argument of a harness command is. An interpreter's first operand is its `script`;
# `inline` is code or a module name it runs instead (`sh -c CODE`, `python -m MOD`); an option's
# `value` and every `option` are left as written; `operand`s become absolute when they name a file.
Role = Literal["program", "option", "value", "inline", "script", "operand"]
Family = Literal["python", "shell", "node"]
# Short option letters that end an interpreter's options with inline code or a module ...
_INLINE_LETTERS: dict[Family, str] = {"python": "cm", "shell": "c", "node": "ep"}
# ... and those that take a value (attached, `-Xdev`, or the next argument, `-W error`).
_VALUE_LETTERS: dict[Family, str] = {"python": "WX", "shell": "oO", "node": "r"}
_LONG_OPTIONS: dict[Family, dict[str, Role]] = {
    "node": {"--eval": "inline", "--print": "inline", "--require": "value", "--import": "value"},
}


class RunSpecError(ValueError):
    """The run spec cannot be used; the message says which file and which field."""


def load_run_spec(path: Path | str) -> RunSpec:
    """Parse and validate a run spec file; its relative paths are resolved against the file's folder."""
    file = Path(path)
    data = _read(file)
    spec = parse_run_spec(data, source=str(file))
    tasks = Path(spec.tasks)
    if not tasks.is_absolute():
        tasks = (file.parent / tasks).resolve()
    if not tasks.exists():
        raise RunSpecError(f"{file}: tasks file or folder {tasks} does not exist")
    launcher = spec.launcher
    if launcher.kind == "local":
        command = resolve_command(launcher.command, file.parent, source=str(file))
        launcher = msgspec.structs.replace(launcher, command=command)
    return msgspec.structs.replace(spec, tasks=str(tasks), launcher=launcher)


def interpreter(program: str) -> Family | None:
    """Which interpreter a program is (`python3.11` and `.venv/bin/python` are python), else None."""
    name = Path(program).name
    if name.startswith("python"):
        return "python"
    if name in ("bash", "sh"):
        return "shell"
    return "node" if name == "node" else None


def command_roles(command: list[str]) -> list[Role]:
    """The role of each argument of a harness command (see `Role`)."""
    if not command:
        return []
    family = interpreter(command[0])
    head = _interpreter_roles(family, command[1:]) if family else []
    rest = command[1 + len(head) :]
    return ["program", *head, *("option" if arg.startswith("-") else "operand" for arg in rest)]


def _interpreter_roles(family: Family, args: list[str]) -> list[Role]:
    """Roles of an interpreter's own arguments, up to its script or inline code (then the script's)."""
    roles: list[Role] = []
    while len(roles) < len(args):
        arg = args[len(roles)]
        if arg == "--":
            return [*roles, "option", "script"][: len(args)]
        if arg == "-":
            return [*roles, "inline"]
        if not (arg.startswith("-") or (family == "shell" and arg.startswith("+"))):
            return [*roles, "script"]
        role, attached = _option_takes(family, arg)
        roles.append("option")
        if role is not None and not attached and len(roles) < len(args):
            roles.append(role)
        if role == "inline":
            return roles
    return roles


def _option_takes(family: Family, arg: str) -> tuple[Role | None, bool]:
    """What an interpreter option consumes (a value, inline code) and whether it is attached to it."""
    if arg.startswith("--"):
        name, equals, _ = arg.partition("=")
        return _LONG_OPTIONS.get(family, {}).get(name), bool(equals)
    for end, letter in enumerate(arg[1:], start=2):
        if letter in _INLINE_LETTERS[family]:
            return "inline", end < len(arg)
        if letter in _VALUE_LETTERS[family]:
            return "value", end < len(arg)
    return None, False


def resolve_command(command: list[str], folder: Path, *, source: str) -> list[str]:
    """A local harness command with its relative paths made absolute against the spec's `folder`.

    A program given as a path (it has a `/`) and an interpreter's script must exist, or
    `RunSpecError` names the argument, the path and why; an operand that names an existing file
    or folder becomes absolute; bare program names (looked up on PATH at submit), options, option
    values and inline code stay as written.
    """
    base = Path(os.path.abspath(folder))
    roles = command_roles(command)
    return [
        _resolve(arg, role, f"{source}: `launcher.command[{i}]`", base)
        for i, (arg, role) in enumerate(zip(command, roles, strict=True))
    ]


def _resolve(arg: str, role: Role, where: str, base: Path) -> str:
    if role == "program" and "/" in arg:
        return _existing(arg, base, where, "program")
    if role == "script":
        return _existing(arg, base, where, "script")
    if role == "operand" and _names_a_file(arg) and (base / arg).exists():
        return os.path.normpath(base / arg)
    return arg


def _names_a_file(arg: str) -> bool:
    """A relative path that is more than `.` and `..` (those mean the episode's own folders)."""
    path = Path(arg)
    return not path.is_absolute() and any(part not in (".", "..") for part in path.parts)


def _existing(arg: str, base: Path, where: str, what: Literal["program", "script"]) -> str:
    """`arg` as an absolute path (symlinks kept: a venv's python stays the venv's), which must exist."""
    path = os.path.normpath(base / arg)
    shown = arg if arg == path else f"{arg} (resolved to {path})"
    if not os.path.exists(path):
        raise RunSpecError(f"{where}: {what} {shown} does not exist")
    if what == "program" and not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise RunSpecError(f"{where}: program {shown} is not an executable file")
    return path


def check_local_launcher(launcher: LauncherSpec, *, source: str) -> None:
    """Refuse a local harness this machine cannot start: the controller asks this at submit.

    A bare program must be on the harness's PATH (the launcher's `env` may set it), a program
    given as a path must be an absolute, executable file, an interpreter's script must exist.
    A relative path here would mean each episode's working folder, so it is refused too: the
    `harnessrl` commands resolve relative paths against the spec's folder before they submit.
    """
    search = launcher.env.get("PATH", os.environ.get("PATH", os.defpath))
    roles = command_roles(launcher.command)
    for index, (arg, role) in enumerate(zip(launcher.command, roles, strict=True)):
        if role in ("program", "script"):
            _check_here(arg, role, f"{source}: `launcher.command[{index}]`", search)


def _check_here(arg: str, role: Literal["program", "script"], where: str, search: str) -> None:
    """Refuse a program or script this machine lacks (a bare program is looked up on `search`)."""
    if role == "program" and "/" not in arg:
        if shutil.which(arg, path=search) is None:
            raise RunSpecError(f"{where}: program {arg} is not on the controller's PATH ({search})")
        return
    if not os.path.isabs(arg):
        raise RunSpecError(
            f"{where}: {role} {arg} is a relative path, which would mean each episode's working "
            "folder; give it absolute (`harnessrl run submit` resolves it against the spec's folder)"
        )
    _existing(arg, Path("/"), where, role)


def parse_run_spec(data: Any, *, source: str = "run spec") -> RunSpec:
    """Validate already-parsed run spec data (a mapping, as from TOML, YAML or JSON)."""
    if not isinstance(data, dict):
        raise RunSpecError(f"{source}: expected a table of settings, got {type(data).__name__}")
    body = data.get("run", data) if isinstance(data.get("run"), dict) else data
    _reject_unknown(body, RunSpec, source, "")
    if isinstance(body.get("launcher"), dict):
        _reject_unknown(body["launcher"], LauncherSpec, source, "launcher.")
    if isinstance(body.get("dataset"), dict):
        _reject_unknown(body["dataset"], DatasetSpec, source, "dataset.")
    _reject_wide_ints(body, source)
    try:
        spec = msgspec.convert(body, RunSpec, strict=False)
    except msgspec.ValidationError as exc:
        raise RunSpecError(f"{source}: {exc}") from exc
    except RecursionError as exc:
        raise RunSpecError(f"{source}: nested too deeply") from exc
    _check(spec, source)
    return spec


def _reject_wide_ints(body: dict[str, Any], source: str) -> None:
    """Refuse an integer that no bus message can carry (msgpack holds 64 bits), naming its field."""
    pending: list[tuple[str, Any]] = [(str(name), value) for name, value in body.items()]
    while pending:
        where, value = pending.pop()
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise RunSpecError(f"{source}: `{where}` is out of range (a 64-bit integer at most)")
        if isinstance(value, dict):
            pending += [(f"{where}.{name}", item) for name, item in value.items()]
        elif isinstance(value, list):
            pending += [(f"{where}[{index}]", item) for index, item in enumerate(value)]


def _read(file: Path) -> Any:
    try:
        text = file.read_text()
    except OSError as exc:
        raise RunSpecError(f"cannot read run spec {file}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise RunSpecError(f"cannot read run spec {file}: not UTF-8 text ({exc.reason})") from exc
    try:
        if file.suffix == ".toml":
            return tomllib.loads(text)
        if file.suffix in (".yaml", ".yml", ".json"):
            return yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise RunSpecError(f"{file}: not valid {file.suffix[1:].upper()}: {exc}") from exc
    except RecursionError as exc:
        raise RunSpecError(f"{file}: nested too deeply") from exc
    raise RunSpecError(f"{file}: run specs are .toml, .yaml, .yml or .json files")


def _reject_unknown(body: dict[str, Any], kind: type[msgspec.Struct], source: str, where: str) -> None:
    known = {f.name for f in msgspec.structs.fields(kind)}
    unknown = sorted(map(str, set(body) - known))  # YAML keys need not be strings
    if unknown:
        names = ", ".join(f"`{where}{name}`" for name in unknown)
        raise RunSpecError(f"{source}: unknown field(s) {names}; known: {', '.join(sorted(known))}")


def _check(spec: RunSpec, source: str) -> None:
    if not _RUN_NAME.match(spec.run):
        raise RunSpecError(
            f"{source}: `run` must be 1-40 lower-case letters, digits or '-' "
            f"(it becomes a subject token and a label), got {spec.run!r}"
        )
    if spec.infra_retries < 0 or spec.max_steps < 1:
        raise RunSpecError(f"{source}: `infra_retries` must be >= 0 and `max_steps` >= 1")
    launcher = spec.launcher
    if not launcher.command:
        raise RunSpecError(f"{source}: `launcher.command` is empty: give the harness command")
    if launcher.kind == "kubernetes" and not launcher.image:
        raise RunSpecError(f"{source}: `launcher.image` is required for the kubernetes launcher")

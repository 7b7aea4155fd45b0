"""Run specs: read a TOML or YAML file into a validated `RunSpec`, with errors that name the field."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import yaml

from harnessrl.shared.contracts import LauncherSpec, RunSpec

# A run name becomes a subject token, a KV key part and a Kubernetes label value.
_RUN_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")


class RunSpecError(ValueError):
    """The run spec cannot be used; the message says which file and which field."""


def load_run_spec(path: Path | str) -> RunSpec:
    """Parse and validate a run spec file; `tasks` is resolved relative to the file's folder."""
    file = Path(path)
    data = _read(file)
    spec = parse_run_spec(data, source=str(file))
    tasks = Path(spec.tasks)
    if not tasks.is_absolute():
        tasks = (file.parent / tasks).resolve()
    if not tasks.is_file():
        raise RunSpecError(f"{file}: tasks file {tasks} does not exist")
    return msgspec.structs.replace(spec, tasks=str(tasks))


def parse_run_spec(data: Any, *, source: str = "run spec") -> RunSpec:
    """Validate already-parsed run spec data (a mapping, as from TOML, YAML or JSON)."""
    if not isinstance(data, dict):
        raise RunSpecError(f"{source}: expected a table of settings, got {type(data).__name__}")
    body = data.get("run", data) if isinstance(data.get("run"), dict) else data
    _reject_unknown(body, RunSpec, source, "")
    if isinstance(body.get("launcher"), dict):
        _reject_unknown(body["launcher"], LauncherSpec, source, "launcher.")
    try:
        spec = msgspec.convert(body, RunSpec, strict=False)
    except msgspec.ValidationError as exc:
        raise RunSpecError(f"{source}: {exc}") from exc
    _check(spec, source)
    return spec


def _read(file: Path) -> Any:
    try:
        text = file.read_text()
    except OSError as exc:
        raise RunSpecError(f"cannot read run spec {file}: {exc.strerror or exc}") from exc
    try:
        if file.suffix == ".toml":
            return tomllib.loads(text)
        if file.suffix in (".yaml", ".yml", ".json"):
            return yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise RunSpecError(f"{file}: not valid {file.suffix[1:].upper()}: {exc}") from exc
    raise RunSpecError(f"{file}: run specs are .toml, .yaml, .yml or .json files")


def _reject_unknown(body: dict[str, Any], kind: type[msgspec.Struct], source: str, where: str) -> None:
    known = {f.name for f in msgspec.structs.fields(kind)}
    unknown = sorted(set(body) - known)
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

"""Typed settings read from a TOML file and the environment, validated at start-up.

Each service defines one msgspec Struct of settings with documented defaults. Values come from, in
increasing precedence: the Struct defaults, a TOML file (its `[<section>]` table), environment
variables `<PREFIX><FIELD>` (upper case). Environment values are parsed as JSON when they look like
JSON (lists, objects, numbers, booleans), else taken as strings; msgspec then converts and validates.
A bad value fails fast with `SettingsError` naming the field and where it came from.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the field and its source."""


def _env_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _from_env(kind: type[msgspec.Struct], prefix: str, env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(kind):
        name = f"{prefix}{field.name.upper()}"
        if name in env:
            raw = env[name]
            values[field.name] = raw if field.type is str else _env_value(raw)
    return values


def _from_toml(path: Path | None, section: str) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read settings file {path}: {exc}") from exc
    table = data.get(section, data if not section else {})
    if not isinstance(table, dict):
        raise SettingsError(f"[{section}] in {path} is not a table")
    return table


def load_settings(
    kind: type[S],
    *,
    prefix: str,
    section: str = "",
    toml_path: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> S:
    """Build `kind` from defaults, TOML, environment and explicit overrides (highest last)."""
    path = Path(toml_path) if toml_path else None
    values = _from_toml(path, section)
    values.update(_from_env(kind, prefix, os.environ if env is None else env))
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in msgspec.structs.fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SettingsError(f"unknown setting(s) for {kind.__name__}: {', '.join(unknown)}")
    try:
        return msgspec.convert(values, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"invalid {kind.__name__} ({prefix}*): {exc}") from exc

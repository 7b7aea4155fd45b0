"""Fixtures of the reward service tests: the built tinyswe set and a grading context."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.settings import SandboxLimits
from harnessrl.reward.swe.sandbox import available_limits
from harnessrl.reward.tinyswe.build import ensure_tinyswe, load_instances


@pytest.fixture(scope="session")
def tinyswe_root() -> Path:
    """The tinyswe set, built once per machine (cached by generator hash)."""
    return ensure_tinyswe(sys.executable)


@pytest.fixture(scope="session")
def tinyswe_rows(tinyswe_root: Path) -> list[dict[str, Any]]:
    return load_instances(tinyswe_root)


@pytest.fixture(scope="session")
def context(tinyswe_root: Path) -> GradingContext:
    # The sandbox refuses to run weaker than asked: ask for what this machine gives (without root,
    # or with this interpreter where nobody cannot reach it, no privilege drop).
    limits = available_limits(SandboxLimits(), sys.executable)
    return GradingContext(tasks_root=str(tinyswe_root), python=sys.executable, limits=limits)


@pytest.fixture(scope="session")
def calc_row(tinyswe_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The hand-written calc bug (power right-associativity), used by the reward-hack tests."""
    return next(r for r in tinyswe_rows if r["instance_id"] == "tinyswe__calc-0001")

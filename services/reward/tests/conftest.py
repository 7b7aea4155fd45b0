"""Fixtures of the reward service tests: the built tinyswe set and a grading context."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from harnessrl.reward.graders.base import GradingContext
from harnessrl.reward.settings import SandboxLimits
from harnessrl.reward.swe.sandbox import available_limits, privilege_drop_available
from harnessrl.reward.tinyswe.build import ensure_tinyswe, load_instances


@pytest.fixture(scope="session")
def tinyswe_root() -> Path:
    """The tinyswe set, built once per machine (cached by generator hash)."""
    return ensure_tinyswe(sys.executable)


@pytest.fixture(scope="session")
def tinyswe_rows(tinyswe_root: Path) -> list[dict[str, Any]]:
    return load_instances(tinyswe_root)


# Debian's python3 with pytest (scripts/tools.sh installs it): runnable by any uid, unlike the dev
# environment under the private home, so gradings drop privileges as in a deployment.
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="session")
def context(tinyswe_root: Path) -> GradingContext:
    # The sandbox refuses to run weaker than asked: ask for what this machine gives (without root,
    # or with an interpreter the grading uids cannot reach, no privilege drop).
    python = SYSTEM_PYTHON if privilege_drop_available(SYSTEM_PYTHON) else sys.executable
    limits = available_limits(SandboxLimits(), python)
    return GradingContext(tasks_root=str(tinyswe_root), python=python, limits=limits)


@pytest.fixture(scope="session")
def calc_row(tinyswe_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The hand-written calc bug (power right-associativity), used by the reward-hack tests."""
    return next(r for r in tinyswe_rows if r["instance_id"] == "tinyswe__calc-0001")

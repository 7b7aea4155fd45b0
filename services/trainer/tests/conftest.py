"""Shared fixtures: one verl engine per session (building one costs seconds)."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.settings import EngineSettings, LossSettings


@pytest.fixture(scope="session")
def policy_engine(tiny_model: Path) -> Iterator[PolicyEngine]:
    """verl's FSDP2 engine on the tiny model, on the CPU through our platform plugin.

    Tests share it: each measures changes relative to the weights it finds.
    """
    yield PolicyEngine(tiny_model, EngineSettings(lr=3e-4), LossSettings())

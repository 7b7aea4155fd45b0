"""Fixtures of the controller tests: an in-process fake Kubernetes API."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from harnessrl.testkit.exits import ExitRecorder
from harnessrl.testkit.fake_kube import FakeKubeServer


@pytest.fixture
async def fake_kube() -> AsyncIterator[FakeKubeServer]:
    server = FakeKubeServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def exits() -> type[ExitRecorder]:
    return ExitRecorder

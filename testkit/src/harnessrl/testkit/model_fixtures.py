"""Pytest fixtures for the tiny model and a real vLLM CPU server on it (one per test session).

Re-exported by `harnessrl.testkit.plugin`; usable alone with
`pytest -p harnessrl.testkit.model_fixtures`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.stack.vllm import VllmServer


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Return the default tiny Qwen3 chat model's directory (built once per machine)."""
    # Imported here: torch and transformers take seconds to import, and this plugin loads in every
    # test session, most of which never ask for the model.
    from harnessrl.stack.demo.tiny_model import cached_tiny_model

    return cached_tiny_model()


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """Serve `tiny_model` from a real vLLM CPU server for the whole session.

    Attributes: `.url` (base URL, no `/v1`), `.model` (served model name), `.model_dir`,
    `.log_file`. Tests that change its weights must restore them (see the trainer's tests).
    """
    server = VllmServer(tiny_model, log_file=tmp_path_factory.mktemp("vllm") / "vllm.log")
    server.start()
    yield server
    server.stop()

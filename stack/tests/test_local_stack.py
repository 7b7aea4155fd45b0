"""The local stack's service settings: what each process is started with."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.shared.contracts import RunSpec
from harnessrl.shared.settings import SettingsError, load_settings
from harnessrl.stack.local import LocalStack
from harnessrl.stack.supervisor import ProcessSpec
from harnessrl.trainer.settings import ENV_PREFIX, EngineSettings, TrainerSettings


class _Recorder:
    """Stands in for the supervisor: keeps what it was asked to start."""

    def __init__(self) -> None:
        self.started: list[ProcessSpec] = []

    def start(self, spec: ProcessSpec) -> None:
        self.started.append(spec)


@pytest.mark.parametrize("lr", [None, 1e-3])
def test_the_trainer_reads_the_sessions_learning_rate(tmp_path: Path, lr: float | None) -> None:
    """What the trainer process reads from its environment carries the run's learning rate."""
    stack = LocalStack(tmp_path, nats_url="nats://127.0.0.1:4222")
    recorder = _Recorder()
    stack.supervisor = recorder  # type: ignore[assignment]
    stack.start_trainer(RunSpec(run="lr", tasks=str(tmp_path / "t.jsonl")), tmp_path / "model", lr=lr)
    (spec,) = recorder.started
    read = load_settings(TrainerSettings, prefix=ENV_PREFIX, section="trainer", env=spec.env)
    assert read.engine.lr == (EngineSettings().lr if lr is None else lr)
    assert read.engine.torch_threads == 1


def test_a_learning_rate_the_engine_cannot_use_is_refused(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path, nats_url="nats://127.0.0.1:4222")
    stack.supervisor = _Recorder()  # type: ignore[assignment]
    with pytest.raises(SettingsError, match=r"engine\.lr"):
        stack.start_trainer(RunSpec(run="lr", tasks=str(tmp_path / "t.jsonl")), tmp_path / "model", lr=-1.0)

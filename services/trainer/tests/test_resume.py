"""kill -9 mid-run and restart: resume from the checkpoint, no version twice, no rollout twice."""

import asyncio
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import StepMetrics, WeightVersion
from harnessrl.shared.ids import new_id
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.span_sequences import publish_episodes as publish_group
from harnessrl.testkit.span_sequences import record_group


async def versions_of(bus: Bus, run: str) -> list[int]:
    stored = await bus.replay(subjects.WEIGHTS.name, subjects.weights(run))
    return [item.decode(WeightVersion).version for item in stored]


def start_trainer(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "harnessrl.trainer"], env={**os.environ, **env},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


async def wait_versions(bus: Bus, run: str, count: int, proc, log: Path, timeout=180.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while len(await versions_of(bus, run)) < count:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert asyncio.get_running_loop().time() < deadline, log.read_text()[-3000:]
        await asyncio.sleep(0.1)


async def test_kill_9_and_resume(bus: Bus, nats_server: NatsServer, tiny_model: Path, tmp_path: Path):
    run = new_id("run")
    rng = random.Random(9)
    groups = [record_group(run, f"g{i}", rng, size=4) for i in range(4)]
    for group in groups:
        await publish_group(bus, group)
    env = {
        "HRL_TRAINER_RUN": run,
        "HRL_TRAINER_MODEL_DIR": str(tiny_model),
        "HRL_TRAINER_CHECKPOINT_DIR": str(tmp_path),
        "HRL_TRAINER_NATS_URL": nats_server.url,
        "HRL_TRAINER_MODE": "async",
        "HRL_TRAINER_STALENESS": "10",
        "HRL_TRAINER_BATCH_GROUPS": "1",
        "HRL_TRAINER_ACK_RECHECK_S": "0.2",
        "HRL_TRAINER_ACK_WAIT_S": "3",
    }
    log = tmp_path / "trainer.log"
    first = start_trainer(env, log)
    try:
        await wait_versions(bus, run, 1, first, log)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()

    second = start_trainer(env, log)
    try:
        await wait_versions(bus, run, 4, second, log)
        await asyncio.sleep(1.0)  # anything trained twice would publish a fifth version now
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, log.read_text()[-3000:]

    assert await versions_of(bus, run) == [1, 2, 3, 4]
    latest = (tmp_path / run / "latest").read_text()
    state = msgspec.json.decode((tmp_path / run / latest / "trainer_state.json").read_bytes())
    assert state["step"] == 4 and state["version"] == 4 and state["published"]
    trained = [rollout for ids in state["trained"].values() for rollout in ids]
    assert len(trained) == len(set(trained)) == 16
    assert set(trained) == {rollout.episode for group in groups for _, rollout in group}
    assert "trainer.resumed" in log.read_text()
    # Every step is announced, even one whose metrics the kill cut off (recovered on restart).
    metrics = await bus.replay(subjects.METRICS.name, subjects.metrics(run, "trainer"))
    assert sorted({item.decode(StepMetrics).step for item in metrics}) == [1, 2, 3, 4]

"""The worker process: `python -m harnessrl.reward` starts, stops cleanly on SIGTERM, rejects bad settings."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harnessrl.stack.natsserver import NatsServer

WORKER = [sys.executable, "-m", "harnessrl.reward"]


def worker_env(**values: str) -> dict[str, str]:
    return {**os.environ, **{f"HRL_REWARD_{name.upper()}": value for name, value in values.items()}}


def test_invalid_settings_exit_2_with_a_one_line_message(tmp_path: Path) -> None:
    done = subprocess.run(
        WORKER, env=worker_env(concurrency="0"), capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "harnessrl reward: invalid RewardSettings (HRL_REWARD_*): concurrency must be >= 1 (got 0)"
    ]


def test_worker_consumes_until_sigterm_then_exits_0(nats_server: NatsServer, tmp_path: Path) -> None:
    config = tmp_path / "reward.toml"
    config.write_text(f'[reward]\ndurable = "app-test"\nnats_url = "{nats_server.url}"\n')
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen([*WORKER, "--config", str(config)], stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "reward.started" not in log.read_text() and time.monotonic() < deadline:
                assert worker.poll() is None, log.read_text()
                time.sleep(0.1)
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=30) == 0, log.read_text()
        finally:
            worker.kill()
    assert '"durable": "app-test"' in log.read_text()
    assert "reward.stopped" in log.read_text()

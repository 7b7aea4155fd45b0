"""Running a reward worker as a process: settings, logging, bus, service, until signalled.

`python -m harnessrl.reward` and `harnessrl reward` both end here. Settings come from the
defaults, `--config` (its `[reward]` table) and `HRL_REWARD_*`; the local stack passes the
environment only.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from harnessrl.reward.service import RewardService
from harnessrl.reward.settings import RewardSettings, read_settings
from harnessrl.shared.bus import BusError, NatsBus
from harnessrl.shared.log import configure_logging, get_logger
from harnessrl.shared.settings import SettingsError
from harnessrl.shared.signals import run_until_signalled

_log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's process options."""
    parser.add_argument("--config", type=Path, default=None, help="TOML file with a [reward] table")


async def serve(settings: RewardSettings) -> None:
    """Connect, ensure the streams, grade until SIGTERM/SIGINT, then close the bus."""
    bus = NatsBus(settings.nats_url, name="harnessrl-reward")
    await bus.connect()
    try:
        await bus.ensure_streams()
        await run_until_signalled(RewardService(bus, settings))
        _log.info("reward.stopped")
    finally:
        await bus.close()


def run(args: argparse.Namespace) -> int:
    """Run a worker for parsed `args`: 0 after a clean stop, 1 when the bus fails, 2 on invalid settings."""
    try:
        settings = read_settings(args.config)
    except SettingsError as exc:
        sys.stderr.write(f"harnessrl reward: {exc}\n")
        return 2
    configure_logging(settings.log_format, force=True)
    try:
        asyncio.run(serve(settings))
    except BusError as exc:
        _log.error("bus.failed", error=str(exc))
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m harnessrl.reward [--config FILE]`."""
    parser = argparse.ArgumentParser(prog="python -m harnessrl.reward", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))

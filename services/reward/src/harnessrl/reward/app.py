"""Running a reward worker as a process: settings, logging, bus, service, until signalled.

`python -m harnessrl.reward` and `harnessrl reward` both end here. Settings come from the
defaults, `--config` (its `[reward]` table) and `HRL_REWARD_*`; the local stack passes the
environment only.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path

from harnessrl.reward.service import RewardService
from harnessrl.reward.settings import RewardSettings, read_settings
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.log import get_logger
from harnessrl.shared.metrics_export import exported
from harnessrl.shared.process import run_until_signalled, service_main

_log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's process options."""
    parser.add_argument("--config", type=Path, default=None, help="TOML file with a [reward] table")


async def serve(settings: RewardSettings, stop: asyncio.Event | None = None) -> None:
    """Connect, ensure the streams, grade until `stop` (or SIGTERM/SIGINT), then close the bus.

    Metrics are served and summarised meanwhile (`metrics_port`, `metrics_interval_s`).
    """
    bus = NatsBus(settings.nats_url, name="harnessrl-reward")
    await bus.connect()
    try:
        await bus.ensure_streams()
        service = RewardService(bus, settings)
        async with exported(bus, service.metrics.registry, service="reward", settings=settings):
            await run_until_signalled(service, stop=stop)
        _log.info("reward.stopped")
    finally:
        await bus.close()


def run(args: argparse.Namespace) -> int:
    """Run a worker for parsed `args` (exit codes: `service_main`)."""
    return service_main("reward", lambda: read_settings(args.config), lambda s: asyncio.run(serve(s)))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m harnessrl.reward [--config FILE]`."""
    parser = argparse.ArgumentParser(prog="python -m harnessrl.reward", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))

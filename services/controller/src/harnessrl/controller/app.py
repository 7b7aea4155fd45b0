"""Running the controller as a process: settings -> logging -> bus -> lease -> service, until signalled.

The heavy parts (the bus client, the Kubernetes client behind the service) are imported when the
service starts, so `harnessrl --help`, which builds this parser, stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path

from harnessrl.controller.settings import ControllerSettings, read_settings
from harnessrl.shared.log import get_logger
from harnessrl.shared.process import run_until_signalled, service_main

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The process options; everything else comes from settings (`HRL_CONTROLLER_*`, TOML)."""
    parser.add_argument("--config", type=Path, default=None, help="TOML file with a [controller] table")


def run(args: argparse.Namespace) -> int:
    """Run the controller for parsed `args` (exit codes: `service_main`)."""
    return service_main("controller", lambda: read_settings(args.config), lambda s: asyncio.run(serve(s)))


async def serve(settings: ControllerSettings, stop: asyncio.Event | None = None) -> None:
    """Connect, wait for the lease, then run the controller until `stop` (or SIGTERM/SIGINT).

    As a standby it waits without acting; losing the lease ends the process (`standby.py`).
    Standby or active, it serves and summarises its metrics (`metrics_port`, `metrics_interval_s`).
    """
    from harnessrl.controller.metrics import ControllerMetrics
    from harnessrl.controller.standby import ActiveStandby
    from harnessrl.shared.bus import NatsBus
    from harnessrl.shared.metrics_export import exported

    bus = NatsBus(settings.nats_url, name="harnessrl-controller")
    await bus.connect()
    try:
        service = ActiveStandby(bus, settings)
        registry = ControllerMetrics(service).registry
        async with exported(bus, registry, service="controller", settings=settings):
            await run_until_signalled(service, finished=service.wait(), stop=stop)
    finally:
        await bus.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m harnessrl.controller [--config FILE]`."""
    parser = argparse.ArgumentParser(
        prog="python -m harnessrl.controller", description="the controller service"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))

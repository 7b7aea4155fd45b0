"""Running the controller as a process: settings, logging, bus, signals."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from harnessrl.controller.service import Controller
from harnessrl.controller.settings import ControllerSettings, load_controller_settings
from harnessrl.shared.bus import BusError, NatsBus
from harnessrl.shared.log import configure_logging, get_logger
from harnessrl.shared.settings import SettingsError


async def serve(settings: ControllerSettings, stop: asyncio.Event | None = None) -> None:
    """Connect, resume runs, answer requests until `stop` is set (or SIGTERM/SIGINT)."""
    bus = NatsBus(settings.nats_url, name="harnessrl-controller")
    await bus.connect()
    controller = Controller(bus, settings)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await controller.start()
        await stop.wait()
    finally:
        await controller.stop()
        await bus.close()


def run(config: Path | None = None, **overrides: object) -> int:
    """Process entry point: exit code 0 on a clean stop, 2 on a configuration or connection error."""
    try:
        settings = load_controller_settings(config, **overrides)
    except SettingsError as exc:
        configure_logging("console")
        get_logger("controller").error("invalid controller settings", error=str(exc))
        return 2
    configure_logging("json" if settings.log_format == "json" else "console", settings.log_level)
    log = get_logger("controller")
    if not settings.key_secret:
        log.error("HRL_CONTROLLER_KEY_SECRET is required: episode keys are signed with it")
        return 2
    try:
        asyncio.run(serve(settings))
    except BusError as exc:
        log.error("controller stopped", error=str(exc))
        return 2
    return 0

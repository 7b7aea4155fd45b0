"""`python -m harnessrl.reward`: run a reward worker until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from harnessrl.reward.service import RewardService
from harnessrl.reward.settings import load_reward_settings
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.log import configure_logging, get_logger


async def serve() -> None:
    """Connect, ensure streams, consume until a stop signal."""
    settings = load_reward_settings()
    configure_logging(settings.log_format)
    bus = NatsBus(settings.nats_url)
    await bus.connect()
    await bus.ensure_streams()
    service = RewardService(bus, settings)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    get_logger("harnessrl.reward").info("reward.stopping")
    await service.stop()
    await bus.close()


def main() -> int:
    """Process entry point."""
    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())

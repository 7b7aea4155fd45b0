"""Wiring: settings to a running trainer service (bus, engine, replicas, metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from harnessrl.shared.bus import NatsBus
from harnessrl.shared.log import configure_logging, get_logger
from harnessrl.trainer.metrics import MetricsSink
from harnessrl.trainer.nccl_sync import NcclReplicaSync
from harnessrl.trainer.replica import VllmReplica
from harnessrl.trainer.service import TrainerService
from harnessrl.trainer.settings import TrainerSettings
from harnessrl.trainer.training import Trainer
from harnessrl.trainer.weight_sync import ReplicaSync, WeightSyncer

log = get_logger("harnessrl.trainer.app")


def build_sync(settings: TrainerSettings, trainer: Trainer) -> WeightSyncer:
    """The configured weight-sync back-end over every configured vLLM server."""
    replicas = [VllmReplica(url, settings.served_model) for url in settings.replicas]
    if settings.weight_transfer == "nccl":
        return NcclReplicaSync(
            trainer.engine,
            replicas,
            settings.probe_token_ids,
            master_address=settings.nccl_master_address,
            master_port=settings.nccl_master_port,
            tolerance=settings.probe_tolerance,
        )
    return ReplicaSync(
        replicas,
        settings.probe_token_ids,
        tolerance=settings.probe_tolerance,
        collocated=settings.collocated,
    )


async def run_service(settings: TrainerSettings) -> None:
    """Run until SIGTERM/SIGINT or `max_steps`."""
    bus = NatsBus(settings.nats_url)
    await bus.connect()
    await bus.ensure_streams()
    trainer = await asyncio.to_thread(Trainer, settings)
    sink = MetricsSink(settings.run, settings.tensorboard_dir, settings.trackers)
    service = TrainerService(bus, trainer, build_sync(settings, trainer), sink)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    done = asyncio.create_task(service.wait())
    try:
        await asyncio.wait({waiter, done}, return_when=asyncio.FIRST_COMPLETED)
        if done.done():
            done.result()
    finally:
        waiter.cancel()
        await service.stop()
        await bus.close()
        log.info("trainer.stopped", run=settings.run, version=trainer.version)


def main(settings: TrainerSettings) -> None:
    """Configure logging and run the service to completion."""
    configure_logging("json")
    asyncio.run(run_service(settings))

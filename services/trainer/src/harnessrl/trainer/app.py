"""The trainer process: settings -> logging -> bus -> service -> run until signalled.

`python -m harnessrl.trainer` and `harnessrl trainer` both come here. The process stops on
SIGTERM/SIGINT or when the service reaches `max_steps`; an error from the training loop
propagates (the process fails) after the service and the bus are closed.

The service's own modules import torch and verl, so they are imported only once settings are
valid: `harnessrl --help` builds this module's parser and must stay fast.

Under `torchrun --nproc-per-node N` (data parallelism) every rank comes here with the same
settings: rank 0 runs the service (bus, rollouts, checkpoints, weight sync, announcements) and
drives every rank's engine; ranks > 0 connect to nothing and only follow rank 0's engine calls
(`ranks.RankChannel`), until rank 0 stops them on its way out.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from harnessrl.shared.bus import NatsBus
from harnessrl.shared.log import get_logger
from harnessrl.shared.metrics_export import exported
from harnessrl.shared.process import run_until_signalled, service_main
from harnessrl.trainer.settings import TrainerSettings, read_settings

if TYPE_CHECKING:
    from harnessrl.trainer.service import TrainerService
    from harnessrl.trainer.training import Trainer
    from harnessrl.trainer.weight_sync import WeightSyncer

log = get_logger(__name__)
# Flags that override a setting of the same name (None: not given on the command line).
OVERRIDES = (
    "run",
    "model_dir",
    "checkpoint_dir",
    "nats_url",
    "replicas",
    "mode",
    "staleness",
    "batch_groups",
    "max_steps",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The process options: a TOML file and the settings most often given by hand."""
    parser.add_argument("--config", help="TOML file with a [trainer] table")
    parser.add_argument("--run", help="run id")
    parser.add_argument("--model-dir", dest="model_dir", help="starting policy (HF directory)")
    parser.add_argument("--checkpoint-dir", dest="checkpoint_dir", help="checkpoint root")
    parser.add_argument("--nats-url", dest="nats_url", help="NATS server URL")
    parser.add_argument("--replica", dest="replicas", action="append", help="vLLM base URL")
    parser.add_argument("--mode", choices=("sync", "async"), help="on-policy or bounded staleness")
    parser.add_argument("--staleness", type=int, help="allowed version lag in async mode")
    parser.add_argument("--batch-groups", dest="batch_groups", type=int, help="groups per step")
    parser.add_argument("--max-steps", dest="max_steps", type=int, help="stop after this step")


def run(args: argparse.Namespace) -> int:
    """Load settings and run the service until signalled or `max_steps`; 2 on invalid settings."""
    overrides: dict[str, Any] = {name: getattr(args, name, None) for name in OVERRIDES}
    return service_main("trainer", lambda: read_settings(args.config, **overrides), serve_rank)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m harnessrl.trainer [options]`."""
    parser = argparse.ArgumentParser(
        prog="python -m harnessrl.trainer", description="run the trainer service"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def serve_rank(settings: TrainerSettings) -> None:
    """Rank 0 (or the only rank) serves; every other rank follows rank 0's engine."""
    from harnessrl.trainer.ranks import launched_rank

    if launched_rank() > 0:
        follow(settings)
    else:
        asyncio.run(serve(settings))


def follow(settings: TrainerSettings) -> None:
    """A rank > 0: build the engine (collectively with rank 0), run its commands until stopped."""
    from pathlib import Path

    from harnessrl.trainer.engine import PolicyEngine
    from harnessrl.trainer.ranks import ignore_stop_signals

    ignore_stop_signals()
    PolicyEngine(Path(settings.model_dir), settings.engine, settings.loss).follow()


async def serve(settings: TrainerSettings) -> None:
    """Connect the bus, build the service and run it until signalled or finished.

    Once the service has stopped, the other ranks (if any) are stopped too. Meanwhile its metrics
    are served and summarised (`metrics_port`, `metrics_interval_s`).
    """
    bus = NatsBus(settings.nats_url)
    await bus.connect()
    try:
        await bus.ensure_streams()
        service = await build_service(settings, bus)
        try:
            async with exported(
                bus, service.prometheus.registry, service="trainer", settings=settings, run=settings.run
            ):
                await run_until_signalled(service, finished=finished(service, settings))
        finally:
            service.trainer.engine.stop_followers()
            log.info("trainer.stopped", run=settings.run, version=service.trainer.version)
    finally:
        await bus.close()


async def finished(service: TrainerService, settings: TrainerSettings) -> None:
    """What ends the process: the training loop's end, or with `exit_at_max_steps` off only a signal.

    A fatal error of the loop ends it either way.
    """
    await service.wait()
    if not settings.exit_at_max_steps:
        log.info("trainer.finished", run=settings.run, step=service.trainer.state.step, staying_up=True)
        await asyncio.Event().wait()


async def build_service(settings: TrainerSettings, bus: NatsBus) -> TrainerService:
    """The trainer service with its engine (built on a thread: seconds), sync back-end and sinks."""
    from harnessrl.trainer.metrics import MetricsSink
    from harnessrl.trainer.service import TrainerService
    from harnessrl.trainer.training import Trainer

    trainer = await asyncio.to_thread(Trainer, settings)
    sink = MetricsSink(settings.run, settings.tensorboard_dir, settings.trackers)
    return TrainerService(bus, trainer, build_sync(settings, trainer, bus), sink)


def build_sync(settings: TrainerSettings, trainer: Trainer, bus: NatsBus) -> WeightSyncer:
    """The configured weight-sync back-end over every configured vLLM server.

    A replica that fails a sync is withdrawn from the gateways' rings over `bus`, and announced
    again once it passes (see `weight_sync`); gateways must name each replica by the same base
    URL as `settings.replicas`.
    """
    from harnessrl.trainer.nccl_sync import NcclReplicaSync
    from harnessrl.trainer.replica import VllmReplica
    from harnessrl.trainer.weight_sync import ReplicaSync, UpstreamAnnouncer

    replicas = [VllmReplica(url, settings.served_model) for url in settings.replicas]
    announcer = UpstreamAnnouncer(bus, settings.served_model)
    if settings.weight_transfer == "nccl":
        return NcclReplicaSync(
            trainer.engine,
            replicas,
            settings.probe_token_ids,
            master_address=settings.nccl_master_address,
            master_port=settings.nccl_master_port,
            tolerance=settings.probe_tolerance,
            on_failed=announcer.withdraw,
            on_restored=announcer.restore,
        )
    return ReplicaSync(
        replicas,
        settings.probe_token_ids,
        tolerance=settings.probe_tolerance,
        collocated=settings.collocated,
        on_failed=announcer.withdraw,
        on_restored=announcer.restore,
    )

"""The trainer's metrics: the service over a real nats-server, exported as `app.serve` exports them."""

import asyncio
import random
from pathlib import Path

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import ServiceMetrics
from harnessrl.shared.ids import new_id
from harnessrl.shared.metrics_export import exported
from harnessrl.shared.net import free_port
from harnessrl.testkit.prometheus import scrape
from harnessrl.testkit.span_sequences import publish_episodes, record_group
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.metrics import MetricsSink
from harnessrl.trainer.service import TrainerService
from harnessrl.trainer.settings import PoolSettings, TrainerSettings
from harnessrl.trainer.training import Trainer
from harnessrl.trainer.weight_sync import ReplicaSync


async def test_a_step_its_tokens_staleness_syncs_and_drops_are_served_and_summarised(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
) -> None:
    run = new_id("run")
    settings = TrainerSettings(
        run=run, model_dir=str(tiny_model), checkpoint_dir=str(tmp_path), mode="async", batch_groups=2,
        ack_recheck_s=0.2, pool=PoolSettings(span_wait_s=1.0, group_wait_s=600.0),
        metrics_port=free_port(), metrics_interval_s=0.2,
    )  # fmt: skip
    trainer = Trainer(settings, engine=policy_engine)
    service = TrainerService(bus, trainer, ReplicaSync([], settings.probe_token_ids), MetricsSink(run))
    url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
    rng = random.Random(1)
    async with exported(bus, service.prometheus.registry, service="trainer", settings=settings, run=run):
        await service.start()
        try:
            await publish_episodes(bus, record_group(run, "g1", rng))
            # A rollout whose spans never arrive: dropped after span_wait_s.
            await publish_episodes(bus, record_group(run, "g3", rng, size=1), publish_spans=False)
            await publish_episodes(bus, record_group(run, "g2", rng))
            async with asyncio.timeout(120):
                while not service.pool.dropped or service.last_metrics is None:
                    await asyncio.sleep(0.2)
            samples = await scrape(url)
            summary = await summary_with(bus, run, "harnessrl_trainer_weight_version", 1.0)
        finally:
            await service.stop()

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    step = service.last_metrics.values
    assert value("harnessrl_trainer_step") == 1.0
    assert value("harnessrl_trainer_weight_version") == 1.0
    assert value("harnessrl_trainer_batches_total", result="trained") == 1.0
    assert value("harnessrl_trainer_step_duration_seconds_count") == 1.0
    assert value("harnessrl_trainer_step_duration_seconds_sum") >= step["perf/step_s"]
    assert value("harnessrl_trainer_tokens_per_second") == step["perf/tokens_per_s"] > 0
    assert value("harnessrl_trainer_trained_tokens_total") == step["tokens/trained"] > 0
    assert value("harnessrl_trainer_sampled_tokens_total") == step["tokens/sampled"]
    untrained = {
        labels: v
        for (name, labels), v in samples.items()
        if name == "harnessrl_trainer_untrained_tokens_total"
    }
    assert sum(untrained.values()) == step["tokens/untrained"]
    assert value("harnessrl_trainer_rollouts_trained_total") == 8.0
    assert value("harnessrl_trainer_rollout_staleness_versions_count") == 8.0
    assert value("harnessrl_trainer_rollout_staleness_versions_bucket", le="0.0") == 8.0  # all on version 0
    assert value("harnessrl_trainer_weight_sync_duration_seconds_count") == 2.0  # at start, after the step
    assert value("harnessrl_trainer_weight_sync_failed_replicas") == 0.0
    assert value("harnessrl_trainer_rollouts_dropped_total", reason="spans_incomplete") == 1.0
    assert value("harnessrl_trainer_rollouts_assembled") == 0.0
    assert summary.service == "trainer" and summary.run == run
    assert summary.values['harnessrl_trainer_batches_total{result="trained"}'] == 1.0


async def summary_with(bus: Bus, run: str, key: str, want: float) -> ServiceMetrics:
    """The newest summary of `run`'s trainer, once one shows `key` at `want`."""
    async with asyncio.timeout(30):
        while True:
            stored = await bus.replay(subjects.METRICS.name, subjects.service_metrics("trainer"))
            summaries = [s for s in (item.decode(ServiceMetrics) for item in stored) if s.run == run]
            if summaries and summaries[-1].values.get(key) == want:
                return summaries[-1]
            await asyncio.sleep(0.1)

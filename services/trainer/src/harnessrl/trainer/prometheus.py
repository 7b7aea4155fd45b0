"""Prometheus metrics of the trainer (rank 0), in its own registry.

Step by step the service feeds in what each batch did (`observe_step`, from the same values its
`StepMetrics` carries) and what each weight sync did (`observe_sync`); the rollout pool and the
trainer state are read when scraped. `app.serve` serves the registry on `/metrics` and summarises it
on METRICS (`harnessrl.shared.metrics_export`); the per-step `StepMetrics` on
`hrl.metrics.<run>.trainer` stay what they are.

Labels are bounded: a batch result, an untrained-token reason, a drop reason, a harness, a model and
a break class; never a rollout. One trainer serves one run, so the run is the scrape target's, not
a label.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from harnessrl.trainer.metrics import MERGE_OUTCOMES, split_merge_key

if TYPE_CHECKING:
    from harnessrl.trainer.assembly import RolloutPool
    from harnessrl.trainer.training import StepResult, Trainer
    from harnessrl.trainer.weight_sync import SyncResult

# Step values (`metrics.report_values`) that are totals, not one reason a sampled token went untrained.
_TOKEN_TOTALS = frozenset({"tokens/sampled", "tokens/trainable", "tokens/untrained", "tokens/trained"})
# A CPU step of the tiny model takes about a second; a GPU step of a coding agent's batch, minutes.
_STEP_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_SYNC_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8, 16)


class _State(Collector):
    """What the pool and the trainer state say when scraped."""

    def __init__(self, pool: RolloutPool, trainer: Trainer, step_drops: Counter[str]) -> None:
        self._pool, self._trainer, self._step_drops = pool, trainer, step_drops

    def collect(self) -> Iterable[Metric]:
        state = self._trainer.state
        yield GaugeMetricFamily(
            "harnessrl_trainer_step", "Steps made (checkpointed) so far.", value=state.step
        )
        yield GaugeMetricFamily(
            "harnessrl_trainer_weight_version", "The policy version being trained.", value=state.version
        )
        yield GaugeMetricFamily(
            "harnessrl_trainer_rollouts_assembled",
            "Rollouts whose spans are all in and whose rows are built, waiting for their group's step.",
            value=len(self._pool.reports),
        )
        dropped = CounterMetricFamily(
            "harnessrl_trainer_rollouts_dropped",
            "Rollouts settled without training, by reason (stale, spans_incomplete, zero variance, ...).",
            labels=["reason"],
        )
        for reason, count in sorted((self._pool.dropped + self._step_drops).items()):
            dropped.add_metric([reason], count)
        yield dropped


class TrainerMetrics:
    """Steps, their time and throughput, tokens by fate, staleness, weight syncs and rollouts."""

    def __init__(self, pool: RolloutPool, trainer: Trainer) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._step_drops: Counter[str] = Counter()
        registry = self.registry
        self.batches = PromCounter(
            "harnessrl_trainer_batches",
            "Batches taken from the pool, by result: trained (a new version), untrained (a step that "
            "carries the previous weights), no_step (stale or settled rollouts only).",
            ["result"],
            registry=registry,
        )
        self.step_duration = Histogram(
            "harnessrl_trainer_step_duration_seconds",
            "Time to train and checkpoint one batch.",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.tokens_per_second = Gauge(
            "harnessrl_trainer_tokens_per_second",
            "Row tokens (prompt and completion) per second of the last trained step.",
            registry=registry,
        )
        self.sampled_tokens = PromCounter(
            "harnessrl_trainer_sampled_tokens",
            "Tokens the policy sampled in the rollouts of every batch.",
            registry=registry,
        )
        self.trained_tokens = PromCounter(
            "harnessrl_trainer_trained_tokens",
            "Sampled tokens that carried loss in a trained step.",
            registry=registry,
        )
        self.untrained_tokens = PromCounter(
            "harnessrl_trainer_untrained_tokens",
            "Sampled tokens that train in no row, by reason (prompt_too_long, truncated, dead_end, ...).",
            ["reason"],
            registry=registry,
        )
        self.merge_calls = PromCounter(
            "harnessrl_trainer_merge_calls",
            "Calls by what they did to their rollout's rows: extended one, or broke off by class "
            "(retry, template_dropped, retokenized, rewrote_history, branch), per harness and model.",
            ["harness", "model", "outcome"],
            registry=registry,
        )
        self.rollouts_trained = PromCounter(
            "harnessrl_trainer_rollouts_trained", "Rollouts trained in a step.", registry=registry
        )
        self.staleness = Histogram(
            "harnessrl_trainer_rollout_staleness_versions",
            "Versions a trained rollout lagged behind the weights it was trained on.",
            buckets=_STALENESS_BUCKETS,
            registry=registry,
        )
        self._sync_metrics(registry)
        registry.register(_State(pool, trainer, self._step_drops))

    def _sync_metrics(self, registry: CollectorRegistry) -> None:
        self.sync_duration = Histogram(
            "harnessrl_trainer_weight_sync_duration_seconds",
            "Time to load a version into every replica and probe it.",
            buckets=_SYNC_BUCKETS,
            registry=registry,
        )
        self.sync_failed_replicas = Gauge(
            "harnessrl_trainer_weight_sync_failed_replicas",
            "Replicas that failed the last sync (withdrawn from the gateways' ring).",
            registry=registry,
        )
        self.sync_replica_failures = PromCounter(
            "harnessrl_trainer_weight_sync_replica_failures",
            "Replica syncs that failed (load or probe).",
            registry=registry,
        )
        self.sync_probe_gap = Gauge(
            "harnessrl_trainer_weight_sync_probe_gap",
            "The worst logprob gap between the trainer and a replica that passed the last sync's probe.",
            registry=registry,
        )

    def observe_sync(self, result: SyncResult) -> None:
        """Count what one weight sync did."""
        self.sync_failed_replicas.set(len(result.failed))
        self.sync_replica_failures.inc(len(result.failed))
        self.sync_probe_gap.set(result.gap)

    def observe_step(self, result: StepResult) -> None:
        """Count what one batch did, from its step values (`metrics.batch_metrics`)."""
        values = result.metrics.values
        self.batches.labels(_batch_result(result)).inc()
        self.sampled_tokens.inc(values.get("tokens/sampled", 0.0))
        self.trained_tokens.inc(values.get("tokens/trained", 0.0))
        self.rollouts_trained.inc(values.get("rollouts/trained", 0.0))
        for name, count in values.items():
            if name.startswith("tokens/") and name not in _TOKEN_TOTALS:
                self.untrained_tokens.labels(name.removeprefix("tokens/")).inc(count)
        for name, count in values.items():
            parts = split_merge_key(name)
            if parts is not None and parts[2] in MERGE_OUTCOMES:
                self.merge_calls.labels(*parts).inc(count)
        if "perf/tokens_per_s" in values:
            self.tokens_per_second.set(values["perf/tokens_per_s"])
        for lag, count in result.metrics.staleness.items():
            for _ in range(count):
                self.staleness.observe(int(lag))
        self._step_drops.update(result.metrics.dropped)


def _batch_result(result: StepResult) -> str:
    if result.trained:
        return "trained"
    return "untrained" if result.checkpoint is not None else "no_step"

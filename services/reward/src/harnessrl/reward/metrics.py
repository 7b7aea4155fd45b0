"""Prometheus metrics of one reward worker, in its own registry (several workers fit in one process).

`app.serve` serves them on `/metrics` and summarises them on METRICS
(`harnessrl.shared.metrics_export`). Labels are bounded: a grader outcome (`graders.base.Outcome`),
an event kind, a refusal reason; never a run or an episode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

# From an exact-match grader (microseconds) to a SWE-bench test run in a sandbox (minutes).
_GRADING_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _Refused(Collector):
    """The service's own count of refused verdicts, read at scrape time."""

    def __init__(self, refused: Mapping[str, int]) -> None:
        self._refused = refused

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "harnessrl_reward_verdicts_refused",
            "Verdicts refused instead of published as a reward (the episode fails), by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(self._refused.items()):
            family.add_metric([reason], count)
        yield family


class RewardMetrics:
    """Gradings, their latency, what was published, and the verdicts refused (`refused`, by reason)."""

    def __init__(self, refused: Mapping[str, int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.gradings = Counter(
            "harnessrl_reward_gradings",
            "Verdicts of graders, by outcome (graded, empty-patch, timeout, grader-error, ...).",
            ["outcome"],
            registry=self.registry,
        )
        self.results = Counter(
            "harnessrl_reward_results",
            "Results published for the first time, by event (scored, failed).",
            ["event"],
            registry=self.registry,
        )
        self.republished = Counter(
            "harnessrl_reward_results_republished",
            "Redelivered events answered with their stored result instead of a new grading.",
            registry=self.registry,
        )
        self.duration = Histogram(
            "harnessrl_reward_grading_duration_seconds",
            "Time to grade one episode: artifact fetch, grader and its sandbox.",
            buckets=_GRADING_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "harnessrl_reward_gradings_in_flight", "Gradings running now.", registry=self.registry
        )
        self.registry.register(_Refused(refused))

    @contextlib.contextmanager
    def grading(self) -> Iterator[None]:
        """Count one grading as in flight while the block runs, and time it."""
        with self.in_flight.track_inprogress(), self.duration.time():
            yield

    def published(self, subject: str) -> None:
        """Count a first-time result by its event kind (the subject's last token)."""
        self.results.labels(subject.rsplit(".", 1)[-1]).inc()

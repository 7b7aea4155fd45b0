"""Prometheus metrics of one controller process, read from its state when scraped.

The episode records are the truth (they survive a restart in KV), so episodes by phase, failures by
cause and retries are counted from them at scrape time rather than kept twice; launches are counted
as they happen by `CountedLauncher`, which the controller wraps around every run's launcher. A
standby reports its lease as not held and nothing else. `app.serve` serves the registry on
`/metrics` and summarises it on METRICS (`harnessrl.shared.metrics_export`).

Labels are bounded: a run (one controller drives a few), a phase, a failure cause, a launcher
kind; never an episode.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from harnessrl.controller.launchers.base import (
    ExitCallback,
    ExitStatus,
    Launcher,
    LaunchError,
    LauncherUnavailableError,
    LaunchRequest,
)
from harnessrl.controller.records import Phase

if TYPE_CHECKING:
    from harnessrl.controller.run_driver import RunDriver
    from harnessrl.controller.service import Controller
    from harnessrl.controller.standby import ActiveStandby

# Launch outcomes: started, failed (an infra failure, retried as a new attempt), or the launcher's
# back end was unreachable (the same launch is tried again).
LaunchCounts = Counter[tuple[str, str]]


class CountedLauncher(Launcher):
    """A run's launcher, its launches counted by launcher kind and outcome in `counts`."""

    def __init__(self, inner: Launcher, counts: LaunchCounts) -> None:
        self._inner, self._counts = inner, counts
        self.kind = inner.kind

    async def start(self, on_exit: ExitCallback) -> None:
        """The inner launcher's `start`."""
        await self._inner.start(on_exit)

    async def launch(self, request: LaunchRequest) -> str:
        """The inner launcher's `launch`, counted by its outcome."""
        try:
            where = await self._inner.launch(request)
        except LauncherUnavailableError:
            self._counts[self.kind, "unavailable"] += 1
            raise
        except LaunchError:
            self._counts[self.kind, "failed"] += 1
            raise
        self._counts[self.kind, "launched"] += 1
        return where

    async def relist(self) -> dict[str, ExitStatus | None]:
        """The inner launcher's `relist`."""
        return await self._inner.relist()

    async def close(self) -> None:
        """The inner launcher's `close`."""
        await self._inner.close()


class ControllerMetrics(Collector):
    """Lease, runs, episodes, failures, retries, the queue and launches of one controller process."""

    def __init__(self, process: ActiveStandby) -> None:
        self._process = process
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def collect(self) -> Iterable[Metric]:
        """Every family, read from the process's state now (on its event loop)."""
        yield self._lease()
        controller = self._process.controller
        if controller is not None:
            yield from _controller_families(controller)

    def _lease(self) -> Metric:
        family = GaugeMetricFamily(
            "harnessrl_controller_lease_held",
            "1 while this controller holds its group's lease (the active one), 0 as a standby.",
            labels=["lease"],
        )
        lease = self._process.lease
        if lease is not None:
            family.add_metric([lease.key], 1.0 if lease.held else 0.0)
        return family


def _controller_families(controller: Controller) -> Iterator[Metric]:
    runs = GaugeMetricFamily(
        "harnessrl_controller_runs", "Runs this controller drives, by state.", labels=["state"]
    )
    states = Counter(_state(driver) for driver in controller.runs.values())
    for state in ("active", "done", "stopped"):
        runs.add_metric([state], states[state])
    yield runs
    yield from _episode_families(controller.runs.values())
    launches = CounterMetricFamily(
        "harnessrl_controller_launches",
        "Harness launches by launcher kind and outcome (launched, failed, unavailable).",
        labels=["kind", "outcome"],
    )
    for (kind, outcome), count in sorted(controller.launches.items()):
        launches.add_metric([kind, outcome], count)
    yield launches
    yield CounterMetricFamily(
        "harnessrl_controller_run_submissions_refused",
        "Run submissions refused since this controller started.",
        value=sum(controller.refused.values()),
    )


def _episode_families(drivers: Iterable[RunDriver]) -> Iterator[Metric]:
    episodes = GaugeMetricFamily(
        "harnessrl_controller_episodes", "Episode attempts by run and phase.", labels=["run", "phase"]
    )
    failures = CounterMetricFamily(
        "harnessrl_controller_episode_failures",
        "Failed episode attempts by run and failure class (agent, timeout, infra, reward-error).",
        labels=["run", "cause"],
    )
    retries = CounterMetricFamily(
        "harnessrl_controller_episode_retries",
        "Infra failures retried as a new attempt, by run.",
        labels=["run"],
    )
    in_flight = GaugeMetricFamily(
        "harnessrl_controller_episodes_in_flight",
        "Harnesses scheduled or running (what max_concurrent bounds), by run.",
        labels=["run"],
    )
    unscheduled = GaugeMetricFamily(
        "harnessrl_controller_groups_unscheduled",
        "Groups of a run not scheduled yet (waiting for admission or a free slot).",
        labels=["run"],
    )
    version = GaugeMetricFamily(
        "harnessrl_controller_weight_version", "The newest weight version a run has seen.", labels=["run"]
    )
    for driver in drivers:
        run, records = driver.spec.run, list(driver.episodes.records.values())
        phases = Counter(record.phase for record in records)
        for phase in get_args(Phase):
            episodes.add_metric([run, phase], phases[phase])
        for cause, count in sorted(Counter(r.cause for r in records if r.cause).items()):
            failures.add_metric([run, cause], count)
        retries.add_metric([run], sum(1 for record in records if record.retried_as))
        in_flight.add_metric([run], driver.live())
        scheduled = len({record.group for record in records if not record.byo})
        unscheduled.add_metric([run], max(0, driver.total_groups - scheduled))
        version.add_metric([run], driver.version)
    yield from (episodes, failures, retries, in_flight, unscheduled, version)


def _state(driver: RunDriver) -> str:
    return "stopped" if driver.stopped else "done" if driver.done.is_set() else "active"

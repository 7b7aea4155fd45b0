"""Summaries of a service's metrics on METRICS: periodic, and a last one when the service stops."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from harnessrl.shared import subjects
from harnessrl.shared.bus.memory import MemoryBus
from harnessrl.shared.contracts import ServiceMetrics
from harnessrl.shared.metrics_export import LAST_SUMMARY_BUDGET_S, SummaryPublisher


async def _summaries(bus: MemoryBus) -> list[ServiceMetrics]:
    found = await bus.replay(subjects.METRICS.name, subjects.metrics_of_run(subjects.SERVICE_SCOPE))
    return [item.decode(ServiceMetrics) for item in found]


async def test_a_service_shorter_than_one_interval_still_reports_on_stop() -> None:
    bus = MemoryBus()
    await bus.connect()
    await bus.ensure_streams()
    registry = CollectorRegistry()
    steps = Counter("harnessrl_trainer_steps", "Steps.", registry=registry)
    publisher = SummaryPublisher(bus, registry, service="trainer", interval_s=3600, run="r")
    await publisher.start()
    steps.inc(2)
    assert await _summaries(bus) == []  # the interval has not passed
    await publisher.stop()
    (last,) = await _summaries(bus)
    assert last.service == "trainer" and last.run == "r"
    assert last.values["harnessrl_trainer_steps_total"] == 2.0


async def test_summaries_switched_off_publish_nothing_on_stop() -> None:
    bus = MemoryBus()
    await bus.connect()
    await bus.ensure_streams()
    publisher = SummaryPublisher(bus, CollectorRegistry(), service="reward", interval_s=0)
    await publisher.start()
    await publisher.stop()
    assert await _summaries(bus) == []


async def test_a_service_whose_bus_is_gone_stops_without_waiting_for_it() -> None:
    bus = MemoryBus()
    await bus.connect()
    await bus.ensure_streams()
    publisher = SummaryPublisher(bus, CollectorRegistry(), service="gateway", interval_s=3600)
    await publisher.start()
    await bus.close()  # its NATS went first (the whole stack is stopping)
    await asyncio.wait_for(publisher.stop(), LAST_SUMMARY_BUDGET_S)
    assert await _summaries(bus) == []

"""The Grafana dashboard the chart ships asks only for metrics the services export.

Every `harnessrl_*` name in the dashboard's PromQL (panel targets and template variables) must be a
sample name of one service's registry: a gauge's own name, a counter's `_total`, a histogram's
`_bucket`, `_sum` and `_count`. The registries are built as the services build them (families exist
before anything is counted); the per-service `test_prometheus.py` tests scrape them while working.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from harnessrl.controller.metrics import ControllerMetrics
from harnessrl.controller.service import Controller
from harnessrl.controller.settings import ControllerSettings
from harnessrl.controller.standby import ActiveStandby
from harnessrl.gateway.metrics import GatewayMetrics
from harnessrl.reward.metrics import RewardMetrics
from harnessrl.shared.bus import MemoryBus
from harnessrl.shared.metrics_export import ConsumerLag
from harnessrl.testkit.tools import HELM
from harnessrl.trainer.prometheus import TrainerMetrics

CHART = Path(__file__).resolve().parents[1] / "charts" / "harnessrl"
DASHBOARD = CHART / "dashboards" / "harnessrl.json"
METRIC = re.compile(r"\bharnessrl_[a-z0-9_]+\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """The sample names a registry's families are exported under."""
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def exported() -> dict[str, set[str]]:
    """Each service's exported sample names."""
    bus = MemoryBus()
    process = ActiveStandby(bus, ControllerSettings())
    process.controller = Controller(bus, ControllerSettings())  # as once the lease is held
    pool = SimpleNamespace(reports={}, dropped=Counter())
    trainer = SimpleNamespace(state=SimpleNamespace(step=0, version=0))
    registries = {
        "gateway": GatewayMetrics().registry,
        "controller": ControllerMetrics(process).registry,
        "reward": RewardMetrics(Counter()).registry,
        "trainer": TrainerMetrics(pool, trainer).registry,  # type: ignore[arg-type]
    }
    for service, registry in registries.items():  # as `metrics_export` adds them to each service's
        ConsumerLag(bus, registry, service=service)
    return {service: sample_names(registry) for service, registry in registries.items()}


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variable queries."""
    found = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    found += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return found


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = {name for expr in queries(dashboard) for name in METRIC.findall(expr)}
    known = set().union(*exported().values())
    assert names, "the dashboard queries no harnessrl metric"
    assert sorted(names - known) == []


def test_the_dashboard_shows_every_service() -> None:
    names = {name for expr in queries(json.loads(DASHBOARD.read_text())) for name in METRIC.findall(expr)}
    for service, samples in exported().items():
        assert names & samples, f"no panel shows a {service} metric"


def test_exported_names_follow_the_conventions() -> None:
    """`harnessrl_<service>_...`; counters `_total`; durations in seconds, never milliseconds."""
    for service, samples in exported().items():
        for name in samples:
            assert name.startswith(f"harnessrl_{service}_"), name
            assert not re.search(r"_(ms|milliseconds|kb|mb)(_|$)", name), name


def test_the_chart_ships_the_dashboard_as_a_configmap() -> None:
    done = subprocess.run(
        [str(HELM), "template", "hrl", str(CHART), "--set", "trainer.run=r",
         "--show-only", "templates/dashboard.yaml"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    config_map = yaml.safe_load(done.stdout)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["harnessrl.json"]) == json.loads(DASHBOARD.read_text())

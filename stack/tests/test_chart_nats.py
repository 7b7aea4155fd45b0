"""The chart's NATS: a single server by default, a three-server JetStream cluster with R3 streams in
production (`helm template`; strict schema validation of both is in the controller's chart test)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from harnessrl.testkit.tools import HELM

CHART = Path(__file__).resolve().parents[2] / "charts" / "harnessrl"
PRODUCTION = str(CHART / "values-production.yaml")
SERVICES = ("gateway", "controller", "reward", "trainer")

pytestmark = pytest.mark.skipif(not HELM.exists(), reason="helm is not installed")


def helm_template(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HELM), "template", "hrl", str(CHART), "--namespace", "train", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def render(*args: str) -> list[dict[str, Any]]:
    done = helm_template(*args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def service_env(docs: list[dict[str, Any]], service: str) -> dict[str, str]:
    pod = named(docs, "Deployment", f"hrl-harnessrl-{service}")["spec"]["template"]["spec"]
    return {e["name"]: e.get("value", "") for e in pod["containers"][0]["env"]}


def test_production_runs_a_three_server_cluster_with_r3_streams() -> None:
    docs = render("-f", PRODUCTION)
    nats = named(docs, "StatefulSet", "hrl-harnessrl-nats")["spec"]
    assert nats["replicas"] == 3 and nats["podManagementPolicy"] == "Parallel"
    assert nats["serviceName"] == "hrl-harnessrl-nats-cluster"
    headless = named(docs, "Service", "hrl-harnessrl-nats-cluster")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert named(docs, "PodDisruptionBudget", "hrl-harnessrl-nats")["spec"]["maxUnavailable"] == 1
    conf = named(docs, "ConfigMap", "hrl-harnessrl-nats")["data"]["nats.conf"]
    assert "store_dir: /data" in conf and "server_name: $SERVER_NAME" in conf
    for i in range(3):
        assert f"nats://hrl-harnessrl-nats-{i}.hrl-harnessrl-nats-cluster:6222" in conf
    container = nats["template"]["spec"]["containers"][0]
    assert {"name": "SERVER_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container[
        "env"
    ]
    claim = nats["volumeClaimTemplates"][0]["spec"]
    assert claim["resources"]["requests"]["storage"] == "200Gi"
    for service in SERVICES:
        assert service_env(docs, service)["HRL_NATS_REPLICAS"] == "3"


def test_default_is_one_server_and_r1() -> None:
    docs = render()
    nats = named(docs, "StatefulSet", "hrl-harnessrl-nats")["spec"]
    assert nats["replicas"] == 1 and "podManagementPolicy" not in nats
    assert "cluster {" not in named(docs, "ConfigMap", "hrl-harnessrl-nats")["data"]["nats.conf"]
    assert not any(d["kind"] == "PodDisruptionBudget" for d in docs)
    for service in SERVICES:
        assert "HRL_NATS_REPLICAS" not in service_env(docs, service)


def test_an_external_cluster_takes_its_replica_count() -> None:
    docs = render(
        "--set",
        "nats.deploy=false",
        "--set",
        "nats.url=nats://nats.infra:4222",
        "--set",
        "nats.streamReplicas=3",
    )
    assert service_env(docs, "controller")["HRL_NATS_REPLICAS"] == "3"


def test_more_stream_replicas_than_servers_are_refused() -> None:
    done = helm_template("--set", "nats.streamReplicas=3")
    assert done.returncode != 0 and "nats.streamReplicas 3 needs nats.replicas of 3 or more" in done.stderr

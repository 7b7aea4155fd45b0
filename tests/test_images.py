"""The container images: built (cached by input hash), and each service's container, started the way
the chart's local-cpu scenario renders it, runs as a non-root user on a read-only root and passes
its probe; an episode container reaches only the gateway.

The first build on a machine takes long (see `make images`); after it, `build_images()` checks the
input hashes and returns in seconds, and this module's wall time is dominated by vLLM's start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.shared.cache import cache_root
from harnessrl.testkit import cluster, cluster_run, pods
from harnessrl.testkit.cluster import CLUSTER_NET, EPISODE_NET, LocalCluster
from harnessrl.testkit.images import IMAGE_BY_NAME, IMAGES, Built, build_images

# Needs the container images (`make images`: about 9 minutes the first time on 2 cores):
# run by `make cluster-check`, not `make test`.
pytestmark = pytest.mark.images


@pytest.fixture(scope="module")
def built() -> list[Built]:
    """Every image, built or found cached."""
    return build_images()


@pytest.fixture(scope="module")
def running(
    built: list[Built], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalCluster, str]]:
    """The rendered local-cpu scenario's pods, every one ready."""
    run = cluster_run.TrainingRun(tmp_path_factory.mktemp("cluster"))
    with cluster_run.running_cluster(run) as started:
        yield started


def test_every_image_is_built_and_a_rebuild_is_cached(built: list[Built]) -> None:
    assert {b.name for b in built} == {s.name for s in IMAGES}
    start = time.monotonic()
    again = build_images()
    assert all(b.cached for b in again), [b.name for b in again if not b.cached]
    assert time.monotonic() - start < 120


def test_service_images_carry_only_their_own_closure(built: list[Built]) -> None:
    sizes = {b.name: b for b in built}
    # The gateway has no torch, no Kubernetes client; the controller no web framework.
    assert sizes["gateway"].size_mb < sizes["trainer"].size_mb / 3
    context = Path(IMAGE_BY_NAME["gateway"].containerfile)
    assert context.name == "Containerfile"
    gateway_reqs = (cache_root() / "images" / "context" / "gateway" / "requirements.txt").read_text()
    assert "torch" not in gateway_reqs and "kubernetes" not in gateway_reqs
    assert "litestar==" in gateway_reqs


def test_every_pod_is_ready_non_root_and_read_only(running: tuple[LocalCluster, str]) -> None:
    local, _ = running
    components = sorted(p.component for p in local.pods)
    assert components == ["controller", "gateway", "gateway", "nats", "reward", "trainer", "vllm"]
    assert all(p.ready for p in local.pods)
    for pod in local.pods:
        if pod.component == "nats":
            continue
        seen = local.identity(pod)
        assert seen == {"uid": 65532, "root_writable": False, "read_only": True}, pod.name


def test_an_episode_container_reaches_only_the_gateway(running: tuple[LocalCluster, str]) -> None:
    local, api_url = running
    others = [p for p in local.pods if p.component != "gateway"]
    host, port = api_url.removeprefix("http://").rsplit(":", 1)
    targets = [("hrl-harnessrl-gateway", 8000), ("hrl-harnessrl-nats", 4222), (host, int(port))]
    targets += [(pods.address(p.container, CLUSTER_NET), cluster.first_port(p)) for p in others]
    answers = cluster.can_connect(EPISODE_NET, IMAGE_BY_NAME["harness"].ref, targets)
    assert answers[0], "the gateway is unreachable from the episode network"
    assert not any(answers[1:]), [t for t, ok in zip(targets, answers, strict=True) if ok][1:]

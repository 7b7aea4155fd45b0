"""`make cluster-check`: the chart's `local-cpu` scenario rendered by helm and run in real containers.

1. `make images` (cached by input hash).
2. `helm template` with `charts/harnessrl/ci/local-cpu-values.yaml`; every Deployment and StatefulSet
   replica runs as a podman container with its own image, command, env, volumes, probes and security
   context (`harnessrl.testkit.cluster`); a ClusterIP Service is a proxy container that sends each
   connection to the next of its pods (the kube-proxy stand-in), a headless one network aliases;
   the API server is the fake Kubernetes API (`harnessrl.testkit.fake_kube`) on this machine's
   address on the service network.
3. Each pod must pass its readiness (else liveness) probe; each service container must run as a
   non-root user on a read-only root (checked inside it: a write to / fails).
4. A hardened container on the episode network (which only the gateway Service's proxy joins) must
   reach the gateway and nothing else: NATS, vLLM, the controller, the reward worker, the trainer,
   the API server.
5. One short training run end to end (`harnessrl.testkit.cluster_run`) from the demo's
   warm-started model: episodes as Jobs the controller creates, run by the test kit's job runner
   as hardened containers on the networks their NetworkPolicies allow, through both gateway
   replicas; a SWE instance's episodes copy its repository from a task image (init container) and
   their patches are graded in the reward service's grading Jobs (no network; the grader reads the
   pod log); at least two trainer steps; new weights served.

The last line is one JSON object: images, pods_ready, episodes_completed, steps, gateway_replicas,
spans_missing, episode_egress_blocked (plus patches_graded, failures and seconds). Exit status 1
when a check fails.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harnessrl.testkit import cluster, cluster_run, pods
from harnessrl.testkit.cluster import CLUSTER_NET, EPISODE_NET, LocalCluster
from harnessrl.testkit.images import IMAGE_BY_NAME, ImageError, build_images


def main() -> None:
    """Run every check; print the report as the last line; exit 1 if any failed."""
    # A stopped check still removes its containers and networks (the `finally` blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.monotonic()
    report: dict[str, Any] = {
        "images": 0, "pods_ready": 0, "episodes_completed": 0, "steps": 0, "gateway_replicas": 0,
        "spans_missing": None, "episode_egress_blocked": False, "patches_graded": 0, "failures": [],
    }  # fmt: skip
    try:
        report["images"] = len(build_images())
        _run_cluster(report)
    except (ImageError, cluster.ClusterError) as exc:
        report["failures"].append(str(exc).splitlines()[0][:300])
        print(f"cluster-check: {exc}", file=sys.stderr)  # noqa: T201 - the check's error report
    report["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(report))  # noqa: T201 - the benchmark's last line
    sys.exit(1 if report["failures"] else 0)


def _run_cluster(report: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="hrl-cluster-") as tmp:
        run = cluster_run.TrainingRun(Path(tmp))
        with cluster_run.running_cluster(run) as (local, api_url):
            report["pods_ready"] = sum(p.ready for p in local.pods)
            report["gateway_replicas"] = sum(p.component == "gateway" and p.ready for p in local.pods)
            _check_identities(local, report)
            report["episode_egress_blocked"] = _check_egress(local, api_url, report)
            report.update(run.train(local, report["failures"]))


def _check_identities(local: LocalCluster, report: dict[str, Any]) -> None:
    for pod in local.pods:
        if pod.component == "nats":  # scratch image: no python to look from inside
            continue
        seen = local.identity(pod)
        if seen["uid"] in (None, 0) or seen["root_writable"] or not seen["read_only"]:
            report["failures"].append(f"{pod.name}: runs as uid {seen['uid']}, root writable {seen}")


def _check_egress(local: LocalCluster, api_url: str, report: dict[str, Any]) -> bool:
    """A hardened episode container reaches the gateway and nothing else."""
    gateway = next(p for p in local.pods if p.component == "gateway")
    others = [p for p in local.pods if p.component != "gateway"]
    targets = [("hrl-harnessrl-gateway", 8000), ("hrl-harnessrl-nats", 4222)]
    targets += [(pods.address(p.container, CLUSTER_NET), cluster.first_port(p)) for p in others]
    host, port = api_url.removeprefix("http://").rsplit(":", 1)
    targets.append((host, int(port)))
    answers = cluster.can_connect(EPISODE_NET, IMAGE_BY_NAME["harness"].ref, targets)
    if not answers[0]:
        report["failures"].append(f"an episode container cannot reach the gateway ({gateway.name})")
    leaks = [f"{h}:{p}" for (h, p), ok in zip(targets[1:], answers[1:], strict=True) if ok]
    if leaks:
        report["failures"].append(f"an episode container reaches {', '.join(leaks)}")
    return answers[0] and not leaks


if __name__ == "__main__":
    main()

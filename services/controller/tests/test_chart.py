"""The Helm chart: `helm lint`, and `helm template` output that passes `kubernetes-validate --strict`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harnessrl.testkit.tools import HELM

CHART = Path(__file__).resolve().parents[3] / "charts" / "harnessrl"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=False)


def render(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    done = helm("template", "hrl", str(CHART), "--namespace", "train", *args)
    assert done.returncode == 0, done.stderr
    path = tmp_path / "rendered.yaml"
    path.write_text(done.stdout)
    tool = Path(sys.executable).with_name("kubernetes-validate")
    check = subprocess.run([str(tool), "--strict", str(path)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix))


def test_lint() -> None:
    done = helm("lint", str(CHART), "--strict")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("-f", str(CHART / "values-production.yaml")),
        ("--set", "nats.deploy=false", "--set", "nats.url=nats://nats.infra:4222"),
    ],
)
def test_rendered_manifests_pass_strict_validation(tmp_path: Path, args: tuple[str, ...]) -> None:
    docs = render(tmp_path, *args)
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Service",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "NetworkPolicy",
        "Secret",
    } <= kinds
    controller = find(docs, "Deployment", "-controller")
    # Active and standby behind the lease; a rolling update never runs more than the two.
    assert controller["spec"]["replicas"] == 2
    assert controller["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }
    env = {e["name"]: e for e in controller["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HRL_CONTROLLER_KEY_SECRET"]["valueFrom"]["secretKeyRef"]["key"] == "secret"
    assert env["HRL_CONTROLLER_GATEWAY_URL"]["value"] == "http://hrl-harnessrl-gateway.train.svc:8000"
    expected_nats = (
        "nats://nats.infra:4222" if "nats.deploy=false" in args else "nats://hrl-harnessrl-nats:4222"
    )
    assert env["HRL_CONTROLLER_NATS_URL"]["value"] == expected_nats
    assert ("StatefulSet" in kinds) == ("nats.deploy=false" not in args)
    gateway = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    gateway_env = {e["name"]: e.get("value") for e in gateway["containers"][0]["env"]}
    assert gateway_env["HRL_GATEWAY_SHUTDOWN_GRACE_S"] == "20"
    assert gateway["terminationGracePeriodSeconds"] == 30  # the drain, and 10 s to close the bus


def test_rbac_and_episode_network_policy(tmp_path: Path) -> None:
    docs = render(tmp_path)
    rules = {tuple(r["resources"]): set(r["verbs"]) for r in find(docs, "Role", "-controller")["rules"]}
    assert rules[("jobs",)] >= {"create", "get", "list", "watch", "delete"}
    assert rules[("pods",)] == {"get", "list", "watch"}
    assert rules[("secrets",)] >= {"create", "patch"}
    policy = find(docs, "NetworkPolicy", "-episodes")["spec"]
    assert policy["podSelector"] == {"matchLabels": {"harnessrl.io/role": "episode"}}
    assert policy["ingress"] == [] and set(policy["policyTypes"]) == {"Ingress", "Egress"}
    gateway_rule, dns_rule = policy["egress"]
    assert gateway_rule["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert {p["port"] for p in dns_rule["ports"]} == {53}
    for deployment in (
        d for d in docs if d["kind"] == "Deployment" and not d["metadata"]["name"].endswith("vllm")
    ):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def test_external_nats_needs_a_url() -> None:
    done = helm("template", "hrl", str(CHART), "--set", "nats.deploy=false")
    assert done.returncode != 0 and "nats.url is required when nats.deploy=false" in done.stderr


def trainer_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = find(docs, "Deployment", "-trainer")["spec"]["template"]["spec"]
    container: dict[str, Any] = pod["containers"][0]
    return container


def test_a_trainer_on_several_ranks_runs_under_torchrun_and_is_otherwise_the_same(tmp_path: Path) -> None:
    single = trainer_container(render(tmp_path))
    assert single["command"] == ["python", "-m", "harnessrl.trainer"]
    several = trainer_container(render(tmp_path, "--set", "trainer.ranks=2", "--set", "nats.replicas=3"))
    assert several.pop("command") == [
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "harnessrl.trainer",
    ]  # fmt: skip
    same_nats = trainer_container(render(tmp_path, "--set", "nats.replicas=3"))
    same_nats.pop("command")
    assert several == same_nats  # env, resources, security context and mounts untouched


def test_trainer_ranks_below_one_are_refused() -> None:
    done = helm("template", "hrl", str(CHART), "--set", "trainer.ranks=0")
    assert done.returncode != 0 and "trainer.ranks must be 1 or more, not 0" in done.stderr

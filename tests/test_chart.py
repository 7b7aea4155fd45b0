"""The Helm chart, rendered by the real `helm` and checked against what the services really read.

Every `ci/*-values.yaml` scenario renders, lints and validates: built-in kinds with
`kubernetes-validate` (strict); the JobSet, the PyTorchJob and the ServiceMonitor against their
projects' published CRD schemas (`harnessrl.testkit.crds`). The wiring is checked against the
services' own code: each service's rendered environment loads into its own settings object, the
vLLM replica addresses are
the StatefulSet's pods, the NATS users are `harnessrl.shared.nats_permissions` (and a real
nats-server enforces the rendered configuration), the episode and grading policies select the labels
the controller and the reward service put on their pods.
"""

from __future__ import annotations

import base64
import fnmatch
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import msgspec
import pytest
import yaml

from harnessrl.controller.launchers.kube_manifest import render_job
from harnessrl.controller.settings import read_settings as controller_settings
from harnessrl.gateway.reasoning_parse import REASONING_PARSERS
from harnessrl.gateway.settings import GatewaySettings
from harnessrl.gateway.settings import read_settings as gateway_settings
from harnessrl.gateway.tool_parse import TOOL_PARSERS
from harnessrl.reward.settings import read_settings as reward_settings
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.kube import grading_job
from harnessrl.shared.contracts import LauncherSpec
from harnessrl.shared.nats_permissions import PERMISSIONS, url_user
from harnessrl.shared.net import VLLM_TOOL_CALL_PARSER, free_port
from harnessrl.stack.natsserver import NatsServer, nats_server_binary
from harnessrl.testkit import crds
from harnessrl.testkit.exits import launch_request
from harnessrl.testkit.images import IMAGE_BY_NAME, IMAGES
from harnessrl.testkit.tools import HELM
from harnessrl.trainer.settings import read_settings as trainer_settings

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "harnessrl"
SCENARIOS = sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml"))
PRODUCTION = str(CHART / "values-production.yaml")
NS = "train"
PREFIX = "hrl-harnessrl"
SERVICES = ("gateway", "controller", "reward", "trainer")
READERS = {
    "gateway": gateway_settings,
    "controller": controller_settings,
    "reward": reward_settings,
    "trainer": trainer_settings,
}
CRD_KINDS = set(crds.FILES)
WORKLOADS = ("Deployment", "StatefulSet")

Doc = dict[str, Any]


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=False)


def template(*args: str) -> subprocess.CompletedProcess[str]:
    return helm("template", "hrl", str(CHART), "--namespace", NS, *args)


def scenario(name: str) -> tuple[str, str]:
    return ("-f", str(CHART / "ci" / f"{name}-values.yaml"))


def render(*args: str) -> list[Doc]:
    done = template(*args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def validate(docs: list[Doc]) -> None:
    """Built-in kinds strictly against Kubernetes' schemas, CRD kinds against the published ones."""
    for doc in docs:
        kind = (doc["apiVersion"], doc["kind"])
        if kind in CRD_KINDS:
            assert crds.validate(doc) == [], f"{doc['kind']} {doc['metadata']['name']}"
        else:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def kinds(docs: list[Doc]) -> set[str]:
    return {d["kind"] for d in docs}


def pod_specs(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    """Every pod spec the chart renders (workloads, the JobSet's and PyTorchJob's, the test pod)."""
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in WORKLOADS:
            yield name, doc["spec"]["template"]["spec"]
        elif doc["kind"] == "JobSet":
            for job in doc["spec"]["replicatedJobs"]:
                yield name, job["template"]["spec"]["template"]["spec"]
        elif doc["kind"] == "PyTorchJob":
            for role, replica in doc["spec"]["pytorchReplicaSpecs"].items():
                yield f"{name}/{role}", replica["template"]["spec"]
        elif doc["kind"] == "Pod":
            yield name, doc["spec"]


def service_pod(docs: list[Doc], service: str) -> Doc:
    """The pod spec of a service (the trainer's first pod where it is a JobSet or a PyTorchJob)."""
    for doc in docs:
        if doc["metadata"]["name"] == f"{PREFIX}-{service}" and doc["kind"] in (
            *WORKLOADS,
            "JobSet",
            "PyTorchJob",
        ):
            return next(spec for _, spec in pod_specs([doc]))
    raise AssertionError(f"no workload for {service}")


def container_env(container: Doc) -> dict[str, str]:
    """A container's environment as Kubernetes would give it: references resolved to stand-ins."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "valueFrom" in entry:
            ref = entry["valueFrom"]
            env[entry["name"]] = "10.0.0.7" if "fieldRef" in ref else f"from-{ref['secretKeyRef']['key']}"
        else:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], entry["value"])
    return env


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    """Each scenario rendered once for the module."""
    return {name: render(*scenario(name)) for name in SCENARIOS}


def test_every_scenario_the_issue_names_is_there() -> None:
    assert set(SCENARIOS) == {
        "local-cpu",
        "gpu-collocated",
        "gpu-disaggregated",
        "multi-node-trainer",
        "existing-nats",
    }


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_scenario_lints_renders_and_validates(rendered: dict[str, list[Doc]], name: str) -> None:
    done = helm("lint", str(CHART), "--strict", *scenario(name))
    assert done.returncode == 0, done.stdout + done.stderr
    docs = rendered[name]
    validate(docs)
    assert {"Deployment", "StatefulSet", "Service", "Role", "RoleBinding", "NetworkPolicy", "Pod"} <= kinds(
        docs
    )


def test_production_values_render_and_validate() -> None:
    validate(render("-f", PRODUCTION, "--set", "trainer.run=prod"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "gateway.replicas=notanumber"), "at '/gateway/replicas': got string, want integer"),
        (("--set", "trainer.multiNode.kind=MPIJob"), "/trainer/multiNode/kind"),
        (("--set", "gateway.replica=3"), "additional properties 'replica' not allowed"),
        (("--set", "nats.external.urls[0]=nats.infra:4222"), "/nats/external/urls/0"),
        (("--set", "trainer.weightTransfer=ipc"), "/trainer/weightTransfer"),
        (("--set", "reward.image.pullPolicy=Sometimes"), "at '/reward/image/pullPolicy'"),
        (("--set", "image.pullPolicy="), "at '/image/pullPolicy'"),
        (("--set", "vllm.image.registry=r"), "additional properties 'registry' not allowed"),
    ],
)
def test_the_values_schema_refuses_bad_values(args: tuple[str, ...], message: str) -> None:
    done = template(*scenario("local-cpu"), *args)
    assert done.returncode != 0 and message in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "trainer.run is required"),
        (("--set", "trainer.run=r", "--set", "trainer.ranks=0"), "trainer.ranks must be 1 or more, not 0"),
        (("--set", "trainer.run=r", "--set", "nats.deploy=false"), "nats.external.urls is required"),
        (
            ("--set", "trainer.run=r", "--set", "nats.streamReplicas=3"),
            "nats.streamReplicas 3 needs nats.replicas",
        ),
        (
            (
                "--set",
                "trainer.run=r",
                "--set",
                "nats.deploy=false",
                "--set",
                "nats.external.urls[0]=nats://n:4222",
            ),
            "nats.auth.existingSecret is required with external NATS",
        ),
        (
            (
                "--set",
                "trainer.run=r",
                "--set",
                "trainer.multiNode.enabled=true",
                "--set-json",
                'trainer.checkpoints.accessModes=["ReadWriteOnce"]',
            ),
            "trainer.multiNode needs trainer.checkpoints.accessModes with ReadWriteMany",
        ),
        (
            ("--set", "trainer.run=r", "--set", "episodes.namespace.name=train"),
            "must differ from the release namespace",
        ),
        (("--set", "trainer.run=r", "--set", "nats.tls.enabled=true"), "nats.tls.secretName is required"),
    ],
)
def test_values_that_cannot_work_are_refused_with_a_reason(args: tuple[str, ...], message: str) -> None:
    done = template(*args)
    assert done.returncode != 0 and message in done.stderr, done.stderr


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_service_loads_its_rendered_environment_as_its_own_settings(
    rendered: dict[str, list[Doc]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What would crash a service at start (a missing run, a misspelt setting) fails here."""
    for service in SERVICES:
        container = service_pod(rendered[name], service)["containers"][0]
        for variable in [v for v in os.environ if v.startswith("HRL_")]:
            monkeypatch.delenv(variable)
        env = container_env(container)
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        settings = READERS[service]()
        own = {k for k in env if k.startswith(f"HRL_{service.upper()}_")}
        fields = {f"HRL_{service.upper()}_{f.name.upper()}" for f in msgspec.structs.fields(settings)}
        assert own <= fields, f"{service}: {sorted(own - fields)} are not settings"
        assert url_user(settings.nats_url) == service  # its own NATS user, on every server
        if service != "gateway":
            metrics = (settings.metrics_host, settings.metrics_port)  # type: ignore[attr-defined]
            assert metrics == ("0.0.0.0", 9090)  # noqa: S104 - the pod's scraper reaches it


def test_the_gateway_listens_on_every_interface_and_is_probed_on_readyz(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["local-cpu"]
    pod = service_pod(docs, "gateway")
    gateway = pod["containers"][0]
    env = container_env(gateway)
    assert (env["HRL_GATEWAY_HOST"], env["HRL_GATEWAY_PORT"]) == ("0.0.0.0", "8000")  # noqa: S104
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert pod["terminationGracePeriodSeconds"] == int(env["HRL_GATEWAY_SHUTDOWN_GRACE_S"]) + 10
    service = named(docs, "Service", f"{PREFIX}-gateway")["spec"]
    assert {p["name"]: p["targetPort"] for p in service["ports"]} == {"http": "http", "metrics": "http"}


def vllm_pins() -> str:
    lock = (ROOT / "requirements.lock").read_text()
    found = re.search(r"^vllm(?:-cpu)?==([0-9.]+)$", lock, re.MULTILINE)
    assert found, "no vllm pin in requirements.lock"
    return found.group(1)


@pytest.mark.parametrize("name", ["local-cpu", "gpu-disaggregated"])
def test_vllm_replicas_are_addressed_one_by_one(rendered: dict[str, list[Doc]], name: str) -> None:
    docs = rendered[name]
    sts = named(docs, "StatefulSet", f"{PREFIX}-vllm")
    headless = named(docs, "Service", f"{PREFIX}-vllm")["spec"]
    assert sts["spec"]["serviceName"] == f"{PREFIX}-vllm" and headless["clusterIP"] == "None"
    replicas = sts["spec"]["replicas"]
    expected = [f"http://{PREFIX}-vllm-{i}.{PREFIX}-vllm.{NS}.svc:8000" for i in range(replicas)]
    assert (
        json.loads(container_env(service_pod(docs, "gateway")["containers"][0])["HRL_GATEWAY_UPSTREAMS"])
        == expected
    )
    assert (
        json.loads(container_env(service_pod(docs, "trainer")["containers"][0])["HRL_TRAINER_REPLICAS"])
        == expected
    )
    vllm = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    model = "tiny" if name == "local-cpu" else "Qwen3-0.6B"
    assert vllm["args"][:3] == [f"--model=/models/{model}", "--served-model-name=policy", "--host=0.0.0.0"]
    assert "--logprobs-mode=processed_logprobs" in vllm["args"] and "--generation-config=vllm" in vllm["args"]
    nccl = '--weight-transfer-config={"backend":"nccl"}'
    assert (nccl in vllm["args"]) == (name == "gpu-disaggregated")
    assert (
        container_env(service_pod(docs, "gateway")["containers"][0])["HRL_GATEWAY_SERVED_MODEL"] == "policy"
    )


@pytest.mark.parametrize(("tool", "reasoning"), [("hermes", ""), ("qwen3_coder", "qwen3")])
def test_vllm_and_the_gateway_parse_sampled_text_alike(tool: str, reasoning: str) -> None:
    """One value sets vLLM's parsers and the gateway's token-in ones; the default is the project's."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["model"]["toolCallParser"] == VLLM_TOOL_CALL_PARSER == GatewaySettings().tool_parser
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["model"]["properties"]
    assert set(schema["toolCallParser"]["enum"]) == {"", *TOOL_PARSERS}
    assert set(schema["reasoningParser"]["enum"]) == {"", *REASONING_PARSERS}
    docs = render(
        *scenario("local-cpu"),
        "--set",
        f"model.toolCallParser={tool}",
        "--set",
        f"model.reasoningParser={reasoning}",
    )
    args = named(docs, "StatefulSet", f"{PREFIX}-vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = [a for a in args if "parser" in a or "auto-tool" in a]
    assert flags == ["--enable-auto-tool-choice", f"--tool-call-parser={tool}"] + (
        [f"--reasoning-parser={reasoning}"] if reasoning else []
    )
    env = container_env(service_pod(docs, "gateway")["containers"][0])
    assert (env["HRL_GATEWAY_TOOL_PARSER"], env.get("HRL_GATEWAY_REASONING_PARSER", "")) == (tool, reasoning)
    refused = template(*scenario("local-cpu"), "--set", "model.toolCallParser=pythonic")
    assert refused.returncode != 0 and "toolCallParser" in refused.stderr


def test_the_vllm_image_is_the_release_the_project_is_tested_with() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["vllm"]["image"]["tag"] == f"v{vllm_pins()}"


def test_the_cpu_scenario_runs_the_images_make_images_builds(rendered: dict[str, list[Doc]]) -> None:
    built = {spec.ref for spec in IMAGES}
    containers = [c for _, pod in pod_specs(rendered["local-cpu"]) for c in pod["containers"]]
    assert {c["image"] for c in containers} <= built
    assert {c["imagePullPolicy"] for c in containers} == {"Never"}  # podman kube play pulls nothing
    values = yaml.safe_load((CHART / "ci" / "local-cpu-values.yaml").read_text())
    patterns = values["controller"]["allowedImages"]
    for name in ("harness", "harness:demo", "task"):  # a task image is the task base's repository
        ref = IMAGE_BY_NAME[name].ref.replace(":cpu", ":some-instance" if name == "task" else ":cpu")
        assert any(fnmatch.fnmatchcase(ref, pattern) for pattern in patterns), ref


SHARED_IMAGE = ("ghcr.io/harnessrl/harnessrl:0.1.0", "IfNotPresent")  # values.yaml's `image`


def images_by_pod(*args: str) -> dict[str, list[tuple[str, str]]]:
    """Every pod's (image, pull policy) per container, of the default values with a trainer run."""
    docs = render("--set", "trainer.run=r", *args)
    return {
        where: [(c["image"], c["imagePullPolicy"]) for c in pod["containers"]]
        for where, pod in pod_specs(docs)
    }


def test_the_cpu_scenario_runs_only_images_make_images_builds(rendered: dict[str, list[Doc]]) -> None:
    """`make cluster-check` runs local-cpu as rendered: each container's image is one built here."""
    built = {image.ref for image in IMAGE_BY_NAME.values()}
    named_images = {c["image"] for _, pod in pod_specs(rendered["local-cpu"]) for c in pod["containers"]}
    assert named_images and named_images <= built, named_images - built


def test_ci_runs_the_cluster_check_after_the_suite() -> None:
    """README: CI runs `make cluster-check` after `make test`, on a machine it sets up itself."""
    root = Path(__file__).resolve().parents[1]
    timed = [line.split()[-2:] for line in (root / ".ci/run").read_text().splitlines()]
    steps = [" ".join(words) for words in timed if words and words[0] == "make"]
    assert steps == ["make dev", "make test", "make cluster-check"]
    images_sh = (root / "scripts/images.sh").read_text()
    assert "apt-get install -y -qq" in images_sh and "podman" in images_sh and "mmdebstrap" in images_sh


def test_services_default_to_the_shared_image() -> None:
    pods = images_by_pod()
    for service in SERVICES:
        assert pods[f"Deployment/{PREFIX}-{service}"] == [SHARED_IMAGE], service
    assert pods[f"StatefulSet/{PREFIX}-vllm"] == [("vllm/vllm-openai:v0.31.0", "IfNotPresent")]
    assert pods[f"StatefulSet/{PREFIX}-nats"] == [("nats:2.12.3-alpine", "IfNotPresent")]


@pytest.mark.parametrize("component", [*SERVICES, "vllm", "nats"])
def test_a_components_own_image_lands_in_exactly_its_workload(component: str) -> None:
    """`<component>.image` changes its pods and no other (the helm test pod runs the gateway's image)."""
    before = images_by_pod()
    own = ("registry.example/own:1.2", "Always")
    after = images_by_pod(
        "--set", f"{component}.image.repository=registry.example/own", "--set", f"{component}.image.tag=1.2",
        "--set", f"{component}.image.pullPolicy=Always",
    )  # fmt: skip
    changed = {where for where in before if before[where] != after[where]}
    kind = "StatefulSet" if component in ("vllm", "nats") else "Deployment"
    expected = {f"{kind}/{PREFIX}-{component}"}
    if component == "gateway":
        expected |= {where for where in before if where.startswith("Pod/")}
    assert changed == expected
    assert all(after[where] == [own] for where in expected)


def test_a_services_pull_policy_alone_keeps_the_shared_image() -> None:
    pods = images_by_pod("--set", "reward.image.pullPolicy=Never")
    assert pods[f"Deployment/{PREFIX}-reward"] == [(SHARED_IMAGE[0], "Never")]
    assert pods[f"Deployment/{PREFIX}-controller"] == [SHARED_IMAGE]


def containerfile_targets(path: Path) -> dict[str, dict[str, str]]:
    """Each `FROM ... AS <stage>` of a Containerfile -> its CMD and EXPOSE lines."""
    stages: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in path.read_text().splitlines():
        words = line.split(maxsplit=1)
        if words and words[0] == "FROM":
            current = stages.setdefault(line.split()[-1], {})
        elif words and words[0] in ("CMD", "EXPOSE"):
            current[words[0]] = words[1]
    return stages


def test_every_service_image_is_a_target_of_the_one_service_containerfile(
    rendered: dict[str, list[Doc]],
) -> None:
    """The four service images: one Containerfile, a target each, running what the chart runs."""
    specs = {spec.name: spec for spec in IMAGES if spec.name in SERVICES}
    assert set(specs) == set(SERVICES)
    assert {spec.containerfile for spec in specs.values()} == {"services/Containerfile"}
    targets = containerfile_targets(ROOT / "services" / "Containerfile")
    docs = rendered["local-cpu"]
    for service, spec in specs.items():
        assert spec.target == service and spec.ref == f"localhost/harnessrl-{service}:cpu"
        container = service_pod(docs, service)["containers"][0]
        assert json.loads(targets[service]["CMD"]) == container["command"]
        assert int(targets[service]["EXPOSE"]) == container["ports"][0]["containerPort"]
    assert not list(ROOT.glob("services/*/Containerfile"))


def test_the_cpu_scenario_runs_vllm_eagerly(rendered: dict[str, list[Doc]]) -> None:
    """vLLM-CPU's torch.compile needs a C++ compiler the image lacks: TorchDynamo is off there only."""
    for name in SCENARIOS:
        vllm = named(rendered[name], "StatefulSet", f"{PREFIX}-vllm")["spec"]["template"]["spec"]
        env = container_env(vllm["containers"][0])
        assert env.get("TORCHDYNAMO_DISABLE") == ("1" if name == "local-cpu" else None), name


def volumes(pod: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in pod["volumes"]}


def mounts(container: Doc) -> dict[str, Doc]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def test_the_trainer_has_its_model_checkpoints_and_shared_memory(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["local-cpu"]
    pod = service_pod(docs, "trainer")
    trainer = pod["containers"][0]
    env = container_env(trainer)
    assert (env["HRL_TRAINER_RUN"], env["HRL_TRAINER_MODEL_DIR"]) == ("demo", "/models/tiny")
    assert env["HRL_TRAINER_CHECKPOINT_DIR"] == "/checkpoints"
    claim = volumes(pod)["checkpoints"]["persistentVolumeClaim"]["claimName"]
    assert (
        named(docs, "PersistentVolumeClaim", claim)["metadata"]["annotations"]["helm.sh/resource-policy"]
        == "keep"
    )
    assert (
        "readOnly" not in mounts(trainer)["/checkpoints"] and mounts(trainer)["/models"]["readOnly"] is True
    )
    assert volumes(pod)["shm"]["emptyDir"]["medium"] == "Memory" and "/dev/shm" in mounts(trainer)
    vllm_pod = named(docs, "StatefulSet", f"{PREFIX}-vllm")["spec"]["template"]["spec"]
    # Weights by reload: each replica reads the trainer's step files, at the same path.
    assert volumes(vllm_pod)["checkpoints"]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
    assert mounts(vllm_pod["containers"][0])["/checkpoints"]["readOnly"] is True
    assert volumes(vllm_pod)["shm"]["emptyDir"]["medium"] == "Memory"


def test_a_deployed_trainer_stays_up_at_max_steps_and_a_job_trainer_exits(
    rendered: dict[str, list[Doc]],
) -> None:
    """A Deployment restarts a process that exits; a JobSet's pods are meant to complete."""
    deployed = container_env(service_pod(rendered["local-cpu"], "trainer")["containers"][0])
    assert deployed["HRL_TRAINER_MAX_STEPS"] == "2" and deployed["HRL_TRAINER_EXIT_AT_MAX_STEPS"] == "false"
    jobset = named(rendered["multi-node-trainer"], "JobSet", f"{PREFIX}-trainer")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "HRL_TRAINER_EXIT_AT_MAX_STEPS" not in container_env(pod["containers"][0])


def test_nccl_weight_transfer_gives_the_trainer_its_pod_address(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["gpu-disaggregated"]
    trainer = service_pod(docs, "trainer")["containers"][0]
    address = next(e for e in trainer["env"] if e["name"] == "HRL_TRAINER_NCCL_MASTER_ADDRESS")
    assert address["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {"name": "nccl", "containerPort": 29600} in trainer["ports"]
    vllm_pod = named(docs, "StatefulSet", f"{PREFIX}-vllm")["spec"]["template"]["spec"]
    assert "checkpoints" not in volumes(vllm_pod)  # nothing goes through the disk


@pytest.mark.parametrize("name", ["gpu-collocated", "gpu-disaggregated", "multi-node-trainer"])
def test_gpu_workloads_are_placed_on_gpu_nodes(rendered: dict[str, list[Doc]], name: str) -> None:
    docs = rendered[name]
    values = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())
    for component in ("trainer", "vllm"):
        pod = service_pod(docs, component)
        resources = pod["containers"][0]["resources"]
        assert (
            resources["limits"]["nvidia.com/gpu"]
            == values[component]["resources"]["limits"]["nvidia.com/gpu"]
        )
        assert pod["tolerations"] == values[component]["tolerations"]
        for key in ("nodeSelector", "affinity"):
            assert pod.get(key) == values[component].get(key), f"{component} {key}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_container_runs_read_only_as_non_root_with_a_writable_tmp(
    rendered: dict[str, list[Doc]], name: str
) -> None:
    for where, pod in pod_specs(rendered[name]):
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["automountServiceAccountToken"] is (where == f"Deployment/{PREFIX}-controller" or (
            where == f"Deployment/{PREFIX}-reward")), where  # fmt: skip
        for container in pod["containers"]:
            context = container["securityContext"]
            assert (
                context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
            ), where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            if where.endswith("-test") or container["name"] == "nats":
                continue  # the test's check writes nothing; NATS writes only to its data volume
            tmp = mounts(container)["/tmp"]
            assert volumes(pod)[tmp["name"]] == {"name": tmp["name"], "emptyDir": {}}, where


def test_pull_secrets_reach_every_pod(rendered: dict[str, list[Doc]]) -> None:
    for name in ("local-cpu", "multi-node-trainer"):
        docs = render(*scenario(name), "--set", "imagePullSecrets[0].name=regcred")
        pods = list(pod_specs(docs))
        assert len(pods) >= 7
        for where, pod in pods:
            assert pod["imagePullSecrets"] == [{"name": "regcred"}], where
    for name in ("local-cpu", "existing-nats"):
        for where, pod in pod_specs(rendered[name]):
            assert "imagePullSecrets" not in pod, where


def test_services_are_probed_and_scraped(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["local-cpu"]
    for service in SERVICES:
        doc = named(docs, "Deployment", f"{PREFIX}-{service}")
        pod = doc["spec"]["template"]
        container = pod["spec"]["containers"][0]
        assert container["livenessProbe"]["httpGet"]["path"] in ("/healthz", "/metrics"), service
        annotations = pod["metadata"]["annotations"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        port = ports.get("metrics", ports.get("http"))
        assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == ("true", str(port))
        metrics_service = [
            d for d in docs
            if d["kind"] == "Service" and d["metadata"]["labels"].get("harnessrl.io/metrics")
            and d["metadata"]["labels"]["app.kubernetes.io/component"] == service
        ]  # fmt: skip
        assert any(p["name"] == "metrics" for p in metrics_service[0]["spec"]["ports"]), service
    vllm = named(docs, "StatefulSet", f"{PREFIX}-vllm")["spec"]["template"]["spec"]["containers"][0]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(vllm)


def test_the_service_monitor_selects_every_metrics_service(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["gpu-disaggregated"]
    monitor = named(docs, "ServiceMonitor", PREFIX)["spec"]
    assert monitor["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert named(docs, "ServiceMonitor", PREFIX)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selected = [
        d for d in docs
        if d["kind"] == "Service"
        and monitor["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()
    ]  # fmt: skip
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in selected} == {*SERVICES, "vllm"}
    assert not any(d["kind"] == "ServiceMonitor" for d in rendered["local-cpu"])


def test_gateway_autoscaling_and_disruption_budgets(rendered: dict[str, list[Doc]]) -> None:
    scaled = rendered["gpu-disaggregated"]
    hpa = named(scaled, "HorizontalPodAutoscaler", f"{PREFIX}-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{PREFIX}-gateway",
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 10)
    assert "replicas" not in named(scaled, "Deployment", f"{PREFIX}-gateway")["spec"]  # the HPA owns it
    budgets = {d["metadata"]["name"]: d["spec"] for d in scaled if d["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {f"{PREFIX}-{c}" for c in ("gateway", "controller", "reward", "vllm")}
    assert all(b["maxUnavailable"] == 1 for b in budgets.values())
    local = rendered["local-cpu"]
    assert not any(d["kind"] == "HorizontalPodAutoscaler" for d in local)
    # A budget over one pod would block every drain: none for the one controller, reward or vLLM.
    assert {d["metadata"]["name"] for d in local if d["kind"] == "PodDisruptionBudget"} == {
        f"{PREFIX}-gateway"
    }


def checksums(docs: list[Doc]) -> dict[str, str]:
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"
        ]
        for d in docs
        if d["kind"] in WORKLOADS
    }


def test_a_changed_setting_restarts_only_the_pods_it_configures() -> None:
    before = checksums(render(*scenario("existing-nats")))
    assert before == checksums(render(*scenario("existing-nats")))
    after = checksums(
        render(*scenario("existing-nats"), "--set", "gateway.settings.max_in_flight_per_upstream=64")
    )
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {f"Deployment/{PREFIX}-gateway"}
    scaled = checksums(render(*scenario("existing-nats"), "--set", "vllm.replicas=3"))
    # New replicas are new addresses for the gateway and the trainer's weight sync.
    assert {n for n in before if before[n] != scaled[n]} >= {
        f"Deployment/{PREFIX}-gateway",
        f"Deployment/{PREFIX}-trainer",
    }


def test_with_existing_secrets_every_render_is_the_same() -> None:
    """GitOps: `helm template` twice gives the same bytes, so nothing is re-applied or restarted."""
    first, second = template(*scenario("existing-nats")), template(*scenario("existing-nats"))
    assert first.returncode == 0 and first.stdout == second.stdout
    docs = [d for d in yaml.safe_load_all(first.stdout) if d]
    assert not any(d["kind"] == "Secret" for d in docs)
    for service in ("gateway", "controller"):
        container = service_pod(docs, service)["containers"][0]
        key = next(e for e in container["env"] if e["name"] == f"HRL_{service.upper()}_KEY_SECRET")
        assert key["valueFrom"]["secretKeyRef"] == {"name": "harnessrl-episode-key", "key": "secret"}
    for service in ("reward", "trainer"):  # the signing key reaches the gateway and controller only
        names = {e["name"] for e in service_pod(docs, service)["containers"][0]["env"]}
        assert not any("KEY_SECRET" in n for n in names), service


def test_generated_secrets_are_kept_and_never_in_a_config_map(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["local-cpu"]
    for name in (f"{PREFIX}-episode-key", f"{PREFIX}-nats-auth"):
        secret = named(docs, "Secret", name)
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    passwords = named(docs, "Secret", f"{PREFIX}-nats-auth")["data"]
    assert set(passwords) == set(PERMISSIONS)
    config = json.dumps([d for d in docs if d["kind"] == "ConfigMap"])
    for value in passwords.values():
        assert base64.b64decode(value).decode() not in config


def test_extra_environment_comes_from_secrets(rendered: dict[str, list[Doc]]) -> None:
    gateway = service_pod(rendered["existing-nats"], "gateway")["containers"][0]
    token = next(e for e in gateway["env"] if e["name"] == "HRL_GATEWAY_ADMIN_TOKEN")
    assert token == {
        "name": "HRL_GATEWAY_ADMIN_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "harnessrl-gateway-admin", "key": "token"}},
    }


def test_existing_nats_is_used_as_given_with_each_services_login(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["existing-nats"]
    assert not any(d["metadata"]["name"].startswith(f"{PREFIX}-nats") for d in docs if d["kind"] != "Secret")
    for service in SERVICES:
        container = service_pod(docs, service)["containers"][0]
        env = container_env(container)
        servers = env[f"HRL_{service.upper()}_NATS_URL"].split(",")
        assert servers == [f"tls://{service}:from-{service}@nats-{i}.nats.infra.svc:4222" for i in range(3)]
        assert env["HRL_NATS_REPLICAS"] == "3" and env["SSL_CERT_FILE"] == "/etc/harnessrl/nats-ca/ca.crt"
        assert mounts(container)["/etc/harnessrl/nats-ca"]["readOnly"] is True


# --- NATS: users, permissions, TLS, the policy in front of it ---------------------------------


def nats_config(docs: list[Doc]) -> dict[str, str]:
    data: dict[str, str] = named(docs, "ConfigMap", f"{PREFIX}-nats")["data"]
    return data


def rendered_users(authorization: str) -> dict[str, Any]:
    """The users of the rendered `authorization.conf`, its `$NATS_PASSWORD_*` variables as strings."""
    body = authorization.strip().removeprefix("authorization:")
    users = json.loads(re.sub(r"\$(NATS_PASSWORD_\w+)", r'"\1"', body))["users"]
    return {user.pop("user"): user for user in users}


def test_the_rendered_nats_users_are_the_shared_permission_definition(rendered: dict[str, list[Doc]]) -> None:
    expected = {
        user: {
            "publish": {"allow": list(grants.publish)},
            "subscribe": {"allow": list(grants.subscribe)},
            **({"allow_responses": True} if grants.allow_responses else {}),
        }
        for user, grants in PERMISSIONS.items()
    }
    chart_copy = json.loads((CHART / "files" / "nats-permissions.json").read_text())
    regenerate = json.dumps({u: msgspec.to_builtins(p) for u, p in PERMISSIONS.items()}, indent=2)
    assert chart_copy == json.loads(msgspec.json.encode(PERMISSIONS)), (
        "charts/harnessrl/files/nats-permissions.json is not harnessrl.shared.nats_permissions;"
        f" write:\n{regenerate}"
    )
    users = rendered_users(nats_config(rendered["local-cpu"])["authorization.conf"])
    assert {u: v["permissions"] for u, v in users.items()} == expected
    assert {u: v["password"] for u, v in users.items()} == {
        u: f"NATS_PASSWORD_{u.upper()}" for u in PERMISSIONS
    }
    assert "include ./authorization.conf" in nats_config(rendered["local-cpu"])["nats.conf"]


def nats_login(port: int, user: str, password: str, subjects: list[str]) -> list[str]:
    """Log in over the raw protocol (verbose) and publish to each subject: the server's answer to each."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        reader = conn.makefile("rb")

        def answer() -> str:  # the server's next answer (an updated INFO is news, not an answer)
            line = reader.readline().decode().strip()
            return answer() if line.startswith("INFO ") else line

        assert reader.readline().startswith(b"INFO ")
        connect = {"user": user, "pass": password, "verbose": True, "pedantic": False, "protocol": 1}
        conn.sendall(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        login = answer()
        if login != "+OK":
            return [login]
        assert answer() == "PONG"
        answers = []
        for subject in subjects:
            conn.sendall(f"PUB {subject} 0\r\n\r\nPING\r\n".encode())
            answers.append(answer())
            assert answer() == "PONG"
        return answers


@pytest.fixture
def chart_nats(tmp_path: Path, rendered: dict[str, list[Doc]]) -> Iterator[int]:
    """A real nats-server started from the chart's rendered configuration (ports and paths local)."""
    config = nats_config(rendered["local-cpu"])
    port, monitor = free_port(), free_port()
    conf = (
        config["nats.conf"]
        .replace("port: 4222", f"port: {port}")
        .replace("http_port: 8222", f"http_port: {monitor}")
    )
    (tmp_path / "nats.conf").write_text(conf.replace("store_dir: /data", f"store_dir: {tmp_path / 'data'}"))
    (tmp_path / "authorization.conf").write_text(config["authorization.conf"])
    env = {**os.environ, **{f"NATS_PASSWORD_{u.upper()}": f"pw-{u}" for u in PERMISSIONS}}
    log = (tmp_path / "nats.log").open("wb")
    argv = [nats_server_binary(), "--config", str(tmp_path / "nats.conf"), "-a", "127.0.0.1"]
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "nats.log"
                ).read_text()
                time.sleep(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(10)
        log.close()


def test_a_real_nats_server_enforces_the_rendered_users(chart_nats: int) -> None:
    scored, submit = "hrl.episode.r1.e1.scored", "hrl.ctl.controller.submit"
    denied = "-ERR 'Permissions Violation for Publish to \"{}\"'"
    assert nats_login(chart_nats, "trainer", "pw-trainer", [scored, "hrl.weights.r1"]) == [
        denied.format(scored),
        "+OK",
    ]
    assert nats_login(chart_nats, "reward", "pw-reward", [scored, submit]) == ["+OK", denied.format(submit)]
    assert nats_login(chart_nats, "gateway", "pw-gateway", [submit, "hrl.span.r1.e1"]) == [
        denied.format(submit),
        "+OK",
    ]
    assert nats_login(chart_nats, "admin", "pw-admin", [submit]) == ["+OK"]
    assert nats_login(chart_nats, "trainer", "pw-reward", []) == ["-ERR 'Authorization Violation'"]


def test_nats_tls_is_served_and_trusted(rendered: dict[str, list[Doc]]) -> None:
    docs = render(
        *scenario("local-cpu"), "--set", "nats.tls.enabled=true", "--set", "nats.tls.secretName=nats-tls"
    )
    validate(docs)
    conf = nats_config(docs)["nats.conf"]
    assert "cert_file: /etc/nats/tls/tls.crt" in conf and "ca_file: /etc/nats/tls/ca.crt" in conf
    nats = named(docs, "StatefulSet", f"{PREFIX}-nats")["spec"]["template"]["spec"]
    assert volumes(nats)["tls"]["secret"]["secretName"] == "nats-tls"
    for service in SERVICES:
        env = container_env(service_pod(docs, service)["containers"][0])
        assert env[f"HRL_{service.upper()}_NATS_URL"].startswith(f"tls://{service}:")
        assert env["SSL_CERT_FILE"] == "/etc/harnessrl/nats-ca/ca.crt"


def test_only_the_services_reach_nats(rendered: dict[str, list[Doc]]) -> None:
    policy = named(rendered["local-cpu"], "NetworkPolicy", f"{PREFIX}-nats")["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "nats"
    clients, peers = policy["ingress"]
    assert [p["port"] for p in clients["ports"]] == [4222] and "namespaceSelector" not in clients["from"][0]
    expressions = {e["key"]: e["values"] for e in clients["from"][0]["podSelector"]["matchExpressions"]}
    assert expressions == {
        "app.kubernetes.io/instance": ["hrl"],
        "app.kubernetes.io/component": [*SERVICES, "test"],
    }
    assert peers["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "nats"


def test_only_the_gateway_and_the_trainer_reach_vllms_admin_routes(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["local-cpu"]
    policy = named(docs, "NetworkPolicy", f"{PREFIX}-vllm")["spec"]
    vllm_labels = named(docs, "StatefulSet", f"{PREFIX}-vllm")["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["podSelector"], vllm_labels)
    (rule,) = policy["ingress"]
    expressions = {e["key"]: e["values"] for e in rule["from"][0]["podSelector"]["matchExpressions"]}
    assert expressions["app.kubernetes.io/component"] == ["gateway", "trainer"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    # NCCL: the trainer's transfer connects on ports NCCL picks.
    nccl = named(rendered["gpu-disaggregated"], "NetworkPolicy", f"{PREFIX}-vllm")["spec"]["ingress"]
    assert nccl[1] == {"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "harnessrl", "app.kubernetes.io/instance": "hrl",
        "app.kubernetes.io/component": "trainer"}}}]}  # fmt: skip


def test_production_runs_a_three_server_cluster_with_r3_streams() -> None:
    docs = render("-f", PRODUCTION, "--set", "trainer.run=prod")
    nats = named(docs, "StatefulSet", f"{PREFIX}-nats")["spec"]
    assert nats["replicas"] == 3 and nats["podManagementPolicy"] == "Parallel"
    assert named(docs, "Service", f"{PREFIX}-nats-cluster")["spec"]["clusterIP"] == "None"
    assert named(docs, "PodDisruptionBudget", f"{PREFIX}-nats")["spec"]["maxUnavailable"] == 1
    conf = nats_config(docs)["nats.conf"]
    for i in range(3):
        assert f"nats://{PREFIX}-nats-{i}.{PREFIX}-nats-cluster:6222" in conf
    assert nats["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "200Gi"
    for service in SERVICES:
        assert container_env(service_pod(docs, service)["containers"][0])["HRL_NATS_REPLICAS"] == "3"


def test_one_server_keeps_one_copy(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["local-cpu"]
    assert "cluster {" not in nats_config(docs)["nats.conf"]
    for service in SERVICES:
        assert "HRL_NATS_REPLICAS" not in container_env(service_pod(docs, service)["containers"][0])


# --- episodes and gradings: their namespace, policies and RBAC -------------------------------


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    return bool(selector.get("matchLabels")) and selector["matchLabels"].items() <= labels.items()


def real_pods(namespace: str) -> tuple[Doc, Doc]:
    """An episode Job as the controller renders it and a grading Job as the reward service does."""
    spec = LauncherSpec(
        kind="kubernetes", image="ghcr.io/acme/harness:1", namespace=namespace, command=["mini"]
    )
    episode = render_job(launch_request("e0001-002-03-a1", ["mini", "-y"]), spec, ttl_s=60)
    instance = SweInstance(instance_id="calc-1", base_commit="0" * 40, test_patch="",
                           fail_to_pass=[], pass_to_pass=[],
                           image="ghcr.io/acme/task:1")  # fmt: skip
    grading = grading_job("grade-calc-1", namespace, instance)
    return episode["spec"]["template"], grading["spec"]["template"]


def test_episodes_and_gradings_run_restricted_in_their_own_namespace(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["local-cpu"]
    namespace = named(docs, "Namespace", f"{NS}-episodes")["metadata"]["labels"]
    assert {namespace[f"pod-security.kubernetes.io/{mode}"] for mode in ("enforce", "audit", "warn")} == {
        "restricted"
    }
    policies = {
        d["metadata"]["name"]: d
        for d in docs
        if d["kind"] == "NetworkPolicy" and d["metadata"].get("namespace") == f"{NS}-episodes"
    }
    deny = policies[f"{PREFIX}-default-deny"]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    episode_policy, grading_policy = (
        policies[f"{PREFIX}-episodes"]["spec"],
        policies[f"{PREFIX}-grading"]["spec"],
    )
    episode, grading = real_pods(f"{NS}-episodes")
    assert selects(episode_policy["podSelector"], episode["metadata"]["labels"])
    assert not selects(episode_policy["podSelector"], grading["metadata"]["labels"])
    assert selects(grading_policy["podSelector"], grading["metadata"]["labels"])
    assert not selects(grading_policy["podSelector"], episode["metadata"]["labels"])
    assert (
        grading_policy["egress"] == []
        and grading_policy["ingress"] == []
        and set(grading_policy["policyTypes"]) == {"Ingress", "Egress"}
    )
    gateway_rule, dns_rule = episode_policy["egress"]
    gateway_labels = named(docs, "Deployment", f"{PREFIX}-gateway")["spec"]["template"]["metadata"]["labels"]
    assert selects(gateway_rule["to"][0]["podSelector"], gateway_labels)
    assert gateway_rule["to"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NS}
    assert gateway_rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert {p["port"] for p in dns_rule["ports"]} == {53}
    for pod in (episode, grading):  # what Pod Security `restricted` admits
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["seccompProfile"] == {
            "type": "RuntimeDefault"
        }
        for container in (*spec.get("initContainers", []), *spec["containers"]):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {
                "drop": ["ALL"]
            }


def rules(role: Doc) -> dict[tuple[str, str], set[str]]:
    return {
        (group, resource): set(r["verbs"])
        for r in role["rules"]
        for group in r["apiGroups"]
        for resource in r["resources"]
    }


def test_the_controller_and_the_reward_service_may_act_only_in_the_episode_namespace(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["local-cpu"]
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    assert all(r["kind"] == "Role" and r["metadata"]["namespace"] == f"{NS}-episodes" for r in roles.values())
    controller = rules(roles[f"{PREFIX}-controller"])
    assert controller[("batch", "jobs")] >= {"create", "get", "list", "watch", "delete"}
    assert controller[("", "pods")] == {"get", "list", "watch"} and controller[("", "secrets")] >= {
        "create",
        "patch",
    }
    # What KubernetesGrader calls: ConfigMap create/delete, Job create/watch/delete, pod list and log.
    assert rules(roles[f"{PREFIX}-reward"]) == {
        ("batch", "jobs"): {"create", "get", "list", "watch", "delete"},
        ("", "configmaps"): {"create", "delete"},
        ("", "pods"): {"get", "list"},
        ("", "pods/log"): {"get"},
    }
    for service in ("controller", "reward"):
        binding = named(docs, "RoleBinding", f"{PREFIX}-{service}")
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": f"{PREFIX}-{service}", "namespace": NS}
        ]
        assert service_pod(docs, service)["serviceAccountName"] == f"{PREFIX}-{service}"
    env = container_env(service_pod(docs, "reward")["containers"][0])
    assert (env["HRL_REWARD_SANDBOX"], env["HRL_REWARD_NAMESPACE"]) == ("kubernetes", f"{NS}-episodes")
    controller_env = container_env(service_pod(docs, "controller")["containers"][0])
    assert controller_env["HRL_CONTROLLER_IN_CLUSTER"] == "true"
    assert json.loads(controller_env["HRL_CONTROLLER_ALLOWED_IMAGES"]) == [
        "localhost/harnessrl-harness:*",
        "localhost/harnessrl-task:*",
    ]
    local = render(*scenario("local-cpu"), "--set", "reward.sandbox=local")
    assert service_pod(local, "reward")["automountServiceAccountToken"] is False
    assert not any(d["kind"] == "Role" and d["metadata"]["name"] == f"{PREFIX}-reward" for d in local)


# --- the trainer across nodes -----------------------------------------------------------------


def test_one_pod_several_ranks_run_under_torchrun_and_are_otherwise_the_same() -> None:
    single = service_pod(render(*scenario("local-cpu")), "trainer")["containers"][0]
    assert single["command"] == ["python", "-m", "harnessrl.trainer"]
    several = service_pod(render(*scenario("local-cpu"), "--set", "trainer.ranks=2"), "trainer")[
        "containers"
    ][0]
    assert several.pop("command") == [
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "harnessrl.trainer",
    ]  # fmt: skip
    single.pop("command")
    assert several == single


def test_multi_node_training_is_a_jobset_of_torchrun_pods(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["multi-node-trainer"]
    jobset = named(docs, "JobSet", f"{PREFIX}-trainer")
    assert crds.validate(jobset) == []
    assert not any(d["kind"] == "Deployment" and d["metadata"]["name"] == f"{PREFIX}-trainer" for d in docs)
    (job,) = jobset["spec"]["replicatedJobs"]
    assert (
        job["replicas"],
        job["template"]["spec"]["completions"],
        job["template"]["spec"]["parallelism"],
    ) == (1, 4, 4)
    assert (
        job["template"]["spec"]["completionMode"] == "Indexed"
        and jobset["spec"]["network"]["enableDNSHostnames"]
    )
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    # Pod 0 of the JobSet is <jobset>-<job>-0-0 under the JobSet's own subdomain.
    master = f"{PREFIX}-trainer-{job['name']}-0-0.{PREFIX}-trainer"
    assert pod["containers"][0]["command"] == [
        "python", "-m", "torch.distributed.run", "--nnodes=4", "--nproc-per-node=8",
        "--node-rank=$(JOB_COMPLETION_INDEX)", f"--master-addr={master}", "--master-port=29500",
        "-m", "harnessrl.trainer",
    ]  # fmt: skip
    assert pod["volumes"][3]["persistentVolumeClaim"]["claimName"] == f"{PREFIX}-checkpoints"
    claim = named(docs, "PersistentVolumeClaim", f"{PREFIX}-checkpoints")["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"]


def test_multi_node_training_as_a_pytorchjob() -> None:
    docs = render(*scenario("multi-node-trainer"), "--set", "trainer.multiNode.kind=PyTorchJob")
    validate(docs)
    job = named(docs, "PyTorchJob", f"{PREFIX}-trainer")
    assert crds.validate(job) == []
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    assert job["spec"]["nprocPerNode"] == "8"
    for role in ("Master", "Worker"):
        container = replicas[role]["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the operator's training container
        assert (
            "--node-rank=$(RANK)" in container["command"]
            and "--master-addr=$(MASTER_ADDR)" in container["command"]
        )
        assert {"name": "pytorchjob-port", "containerPort": 29500} in container["ports"]


def test_the_crd_check_catches_what_an_api_server_would_refuse(rendered: dict[str, list[Doc]]) -> None:
    jobset = json.loads(json.dumps(named(rendered["multi-node-trainer"], "JobSet", f"{PREFIX}-trainer")))
    jobset["spec"]["replicatedJobs"][0]["replicas"] = "one"
    jobset["spec"]["failurePolicy"]["maxRestart"] = 3
    errors = crds.validate(jobset)
    assert any("replicatedJobs.0.replicas" in e for e in errors)
    assert ".spec.failurePolicy.maxRestart: unknown field" in errors
    source = crds.fixture("jobset.x-k8s.io/v1alpha2", "JobSet")["source"]
    assert source["repository"] == "https://github.com/kubernetes-sigs/jobset" and len(source["commit"]) == 40


# --- install-time extras: the helm test, NOTES, the dashboard ---------------------------------


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"ready": true}' if self.path == "/readyz" else b""
        self.send_response(200 if body else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return


def test_the_helm_test_checks_the_gateway_and_nats(
    rendered: dict[str, list[Doc]], nats_server: NatsServer
) -> None:
    pod = named(rendered["local-cpu"], "Pod", f"{PREFIX}-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "test"  # admitted by the NATS policy
    (container,) = pod["spec"]["containers"]
    script = container["args"][0]
    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    try:
        local = script.replace(
            f"http://{PREFIX}-gateway.{NS}.svc:8000", f"http://127.0.0.1:{gateway.server_port}"
        )
        local = local.replace(f"nats://{PREFIX}-nats.{NS}.svc:4222", nats_server.url)
        assert local != script
        done = subprocess.run(
            [sys.executable, "-c", local], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0 and "jetstream" in done.stdout, done.stdout + done.stderr
        refused = local.replace(nats_server.url, f"nats://127.0.0.1:{gateway.server_port}")  # HTTP, not NATS
        done = subprocess.run(
            [sys.executable, "-c", refused], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode != 0 and "no NATS INFO" in done.stderr
    finally:
        gateway.shutdown()


def test_the_install_notes_tell_how_to_check_and_submit() -> None:
    done = helm("install", "hrl", str(CHART), "--namespace", NS, "--dry-run=client", *scenario("local-cpu"))
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "helm test hrl -n train" in notes and f'namespace = "{NS}-episodes"' in notes
    assert "harnessrl run submit run.toml --nats" in notes and "admin" in notes

"""The chart's rendered workloads run in real containers on this machine (`make cluster-check`).

`render()` runs the real `helm template`; `LocalCluster` starts every Deployment and StatefulSet
replica as podman containers (`pods.run_args`: the pod spec's image, command, env, volumes,
security context and limits), on a podman network. A ClusterIP Service is a proxy container
(`service_proxy.py`, the stand-in for kube-proxy) that holds the Service's DNS names (`<svc>`,
`<svc>.<ns>.svc`, ...) and sends each new connection to one of its pods drawn at random; a headless Service's
names (and `<pod>.<svc>...` for StatefulSet pods) are network aliases of the pods themselves, as
cluster DNS answers them. Episode pods get a second network that only the gateway Service's proxy
joins, both networks `--internal` (no route out, none to the other network), standing in for the
episode NetworkPolicy. A pod is ready when its readiness probe (else its liveness probe) passes
from this machine against the pod's address.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harnessrl.testkit import pods
from harnessrl.testkit.images import PODMAN_FLAGS, base_ref
from harnessrl.testkit.tools import HELM

ROOT = Path(__file__).resolve().parents[4]
CHART = ROOT / "charts" / "harnessrl"
LOCAL_CPU_VALUES = CHART / "ci" / "local-cpu-values.yaml"
RELEASE = "hrl"
NAMESPACE = "default"
# A pod restarted more often than this while waiting for readiness counts as crash-looping.
MAX_RESTARTS = 3
CLUSTER_NET = "hrl-cluster"
EPISODE_NET = "hrl-episodes"
COMPONENT = "app.kubernetes.io/component"
PROXY_SCRIPT = Path(__file__).with_name("service_proxy.py")
# The test kit's own throwaway containers (the Service proxies, the connect probe): non-root, no
# capabilities, a read-only root, no privilege escalation.
HARDENED = ("--user", "65532:65532", "--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges")  # fmt: skip


class ClusterError(RuntimeError):
    """The rendered chart could not be run, or a pod never became ready."""


def render(values: Sequence[Path] = (LOCAL_CPU_VALUES,), sets: Sequence[str] = ()) -> list[dict[str, Any]]:
    """`helm template` of the chart, every document parsed."""
    command = [str(HELM), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for path in values:
        command += ["-f", str(path)]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ClusterError(f"helm template failed: {done.stderr.strip()}")
    return [d for d in yaml.safe_load_all(done.stdout) if isinstance(d, dict)]


@dataclass(frozen=True)
class Workload:
    """A Deployment or StatefulSet of the rendered chart."""

    kind: str
    name: str
    replicas: int
    template: dict[str, Any]
    service_name: str = ""
    claim_templates: tuple[str, ...] = ()

    @property
    def component(self) -> str:
        """The `app.kubernetes.io/component` label of its pods."""
        return str(self.template["metadata"]["labels"].get(COMPONENT, self.name))

    def pod_names(self) -> list[str]:
        """Pod names as Kubernetes gives them (ordinals for StatefulSets)."""
        if self.kind == "StatefulSet":
            return [f"{self.name}-{i}" for i in range(self.replicas)]
        return [f"{self.name}-{i}" for i in range(self.replicas)]


def workloads(objects: Sequence[Mapping[str, Any]]) -> list[Workload]:
    """The Deployments and StatefulSets, in document order."""
    found = []
    for obj in objects:
        if obj.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        spec = obj["spec"]
        claims = tuple(t["metadata"]["name"] for t in spec.get("volumeClaimTemplates") or [])
        found.append(
            Workload(
                obj["kind"],
                obj["metadata"]["name"],
                int(spec.get("replicas", 1)),
                spec["template"],
                str(spec.get("serviceName", "")),
                claims,
            )
        )
    return found


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a non-empty equality selector (a Service's, a policy's matchLabels) picks these labels."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def services_of(objects: Sequence[Mapping[str, Any]], labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """The Services whose selector picks pods with these labels."""
    return [
        dict(obj)
        for obj in objects
        if obj.get("kind") == "Service" and _selects(obj["spec"].get("selector") or {}, labels)
    ]


def headless(service: Mapping[str, Any]) -> bool:
    """Whether cluster DNS answers the Service with its pods' own addresses."""
    return bool(service["spec"].get("clusterIP") == "None")


def service_aliases(objects: Sequence[Mapping[str, Any]], labels: Mapping[str, str], pod: str) -> list[str]:
    """DNS names that resolve to the pod itself: headless Services and its StatefulSet pod name."""
    names: list[str] = []
    for svc in (s["metadata"]["name"] for s in services_of(objects, labels) if headless(s)):
        names += _dns(svc) + _dns(f"{pod}.{svc}")
    return sorted(set(names))


def job_networks(objects: Sequence[Mapping[str, Any]], labels: Mapping[str, str]) -> dict[str, list[str]]:
    """The networks standing in for the NetworkPolicies that select a Job's pod (by its labels).

    A policy that allows egress (the episode policy: the gateway and DNS) is the episode network,
    where only the gateway Service answers; a pod only deny-all policies select gets no network.
    """
    allowed = False
    for obj in objects:
        if obj.get("kind") != "NetworkPolicy":
            continue
        if _selects((obj["spec"].get("podSelector") or {}).get("matchLabels") or {}, labels):
            allowed = allowed or bool(obj["spec"].get("egress"))
    return {EPISODE_NET: []} if allowed else {}


def proxy_config(
    service: Mapping[str, Any], main: Mapping[str, Any], backends: Mapping[str, str]
) -> dict[str, Any]:
    """The proxy's listeners: each Service port to its target port on every backend container.

    `backends` maps each container's name to its address (the Service's endpoints); an empty
    address (a container that has no network yet) leaves the proxy to look the name up.
    """
    named = {p.get("name"): int(p["containerPort"]) for p in main.get("ports") or []}
    listeners = []
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        target_port = named[target] if isinstance(target, str) else int(target)
        endpoints = [[name, target_port, address] for name, address in backends.items()]
        listeners.append({"port": int(port["port"]), "backends": endpoints})
    return {"listeners": listeners}


def _dns(name: str) -> list[str]:
    return [name, f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc", f"{name}.{NAMESPACE}.svc.cluster.local"]


@dataclass
class RunningPod:
    """One replica started as containers."""

    name: str
    component: str
    container: str
    spec: dict[str, Any]
    main: dict[str, Any]
    ready: bool = False


@dataclass
class LocalCluster:
    """The rendered chart's workloads as podman containers; `start()`, `wait_ready()`, `stop()`."""

    objects: list[dict[str, Any]]
    state: Path
    # Per component: extra environment (the stand-in API server's address, for example).
    env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Claim name -> (folder inside it, folder to copy there) before the pods start (the model).
    seed: Mapping[str, tuple[str, Path]] = field(default_factory=dict)
    pods: list[RunningPod] = field(default_factory=list)
    # The Service proxies' container names, by Service name.
    proxies: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.refs = pods.Objects()
        for obj in self.objects:
            self.refs.add(obj)

    # -- networks ------------------------------------------------------------------------------

    def create_networks(self) -> None:
        """The service network and the episode network (internal, isolated from each other)."""
        for net in (CLUSTER_NET, EPISODE_NET):
            subprocess.run(["podman", "network", "rm", "-f", net], capture_output=True, check=False)
            _podman("network", "create", "--internal", "--opt", "isolate=true", net)

    def gateway_ip(self, net: str = CLUSTER_NET) -> str:
        """This machine's address on a network (where the stand-in API server listens)."""
        out = _podman("network", "inspect", "--format", "{{range .Subnets}}{{.Gateway}}{{end}}", net)
        return out.strip()

    # -- pods ----------------------------------------------------------------------------------

    def claims(self, workload: Workload, pod: str) -> dict[str, Path]:
        """Host folders of the claims a pod mounts, owned by its fsGroup, seeded once."""
        folders: dict[str, Path] = {}
        spec = workload.template["spec"]
        owner = int((spec.get("securityContext") or {}).get("fsGroup", 65532))
        wanted = [
            v["persistentVolumeClaim"]["claimName"]
            for v in spec.get("volumes") or []
            if "persistentVolumeClaim" in v
        ]
        for claim in wanted:
            folders[claim] = self._claim(claim, owner)
        for template in workload.claim_templates:
            folders[template] = self._claim(f"{template}-{pod}", owner)
        return folders

    def _claim(self, name: str, owner: int) -> Path:
        folder = self.state / "claims" / name
        if not folder.exists():
            folder.mkdir(parents=True)
            if name in self.seed:
                inside, source = self.seed[name]
                shutil.copytree(source, folder / inside)
            subprocess.run(["chown", "-R", f"{owner}:{owner}", str(folder)], check=True)
        return folder

    def start(self, workload: Workload) -> list[RunningPod]:
        """Every replica of a workload, its first container (sidecars are not carried over)."""
        started = []
        spec = workload.template["spec"]
        if spec.get("initContainers"):
            raise ClusterError(f"{workload.name}: init containers are not carried over")
        for pod in workload.pod_names():
            labels = workload.template["metadata"].get("labels") or {}
            networks: dict[str, list[str]] = {CLUSTER_NET: service_aliases(self.objects, labels, pod)}
            place = pods.PodPlace(
                pod, NAMESPACE, networks, self.state / "pods" / pod, self.claims(workload, pod),
                self.env.get(workload.component, {}),
            )  # fmt: skip
            main = spec["containers"][0]
            command = pods.run_args(spec, main, self.refs, place, image=main["image"])
            subprocess.run(["podman", "rm", "-f", f"{pod}-{main['name']}"], capture_output=True, check=False)
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise ClusterError(f"{pod}: podman run failed: {done.stderr.strip()[-2000:]}")
            running = RunningPod(pod, workload.component, f"{pod}-{main['name']}", spec, main)
            self.pods.append(running)
            started.append(running)
        self._start_proxies(workload, started)
        return started

    def _start_proxies(self, workload: Workload, started: Sequence[RunningPod]) -> None:
        """A proxy container for each ClusterIP Service in front of the workload's pods."""
        labels = workload.template["metadata"].get("labels") or {}
        for service in services_of(self.objects, labels):
            name = service["metadata"]["name"]
            if headless(service) or name in self.proxies:
                continue
            endpoints = {p.container: pods.address(p.container, CLUSTER_NET) for p in started}
            config = proxy_config(service, started[0].main, endpoints)
            aliases = ",".join(f"alias={a}" for a in _dns(name))
            networks = [CLUSTER_NET, EPISODE_NET] if workload.component == "gateway" else [CLUSTER_NET]
            container = f"svc-{name}"
            subprocess.run(["podman", "rm", "-f", container], capture_output=True, check=False)
            _podman(
                "run", "-d", *PODMAN_FLAGS, "--name", container, "--restart", "always",
                *(flag for net in networks for flag in ("--network", f"{net}:{aliases}")),
                *HARDENED, "--memory", "64m",
                "--mount", f"type=bind,source={PROXY_SCRIPT},destination=/proxy/service_proxy.py,ro",
                "--entrypoint", '["python3"]', base_ref("py"), "/proxy/service_proxy.py", json.dumps(config),
            )  # fmt: skip
            self.proxies[name] = container

    def wait_ready(self, group: Sequence[RunningPod], timeout_s: float) -> None:
        """Poll each pod's readiness (else liveness) probe until all pass; raise on timeout or exit."""
        deadline = time.monotonic() + timeout_s
        while True:
            for pod in group:
                if not pod.ready:
                    pod.ready = self._probe(pod)
            if all(p.ready for p in group):
                return
            dead = [p.name for p in group if self.restarts(p) > MAX_RESTARTS]
            if dead or time.monotonic() > deadline:
                why = "is crash-looping" if dead else f"not ready after {timeout_s:.0f} s"
                names = dead or [p.name for p in group if not p.ready]
                raise ClusterError(f"{', '.join(names)} {why}:\n{self.logs(names[0])}")
            time.sleep(2)

    def _probe(self, pod: RunningPod) -> bool:
        probe = pod.main.get("readinessProbe") or pod.main.get("livenessProbe")
        if probe is None:
            return self.running(pod)
        return pods.probe_ok(pod.main, probe, pod.container, pods.address(pod.container, CLUSTER_NET))

    def restarts(self, pod: RunningPod) -> int:
        """How often the pod's container was restarted (`restartPolicy: Always`)."""
        out = _podman("inspect", "--format", "{{.RestartCount}}", pod.container, check=False).strip()
        return int(out) if out.isdigit() else 0

    def running(self, pod: RunningPod) -> bool:
        """Whether the pod's container still runs."""
        out = _podman("inspect", "--format", "{{.State.Running}}", pod.container, check=False)
        return out.strip() == "true"

    def logs(self, pod_name: str, lines: int = 40) -> str:
        """The last log lines of a pod's container."""
        pod = next(p for p in self.pods if p.name == pod_name)
        done = subprocess.run(
            ["podman", "logs", "--tail", str(lines), pod.container],
            capture_output=True,
            text=True,
            check=False,
        )
        return (done.stdout + done.stderr)[-4000:]

    def identity(self, pod: RunningPod) -> dict[str, Any]:
        """The user a pod's process runs as and whether its root filesystem is writable."""
        uid = _podman("exec", pod.container, "python", "-c", "import os; print(os.getuid())", check=False)
        write = subprocess.run(
            ["podman", "exec", pod.container, "python", "-c", "open('/probe-write', 'w')"],
            capture_output=True, check=False,
        )  # fmt: skip
        read_only = _podman("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", pod.container)
        return {
            "uid": int(uid.strip()) if uid.strip().isdigit() else None,
            "root_writable": write.returncode == 0,
            "read_only": read_only.strip() == "true",
        }

    def stop(self) -> None:
        """Remove every container this cluster started, then its networks."""
        for container in [*self.proxies.values(), *(pod.container for pod in self.pods)]:
            subprocess.run(["podman", "rm", "-f", "-t", "5", container], capture_output=True, check=False)
        for net in (CLUSTER_NET, EPISODE_NET):
            subprocess.run(["podman", "network", "rm", "-f", net], capture_output=True, check=False)


def can_connect(
    network: str, image: str, targets: Sequence[tuple[str, int]], timeout_s: float = 3
) -> list[bool]:
    """Whether a hardened throwaway container on `network` can open each (host, port)."""
    script = (
        "import socket, sys\n"
        f"for host, port in {list(targets)!r}:\n"
        "    try:\n"
        f"        socket.create_connection((host, port), timeout={timeout_s}).close(); print('open')\n"
        "    except OSError as exc:\n"
        "        print('closed', type(exc).__name__)\n"
    )
    command = ["podman", "run", "--rm", *PODMAN_FLAGS, "--network", network, *HARDENED, "--memory", "256m",
               "--entrypoint", '["python"]', image, "-c", script]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    answers = [line.startswith("open") for line in done.stdout.splitlines()]
    if len(answers) != len(targets):
        raise ClusterError(f"connect probe failed: {done.stderr.strip()[-1000:]}")
    return answers


def first_port(pod: RunningPod) -> int:
    """The first port a pod's main container declares."""
    return int((pod.main.get("ports") or [{"containerPort": 80}])[0]["containerPort"])


def free_port(host: str) -> int:
    """A free TCP port on one of this machine's addresses."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _podman(*args: str, check: bool = True) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise ClusterError(f"podman {' '.join(args[:3])} failed: {done.stderr.strip()[-1500:]}")
    return done.stdout

"""One short training run through a `LocalCluster`: the fake API server, Jobs as containers.

`TrainingRun.kube_api()` serves the fake Kubernetes API on this machine's address on the service
network and runs `EpisodeJobs` beside it, the stand-in for the Job controller and the kubelet:
every Job created there (the controller's episode Jobs and the reward service's grading Jobs) is
started as containers of its own pod spec, init containers first (the hardened security context,
Secrets through `secretKeyRef`, ConfigMap volumes, emptyDir workspace and /tmp), on the network the
chart's NetworkPolicies give its labels (episodes: only the gateway Service; grading: none); its
output becomes the pod's log and its exit code ends the Job through the fake API's hooks.
`train()` submits a run with the Kubernetes launcher through the control API: a SWE instance
whose repository is baked into a task image, then the demo's multiplication tasks for the
demo's warm-started model. It waits for two trainer steps, then reads what happened off the bus
and the pods' metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shlex
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml

from harnessrl.shared import subjects
from harnessrl.shared.bus.nats import NatsBus
from harnessrl.shared.cache import build_once, cache_root
from harnessrl.shared.contracts import (
    EpisodeFailed,
    EpisodeScored,
    LauncherSpec,
    RolloutComplete,
    RunSpec,
    StepMetrics,
    TaskSpec,
    WeightVersion,
    decode,
    decode_event,
)
from harnessrl.stack.demo import swe_tasks
from harnessrl.stack.demo.tasks import task_spec, training_pairs, write_tasks
from harnessrl.testkit import cluster, pods, service_proxy
from harnessrl.testkit.cluster import CLUSTER_NET, NAMESPACE, LocalCluster, free_port
from harnessrl.testkit.controller_client import ask, completed
from harnessrl.testkit.fake_kube import FakeKubeServer
from harnessrl.testkit.images import IMAGE_BY_NAME, PODMAN_FLAGS, podman
from harnessrl.testkit.swe_eval import official_row

RUN = "demo"  # the chart's local-cpu `trainer.run`
EPISODE_NAMESPACE = f"{NAMESPACE}-episodes"
RUN_CONFIGMAP = "hrl-cluster-check-run"
RUN_MOUNT = "/run-spec"
STEPS = 2
GROUP_SIZE = 4
# A step's groups: the SWE instance and two multiplication tasks in the first, three of these next.
TASKS_PER_STEP = 3
TRAIN_TIMEOUT_S = 900.0
SERVICE_ORDER = ("gateway", "controller", "reward", "trainer")
READY_TIMEOUT_S = 900.0


@dataclass
class EpisodeJobs:
    """The stand-in Job controller: each new Job of the fake API runs as a hardened container."""

    api_url: str
    state: Path
    # The rendered chart: its NetworkPolicies decide each Job pod's network.
    objects: list[dict[str, Any]]
    started: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    concluded: set[str] = field(default_factory=set)
    failed_logs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)

    def run_forever(self) -> None:
        """Poll the API's Jobs every second until stopped; a poll that fails is counted, not fatal."""
        while not self.stop_event.wait(1.0):
            try:
                self._poll()
            except (OSError, pods.PodError, KeyError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    def _poll(self) -> None:
        for job in self._get(f"/apis/batch/v1/namespaces/{EPISODE_NAMESPACE}/jobs")["items"]:
            name = job["metadata"]["name"]
            if name not in self.started and not job.get("status", {}).get("conditions"):
                self.started[name] = self._launch(job)
        for name, process in self.started.items():
            if name not in self.concluded and process.poll() is not None:
                self._conclude(name, process.returncode)
                self.concluded.add(name)

    def _launch(self, job: dict[str, Any]) -> subprocess.Popen[bytes]:
        """The Job's pod: its init containers one after the other, then its first container."""
        name = job["metadata"]["name"]
        pod = job["spec"]["template"]["spec"]
        labels = job["spec"]["template"].get("metadata", {}).get("labels") or {}
        networks = cluster.job_networks(self.objects, labels)
        place = pods.PodPlace(name, EPISODE_NAMESPACE, networks, self.state / "jobs" / name)
        objects = self._referenced(pod)
        steps = [
            pods.run_args(pod, container, objects, place, image=container["image"], detach=False)
            for container in [*pod.get("initContainers", []), pod["containers"][0]]
        ]
        deadline = int(job["spec"].get("activeDeadlineSeconds", 600))
        (self.state / "jobs").mkdir(parents=True, exist_ok=True)
        log = (self.state / "jobs" / f"{name}.log").open("wb")
        script = " && ".join(shlex.join(step) for step in steps)
        return subprocess.Popen(["timeout", str(deadline), "sh", "-c", script], stdout=log, stderr=log)

    def _referenced(self, pod: dict[str, Any]) -> pods.Objects:
        """The Secrets (by `secretKeyRef`) and ConfigMaps (by volume) the pod needs, from the API."""
        objects = pods.Objects()
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            for item in container.get("env") or []:
                ref = (item.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ref["name"] not in objects.secrets:
                    objects.add(self._get(f"/api/v1/namespaces/{EPISODE_NAMESPACE}/secrets/{ref['name']}"))
        for volume in pod.get("volumes") or []:
            if "configMap" in volume:
                ref = volume["configMap"]["name"]
                objects.add(self._get(f"/api/v1/namespaces/{EPISODE_NAMESPACE}/configmaps/{ref}"))
        return objects

    def _conclude(self, name: str, code: int) -> None:
        """The pod's log as the API serves it (a grader reads it), then the Job's end."""
        log = self.state / "jobs" / f"{name}.log"
        text = log.read_bytes() if log.exists() else b""
        selector = urllib.parse.quote(f"job-name={name}")
        for item in self._get(f"/api/v1/namespaces/{EPISODE_NAMESPACE}/pods?labelSelector={selector}")[
            "items"
        ]:
            self._post(f"/fake/v1/pods/{EPISODE_NAMESPACE}/{item['metadata']['name']}/log", text)
        if code == 0:
            self._post(f"/fake/v1/jobs/{EPISODE_NAMESPACE}/{name}/complete")
            return
        reason = "DeadlineExceeded" if code == 124 else "PodFailurePolicy"
        self._post(f"/fake/v1/jobs/{EPISODE_NAMESPACE}/{name}/fail?reason={reason}&exitCode={code}")
        self.failed_logs.append(f"{name} exit {code}: {text[-600:].decode(errors='replace')}")

    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.api_url + path, timeout=10) as answer:  # noqa: S310 - the fake API we started
            body: dict[str, Any] = json.loads(answer.read())
            return body

    def _post(self, path: str, body: bytes = b"") -> None:
        request = urllib.request.Request(self.api_url + path, data=body, method="POST")  # noqa: S310
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - the fake API we started
            answer.read()

    def remove_containers(self) -> None:
        """Remove every Job's containers (labelled with their pod's name, the Job's)."""
        for name in self.started:
            subprocess.run(
                ["podman", "rm", "-f", "--filter", f"label=io.harnessrl.pod={name}"],
                capture_output=True,
                check=False,
            )


@dataclass
class TrainingRun:
    """The demo run submitted to the containers, and what it takes to run it there."""

    state: Path
    jobs: EpisodeJobs | None = None
    swe_task_id: str = ""

    def values_file(self) -> Path:
        """Extra chart values: the run's task file reaches the controller as a ConfigMap volume."""
        values = {
            "controller": {
                "extraVolumes": [{"name": "run-spec", "configMap": {"name": RUN_CONFIGMAP}}],
                "extraVolumeMounts": [{"name": "run-spec", "mountPath": RUN_MOUNT, "readOnly": True}],
            }
        }
        path = self.state / "cluster-check-values.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(values))
        return path

    @staticmethod
    def warm_model() -> Path:
        """The tiny model after the demo's warm start (cached per machine).

        Untrained, it answers no multiplication: every group's rewards are all 0, nothing to train
        on. After the demo's warm start it answers about 27% sampled, so most groups carry reward
        variance (`make demo` measures it).
        """
        from harnessrl.stack.demo import run, tasks  # torch: imported only when run
        from harnessrl.stack.demo.tiny_model import cached_tiny_model

        settings = run.DemoSettings(run=RUN)
        inputs = (
            Path(tasks.__file__).read_bytes() + f"{settings.warm_steps} {settings.warm_examples}".encode()
        )
        target = cache_root() / f"cluster-check-warm-{hashlib.sha256(inputs).hexdigest()[:16]}"
        done = build_once(
            target,
            lambda staging: run.warm_start(staging, cached_tiny_model(), settings),
            done="demo/warm/config.json",
        )
        return done / "demo" / "warm"

    def swe_task(self) -> TaskSpec:
        """An instance of the coding demo's family, its repository at /testbed of a task image."""
        (spec,) = swe_tasks.instance_specs("train", 1)
        context = self.state / "task-image"
        row = swe_tasks.write_instance(spec, context / "repos")
        # At the base commit, as SWE-bench images hold /testbed (written, it is at its first).
        repo = context / "repos" / spec.name
        subprocess.run(["git", "-C", str(repo), "checkout", "-q", "--detach", row["base_commit"]], check=True)
        (context / "Containerfile").write_text(
            f"FROM {IMAGE_BY_NAME['task'].ref}\nCOPY repos/{spec.name} /testbed\n"
        )
        ref = f"{IMAGE_BY_NAME['task'].ref.rsplit(':', 1)[0]}:{spec.name.replace('_', '-')}"
        podman("build", *PODMAN_FLAGS, "--network", "none", "--quiet", "-t", ref, str(context))
        # Graded the official way: the row's own eval script in the task image (`reward.swe.evalpod`).
        pristine = {k: v for k, v in row.items() if k != "repo_path"} | {"image": ref, "workdir": "/testbed"}
        instance = official_row(pristine, "python3")
        self.swe_task_id = row["instance_id"]
        return TaskSpec(
            task_id=row["instance_id"], kind="swe", prompt=row["problem_statement"], grader="swebench",
            instance=instance,
        )  # fmt: skip

    def objects(self) -> list[dict[str, Any]]:
        """The ConfigMap with the run's tasks (a user would `kubectl create configmap`).

        The first task is a SWE instance: its episodes' patches are graded in grading Jobs. The
        demo's multiplication tasks follow, which the warm-started model answers well enough that
        their groups carry reward variance to train on.
        """
        count = STEPS * TASKS_PER_STEP * 2
        multiplication = (task_spec(a, b) for a, b in training_pairs(count, seed=11))
        tasks = write_tasks(self.state / "tasks.jsonl", [self.swe_task(), *multiplication])
        return [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": RUN_CONFIGMAP, "namespace": NAMESPACE},
                "data": {"tasks.jsonl": tasks.read_text()},
            }
        ]

    @contextlib.contextmanager
    def kube_api(self, local: LocalCluster) -> Iterator[str]:
        """The fake API server on the service network and the Job runner, for the block's duration."""
        host = local.gateway_ip()
        loop = asyncio.new_event_loop()
        server = FakeKubeServer(host=host, port=free_port(host))
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
        self.jobs = EpisodeJobs(url, self.state, local.objects)
        runner = threading.Thread(target=self.jobs.run_forever, daemon=True)
        runner.start()
        try:
            yield url
        finally:
            self.jobs.stop_event.set()
            runner.join(10)
            self.jobs.remove_containers()
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

    def spec(self) -> RunSpec:
        """The demo's run with the Kubernetes launcher and the demo harness image."""
        return RunSpec(
            run=RUN,
            tasks=f"{RUN_MOUNT}/tasks.jsonl",
            group_size=GROUP_SIZE,
            batch_tasks=TASKS_PER_STEP,
            max_concurrent=GROUP_SIZE * TASKS_PER_STEP,
            mode="sync",
            staleness=0,
            max_steps=STEPS,
            episode_timeout_s=300,
            launcher=LauncherSpec(
                kind="kubernetes",
                image=IMAGE_BY_NAME["harness:demo"].ref,
                command=["/opt/harness/bin/python", "/opt/harness/harness.py"],
                env={"HARNESSRL_MODEL": "policy"},
                namespace=EPISODE_NAMESPACE,
                cpu="500m",
                memory="256Mi",
            ),
            reward="numeric",
            model="/models/tiny",
        )

    def train(self, local: LocalCluster, failures: list[str]) -> dict[str, Any]:
        """Submit the run, wait for its steps; what was seen (episodes, steps, gateway replicas)."""
        return asyncio.run(self._train(local, failures))

    async def _train(self, local: LocalCluster, failures: list[str]) -> dict[str, Any]:
        nats = next(p for p in local.pods if p.component == "nats")
        password = local.refs.secrets["hrl-harnessrl-nats-auth"]["admin"]
        bus = NatsBus(
            f"nats://admin:{password}@{pods.address(nats.container, CLUSTER_NET)}:4222", name="cluster-check"
        )
        await bus.connect()
        seen: dict[str, Any] = {}
        try:
            reply = await ask(bus, "submit", {"spec": msgspec.to_builtins(self.spec())}, timeout_s=120)
            if not reply.get("ok"):
                failures.append(f"submit refused: {reply}")
                return seen
            deadline = time.monotonic() + TRAIN_TIMEOUT_S
            steps, versions = await self._wait_steps(bus, failures, deadline)
            seen["steps"] = steps
            seen["weight_versions"] = versions
            seen["swe_outcomes"] = await self._wait_swe_ended(bus, failures, deadline)
            seen["episodes_completed"] = await completed(bus, RUN)
            seen["spans_missing"] = await _spans_missing(bus)
            seen["patches_graded"] = seen["swe_outcomes"].get("graded-in-job", 0)
        finally:
            await bus.close()
        seen["gateway_calls"] = _gateway_calls(local)
        seen["gateway_spread"] = _gateway_spread(local)
        if not seen.get("patches_graded"):
            failures.append("no SWE patch was graded officially (its eval script in a grading Job)")
        if sum(1 for calls in seen["gateway_calls"].values() if calls > 0) < 2:
            failures.append(
                f"episodes did not go through two gateway replicas: {seen['gateway_calls']}; "
                f"the gateway Service's proxy: {seen['gateway_spread']}"
            )
        if self.jobs is not None:
            seen["episode_jobs"] = len(self.jobs.started)
            seen["episode_failures"] = self.jobs.failed_logs[:3]
            if self.jobs.errors:
                failures.append(f"the job runner failed {len(self.jobs.errors)} polls: {self.jobs.errors[0]}")
        return seen

    async def _wait_steps(self, bus: NatsBus, failures: list[str], deadline: float) -> tuple[int, int]:
        """Wait for `STEPS` trainer steps and at least one new weight version served.

        A step may train nothing and say so (a group whose rewards are all equal, one sampled a
        version too old; its `WeightVersion` carries the previous weights). With 4-episode groups
        of a policy that answers about a quarter of its tasks, the second step of one check in
        three here trained nothing: a zero-variance group and the SWE group graded a version late.
        """
        steps = versions = 0
        while time.monotonic() < deadline:
            metrics = await bus.replay(subjects.METRICS.name, subjects.metrics(RUN, "trainer"))
            weights = [
                decode(m.data, WeightVersion)
                for m in await bus.replay(subjects.WEIGHTS.name, subjects.weights(RUN))
            ]
            steps = len({decode(m.data, StepMetrics).step for m in metrics})
            versions = len({w.version for w in weights if not w.carries_previous})
            if steps >= STEPS and versions >= 1:
                return steps, versions
            await asyncio.sleep(5)
        failures.append(
            f"after {TRAIN_TIMEOUT_S:.0f} s: {steps} trainer steps, {versions} new weight versions"
        )
        return steps, versions

    async def _wait_swe_ended(self, bus: NatsBus, failures: list[str], deadline: float) -> dict[str, int]:
        """Wait until each of the SWE group's episodes is graded or failed; how they ended.

        The trainer steps on the first groups ready (the local-cpu trainer's `batch_groups` is 2,
        a run batch 3 groups), so both steps may pass while the SWE episodes still run or wait
        for their grading Jobs (1 check in 6 here read the outcomes then and found none).
        """
        while True:
            outcomes = await _swe_outcomes(bus, self.swe_task_id)
            pending = sum(n for key, n in outcomes.items() if key.startswith("pending"))
            if sum(outcomes.values()) >= GROUP_SIZE and not pending:
                return outcomes
            if time.monotonic() >= deadline:
                failures.append(f"after {TRAIN_TIMEOUT_S:.0f} s not every SWE episode had ended: {outcomes}")
                return outcomes
            await asyncio.sleep(5)


@contextlib.contextmanager
def running_cluster(run: TrainingRun) -> Iterator[tuple[LocalCluster, str]]:
    """The local-cpu scenario's pods, every one ready, and the fake API's URL; removed afterwards."""
    objects = cluster.render(values=(cluster.LOCAL_CPU_VALUES, run.values_file()))
    objects += run.objects()
    local = LocalCluster(objects, run.state, seed={"hrl-harnessrl-models": ("tiny", run.warm_model())})
    by_component = {w.component: w for w in cluster.workloads(objects)}
    missing = {"nats", "vllm", *SERVICE_ORDER} - set(by_component)
    if missing:
        raise cluster.ClusterError(f"the rendered chart has no workload for {sorted(missing)}")
    local.create_networks()
    try:
        nats = local.start(by_component["nats"])
        vllm = local.start(by_component["vllm"])
        local.wait_ready(nats, 120)
        # The trainer syncs every replica at start and exits (restarted) while vLLM still loads:
        # the services start once it serves, which spares this small machine the restarts.
        local.wait_ready(vllm, READY_TIMEOUT_S)
        # The service network's bridge exists once a container joined it: serve the API there.
        with run.kube_api(local) as api_url:
            local.env = {
                "controller": {"HRL_CONTROLLER_KUBE_API_URL": api_url},
                "reward": {"HRL_REWARD_KUBE_API_URL": api_url},
            }
            services = [pod for name in SERVICE_ORDER for pod in local.start(by_component[name])]
            local.wait_ready(services, READY_TIMEOUT_S)
            yield local, api_url
    finally:
        local.stop()


async def _spans_missing(bus: NatsBus) -> int:
    """Rollouts whose span count disagrees with the spans on SPANS (gaps in an episode's seq)."""
    missing = 0
    for message in await bus.replay(subjects.ROLLOUTS.name, subjects.rollout(RUN)):
        rollout = decode(message.data, RolloutComplete)
        spans = await bus.replay(subjects.SPANS.name, subjects.span(RUN, rollout.episode))
        missing += max(0, rollout.span_count - len(spans))
    return missing


async def _swe_outcomes(bus: NatsBus, task: str) -> dict[str, int]:
    """How the SWE task's episodes ended: `graded-in-job`, else each grade outcome or failure.

    `graded-in-job` means graded by the official path: the row's eval script run in the task image.

    An episode not graded or failed yet counts as `pending after <the last event it had>`.
    """
    ended: dict[str, str] = {}
    latest: dict[str, str] = {}
    for message in await bus.replay(subjects.EPISODES.name, subjects.episode_events_of_run(RUN)):
        event = decode_event(message.data)
        if event.task != task:
            continue
        latest[event.episode] = type(event).__name__
        if isinstance(event, EpisodeScored):
            official = event.details.get("grading") == "official"
            in_job = event.outcome == "graded" and event.details.get("sandbox") == "kubernetes" and official
            reason = f"{event.outcome}: {event.details.get('reason', '')}"[:160]
            ended[event.episode] = "graded-in-job" if in_job else reason
        elif isinstance(event, EpisodeFailed):
            ended[event.episode] = f"failed {event.cause}: {event.reason}"[:160]
    outcomes: dict[str, int] = {}
    for episode, kind in latest.items():
        key = ended.get(episode, f"pending after {kind}")
        outcomes[key] = outcomes.get(key, 0) + 1
    return outcomes


def _gateway_calls(local: LocalCluster) -> dict[str, float]:
    """Each gateway replica's count of proxied calls, from its /metrics."""
    calls: dict[str, float] = {}
    for pod in local.pods:
        if pod.component != "gateway":
            continue
        url = f"http://{pods.address(pod.container, CLUSTER_NET)}:8000/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            text = answer.read().decode()
        calls[pod.name] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("harnessrl_gateway_requests_total")
        )
    return calls


def _gateway_spread(local: LocalCluster) -> dict[str, Any]:
    """How the gateway Service's proxy spread connections (`service_proxy.spread`), with restarts."""
    proxy = next(c for name, c in local.proxies.items() if name.endswith("-gateway"))
    done = subprocess.run(["podman", "logs", proxy], capture_output=True, text=True, check=False)
    spread = service_proxy.spread(done.stdout)
    spread["restarts"] = {p.name: local.restarts(p) for p in local.pods if p.component == "gateway"}
    return spread

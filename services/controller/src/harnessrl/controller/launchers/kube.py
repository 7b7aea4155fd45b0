"""Kubernetes launcher: one hardened Job per episode, followed by a watch on the run's Jobs and Pods.

Names are deterministic, so a second launch of the same episode (after a controller restart) meets
`409 AlreadyExists` and is treated as already launched. The episode key travels in a per-episode
Secret that the Job owns (garbage-collected with it) and reaches the pod via `secretKeyRef`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import msgspec
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from harnessrl.controller.launchers.base import (
    ExitCallback,
    ExitStatus,
    Launcher,
    LaunchError,
    LauncherUnavailableError,
    LaunchRequest,
)
from harnessrl.controller.launchers.kube_manifest import (
    EPISODE_LABEL,
    RUN_LABEL,
    job_name,
    render_job,
    render_secret,
)
from harnessrl.controller.launchers.kube_status import job_status, stuck_reason
from harnessrl.controller.launchers.kube_watch import ObjectWatch, wait_started
from harnessrl.shared.contracts import LauncherSpec
from harnessrl.shared.log import get_logger

_CONFLICT = 409


class KubeUnreachableError(LauncherUnavailableError):
    """The Kubernetes API server cannot be reached or refuses the controller."""


def api_client(api_url: str = "", kubeconfig: str = "") -> client.ApiClient:
    """An API client: explicit URL, else in-cluster config, else the kubeconfig file."""
    if api_url:
        configuration = client.Configuration()
        configuration.host = api_url
        configuration.retries = 1
        return client.ApiClient(configuration)
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        try:
            config.load_kube_config(config_file=kubeconfig or None)  # type: ignore[no-untyped-call]
        except (config.ConfigException, OSError) as exc:
            raise KubeUnreachableError(f"no Kubernetes configuration: {exc}") from exc
    return client.ApiClient()


class KubeLauncher(Launcher):
    """Launches and follows a run's episodes as Kubernetes Jobs."""

    kind = "kubernetes"

    def __init__(
        self,
        run: str,
        spec: LauncherSpec,
        api: client.ApiClient,
        *,
        job_ttl_s: int = 3600,
        watch_timeout_s: int = 60,
        allowed_images: Sequence[str] = (),
    ) -> None:
        self._run, self._spec, self._ns = run, spec, spec.namespace
        self._allowed_images = tuple(allowed_images)
        self._batch, self._core = client.BatchV1Api(api), client.CoreV1Api(api)
        self._ttl, self._watch_timeout = job_ttl_s, watch_timeout_s
        self._selector = f"{RUN_LABEL}={run}"
        self._on_exit: ExitCallback | None = None
        self._events: asyncio.Queue[tuple[str, str, dict[str, Any]]] = asyncio.Queue()
        self._reported: set[str] = set()
        self._watches: list[ObjectWatch] = []
        self._pump: asyncio.Task[None] | None = None
        self._log = get_logger(__name__, run=run, namespace=self._ns)

    async def start(self, on_exit: ExitCallback) -> None:
        """Check the API is reachable, then watch the run's Jobs and Pods."""
        self._on_exit = on_exit
        await self._call(self._batch.list_namespaced_job, self._ns, limit=1, _preload_content=False)
        loop = asyncio.get_running_loop()
        for name, list_fn in (
            ("jobs", self._batch.list_namespaced_job),
            ("pods", self._core.list_namespaced_pod),
        ):

            def emit(kind: str, obj: dict[str, Any], name: str = name) -> None:
                loop.call_soon_threadsafe(self._events.put_nowait, (name, kind, obj))

            watch = ObjectWatch(name, list_fn, self._ns, self._selector, emit, timeout_s=self._watch_timeout)
            watch.start()
            self._watches.append(watch)
        for watch in self._watches:
            await asyncio.to_thread(wait_started, watch)
        self._pump = asyncio.create_task(self._pump_events())

    async def launch(self, request: LaunchRequest) -> str:
        """Create the episode's Secret and Job; existing ones mean it was already launched."""
        secret = render_secret(request, self._ns)
        job = render_job(request, self._spec, ttl_s=self._ttl, allowed_images=self._allowed_images)
        name = job["metadata"]["name"]
        await self._create(self._core.create_namespaced_secret, secret)
        created = await self._create(self._batch.create_namespaced_job, job)
        if created is not None:
            owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": created["metadata"]["uid"]}
            await self._call(
                self._core.patch_namespaced_secret,
                secret["metadata"]["name"],
                self._ns,
                {"metadata": {"ownerReferences": [owner]}},
                _preload_content=False,
            )
        self._log.info("job.created" if created else "job.exists", episode=request.episode, job=name)
        return f"job:{name}"

    async def relist(self) -> dict[str, ExitStatus | None]:
        """Every Job of the run and how it stands (failed Jobs' pods are read for the cause)."""
        body = await self._list(self._batch.list_namespaced_job, self._selector)
        found: dict[str, ExitStatus | None] = {}
        for job in body["items"]:
            episode = (job["metadata"].get("labels") or {}).get(EPISODE_LABEL)
            if episode:
                status = await self._status(job)
                found[episode] = None if status is None else self._with_logs(episode, status)
        return found

    async def close(self) -> None:
        """Stop the watches (running Jobs carry on)."""
        for watch in self._watches:
            watch.stop()
        if self._pump is not None:
            self._pump.cancel()

    async def _pump_events(self) -> None:
        while True:
            kind, event, obj = await self._events.get()
            episode = (obj.get("metadata", {}).get("labels") or {}).get(EPISODE_LABEL)
            if not episode or episode in self._reported:
                continue
            status: ExitStatus | None = None
            if kind == "jobs" and event == "DELETED":
                status = ExitStatus(outcome="infra", reason="Job was deleted before it finished")
            elif kind == "jobs":
                status = await self._status(obj)
            elif event != "DELETED" and (reason := stuck_reason(obj)):
                status = ExitStatus(outcome="infra", reason=reason)
                await self._delete_job(job_name(self._run, episode))
            if status is not None:
                await self._report(episode, status)

    async def _report(self, episode: str, status: ExitStatus) -> None:
        self._reported.add(episode)
        if self._on_exit is not None:
            await self._on_exit(episode, self._with_logs(episode, status))

    def _with_logs(self, episode: str, status: ExitStatus) -> ExitStatus:
        """The status with where the episode's logs are: `<namespace>/<job name>`."""
        return msgspec.structs.replace(status, logs=f"{self._ns}/{job_name(self._run, episode)}")

    async def _status(self, job: dict[str, Any]) -> ExitStatus | None:
        conditions = (job.get("status") or {}).get("conditions") or []
        failed = any(c.get("type") == "Failed" and c.get("status") == "True" for c in conditions)
        pods = None
        if failed:
            selector = f"job-name={job['metadata']['name']}"
            pods = (await self._list(self._core.list_namespaced_pod, selector))["items"]
        return job_status(job, pods)

    async def _delete_job(self, name: str) -> None:
        try:
            await self._call(
                self._batch.delete_namespaced_job,
                name,
                self._ns,
                propagation_policy="Background",
                _preload_content=False,
            )
        except ApiException as exc:
            self._log.warning("job.delete_failed", job=name, status=exc.status)

    async def _list(self, list_fn: Any, selector: str) -> dict[str, Any]:
        response = await self._call(list_fn, self._ns, label_selector=selector, _preload_content=False)
        body: dict[str, Any] = json.loads(response.data)
        return body

    async def _create(self, create_fn: Any, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            response = await self._call(create_fn, self._ns, body, _preload_content=False)
        except ApiException as exc:
            if exc.status == _CONFLICT:
                return None
            raise LaunchError(
                f"{body['kind']} {body['metadata']['name']} refused: {exc.status} {exc.reason}"
            ) from exc
        created: dict[str, Any] = json.loads(response.data)
        return created

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except urllib3.exceptions.HTTPError as exc:
            host = self._batch.api_client.configuration.host
            raise KubeUnreachableError(f"cannot reach the Kubernetes API at {host}: {exc}") from exc

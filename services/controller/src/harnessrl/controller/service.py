"""The controller service: resumes runs from KV, accepts new ones, answers the control API."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from harnessrl.controller.errors import RequestRefusedError
from harnessrl.controller.external_episodes import ExternalEpisodes
from harnessrl.controller.fail_fast import announce_stop
from harnessrl.controller.launchers import Launcher, LaunchError
from harnessrl.controller.launchers.kube import KubeLauncher, api_client
from harnessrl.controller.launchers.local import LocalLauncher
from harnessrl.controller.launchers.policy import check_launcher
from harnessrl.controller.metrics import CountedLauncher, LaunchCounts
from harnessrl.controller.records import RunRecord
from harnessrl.controller.run_driver import RunDriver
from harnessrl.controller.settings import ControllerSettings
from harnessrl.controller.store import EpisodeStore, always_active
from harnessrl.controller.task_files import TaskFileError, check_repository_sources, load_tasks
from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus import Bus, Subscription, stop_all
from harnessrl.shared.contracts import RunSpec
from harnessrl.shared.log import get_logger
from harnessrl.shared.runspec import RunSpecError, check_local_launcher, parse_run_spec

LauncherFactory = Callable[[RunSpec, ControllerSettings], Launcher]
R = TypeVar("R", bound=msgspec.Struct)


def default_launcher(spec: RunSpec, settings: ControllerSettings) -> Launcher:
    """The launcher a run spec asks for (a run persisted before a policy change is checked again)."""
    check_launcher(spec.launcher, in_cluster=settings.in_cluster, allowed_images=settings.allowed_images)
    if spec.launcher.kind == "kubernetes":
        api = api_client(settings.kube_api_url, settings.kubeconfig)
        return KubeLauncher(
            spec.run,
            spec.launcher,
            api,
            job_ttl_s=settings.job_ttl_s,
            watch_timeout_s=settings.kube_watch_timeout_s,
            allowed_images=settings.allowed_images,
        )
    return LocalLauncher(
        spec.run,
        Path(settings.state_dir),
        tasks_dir=Path(spec.tasks).parent,
        kill_grace_s=settings.kill_grace_s,
        preload=list(spec.launcher.preload),
    )


class Controller:
    """Owns every run's driver; one active controller per group (`standby.py`; KV revisions guard it).

    `ensure_active` raises while this controller may not act (it lost its lease); the store calls it
    before every write, launch and publish.
    """

    def __init__(
        self,
        bus: Bus,
        settings: ControllerSettings,
        launcher_factory: LauncherFactory = default_launcher,
        *,
        ensure_active: Callable[[], None] = always_active,
    ) -> None:
        self._bus, self._settings, self._factory = bus, settings, launcher_factory
        self._ensure_active = ensure_active
        self.runs: dict[str, RunDriver] = {}
        self._store: EpisodeStore | None = None
        self._served: list[Subscription] = []
        self._submit_lock = asyncio.Lock()
        self.external = ExternalEpisodes(bus, settings, self.runs)
        # Submissions refused since this controller started, by run (shown by `run status`).
        self.refused: Counter[str] = Counter()
        # Launches by launcher kind and outcome (`metrics.CountedLauncher` wraps every run's launcher).
        self.launches: LaunchCounts = Counter()
        self._log = get_logger(__name__)

    @property
    def store(self) -> EpisodeStore:
        """The KV-backed record store (after `start`)."""
        if self._store is None:
            raise RuntimeError("controller not started")
        return self._store

    async def start(self) -> None:
        """Resume every active run, then serve the control API."""
        await self._bus.ensure_streams(subjects.ALL_STREAMS)
        kv = await self._bus.kv(subjects.EPISODE_STATE)
        self._store = EpisodeStore(kv, ensure_active=self._ensure_active)
        for record in await self.store.runs():
            if not self._owns(record.spec.run):
                continue
            if record.state == "stopped":
                await announce_stop(self._bus, self.store, record)
            elif record.state == "active":
                try:
                    await self._start_run(record)
                except LaunchError as exc:
                    self._log.error("run.resume_failed", run=record.spec.run, error=str(exc))
        responders = {
            "submit": _answering(control_api.SubmitRequest, self._submit),
            "status": _answering(control_api.StatusRequest, self._status),
            "open": _answering(control_api.OpenRequest, self.external.open),
            "close": _answering(control_api.CloseRequest, self.external.close),
        }
        for verb, responder in responders.items():
            self._served.append(await self._bus.serve(control_api.subject(verb), responder))
        self._log.info("controller.ready", runs=len(self.runs))

    def _owns(self, run: str) -> bool:
        return not self._settings.runs or run in self._settings.runs

    async def stop(self) -> None:
        """Stop serving and following (harnesses and Jobs carry on)."""
        await stop_all(self._served)
        await asyncio.gather(*(driver.stop() for driver in self.runs.values()))
        await self.external.stop()

    async def submit(self, spec: RunSpec) -> RunDriver:
        """Accept a new run (its tasks must load, its local harness must start here), persist it, start it."""
        async with self._submit_lock:
            if not self._owns(spec.run):
                raise RequestRefusedError(f"this controller does not own run {spec.run!r}")
            if spec.run in self.runs:
                raise RequestRefusedError(f"run {spec.run!r} already exists")
            # In a thread: a dataset of tens of thousands of rows takes seconds to read.
            tasks = await asyncio.to_thread(load_tasks, spec.tasks, spec.dataset)
            check_repository_sources(tasks, spec.launcher.kind, f"run {spec.run}")
            check_launcher(
                spec.launcher,
                in_cluster=self._settings.in_cluster,
                allowed_images=self._settings.allowed_images,
            )
            if spec.launcher.kind == "local":
                check_local_launcher(spec.launcher, source=f"run {spec.run}")
            record = RunRecord(spec=spec)
            if not await self.store.create_run(record):
                raise RequestRefusedError(f"run {spec.run!r} already exists")
            try:
                return await self._start_run(record)
            except LaunchError:
                await self.store.delete_run(spec.run)
                raise

    async def _start_run(self, record: RunRecord) -> RunDriver:
        tasks = await asyncio.to_thread(load_tasks, record.spec.tasks, record.spec.dataset)
        # In a thread: the Kubernetes client's API classes take a second or more to build the first
        # time, long enough to starve the lease renewals of a short `lease_ttl_s`.
        launcher = await asyncio.to_thread(self._factory, record.spec, self._settings)
        launcher = CountedLauncher(launcher, self.launches)
        driver = RunDriver(
            self._bus, self.store, record, tasks=tasks, launcher=launcher, settings=self._settings
        )
        try:
            await driver.start()
        except LaunchError:
            await driver.stop()
            raise
        self.runs[record.spec.run] = driver
        await self.external.resume(driver)
        return driver

    async def _submit(self, request: control_api.SubmitRequest) -> bytes:
        run = str(request.spec.get("run", "?"))
        try:
            spec = parse_run_spec(request.spec, source="submitted run spec")
            driver = await self.submit(spec)
        except (RunSpecError, TaskFileError, LaunchError, RequestRefusedError) as exc:
            self.refused[run] += 1
            self._log.warning("run.refused", run=run, error=str(exc), refused=self.refused[run])
            return control_api.refusal(str(exc))
        return control_api.reply(run=spec.run, groups=driver.total_groups, group_size=spec.group_size)

    async def _status(self, request: control_api.StatusRequest) -> bytes:
        names = [request.run] if request.run else sorted(self.runs)
        refused = dict(self.refused)
        if request.run and request.run not in self.runs:
            record = await self.store.run(request.run)
            if record is None:
                return control_api.refusal(f"unknown run {request.run!r}")
            return control_api.reply(runs={request.run: record_status(record)}, refused=refused)
        runs = {name: run_status(self.runs[name]) for name in names}
        return control_api.reply(runs=runs, refused=refused)


def record_status(record: RunRecord) -> dict[str, Any]:
    """What a run's record alone says (a run this controller does not drive: done or stopped)."""
    status: dict[str, Any] = {"state": record.state, "phases": {}}
    if record.stopped is not None:
        status["stopped"] = msgspec.to_builtins(record.stopped)
    return status


def run_status(driver: RunDriver) -> dict[str, Any]:
    """A run's progress: phase counts, failure causes, weight version, trainer steps, why it stopped."""
    records = driver.episodes.records.values()
    state = "stopped" if driver.stopped else "done" if driver.done.is_set() else "active"
    status: dict[str, Any] = {
        "state": state,
        "mode": driver.spec.mode,
        "weight_version": driver.version,
        "trainer_steps": driver.steps,
        "groups_scheduled": min(driver.total_groups, len({r.group for r in records if not r.byo})),
        "groups_total": driver.total_groups,
        "phases": dict(Counter(r.phase for r in records)),
        "failures": dict(Counter(r.cause for r in records if r.cause)),
    }
    if driver.stopped is not None:
        status["stopped"] = msgspec.to_builtins(driver.stopped)
        status["not_launched"] = driver.not_launched
    return status


def _answering(
    kind: type[R], handler: Callable[[R], Awaitable[bytes]]
) -> Callable[[bytes], Awaitable[bytes]]:
    """A bus responder: decode the request as `kind`, answer a malformed or refused one with its reason."""

    async def answer(payload: bytes) -> bytes:
        try:
            request = msgspec.json.decode(payload, type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return control_api.refusal(f"malformed {kind.__name__}: {exc}")
        try:
            return await handler(request)
        except RequestRefusedError as exc:
            return control_api.refusal(str(exc))

    return answer

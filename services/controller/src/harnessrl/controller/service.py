"""The controller service: resumes runs from KV, accepts new ones, answers the control API."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from harnessrl.controller.byo import ByoEpisodes
from harnessrl.controller.launchers import Launcher, LaunchError
from harnessrl.controller.launchers.kube import KubeLauncher, api_client
from harnessrl.controller.launchers.local import LocalLauncher
from harnessrl.controller.records import RunRecord
from harnessrl.controller.run import RunDriver
from harnessrl.controller.settings import ControllerSettings
from harnessrl.controller.store import EpisodeStore
from harnessrl.controller.tasks import TaskFileError, load_tasks
from harnessrl.shared import control_api as control
from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, Subscription
from harnessrl.shared.contracts import RunSpec
from harnessrl.shared.log import get_logger
from harnessrl.shared.runspec import RunSpecError, parse_run_spec

LauncherFactory = Callable[[RunSpec, ControllerSettings], Launcher]


def default_launcher(spec: RunSpec, settings: ControllerSettings) -> Launcher:
    """The launcher a run spec asks for."""
    if spec.launcher.kind == "kubernetes":
        api = api_client(settings.kube_api_url, settings.kubeconfig)
        return KubeLauncher(
            spec.run,
            spec.launcher,
            api,
            job_ttl_s=settings.job_ttl_s,
            watch_timeout_s=settings.kube_watch_timeout_s,
        )
    return LocalLauncher(
        spec.run,
        Path(settings.state_dir),
        tasks_dir=Path(spec.tasks).parent,
        kill_grace_s=settings.kill_grace_s,
        preload=list(spec.launcher.preload),
    )


class Controller:
    """Owns every run's driver; one active controller per cluster (KV revisions guard it)."""

    def __init__(
        self, bus: Bus, settings: ControllerSettings, launcher_factory: LauncherFactory = default_launcher
    ) -> None:
        self._bus, self._settings, self._factory = bus, settings, launcher_factory
        self.runs: dict[str, RunDriver] = {}
        self._store: EpisodeStore | None = None
        self._served: list[Subscription] = []
        self._submit_lock = asyncio.Lock()
        self.byo = ByoEpisodes(bus, settings, self.runs)
        self._log = get_logger("controller")

    @property
    def store(self) -> EpisodeStore:
        """The KV-backed record store (after `start`)."""
        if self._store is None:
            raise RuntimeError("controller not started")
        return self._store

    async def start(self) -> None:
        """Resume every active run, then serve the control API."""
        await self._bus.ensure_streams(subjects.ALL_STREAMS)
        self._store = EpisodeStore(await self._bus.kv(subjects.EPISODE_STATE))
        for record in await self.store.runs():
            if record.state == "active" and self._owns(record.spec.run):
                try:
                    await self._start_run(record)
                except LaunchError as exc:
                    self._log.error("run cannot resume", run=record.spec.run, error=str(exc))
        handlers: dict[str, Callable[[bytes], Awaitable[bytes]]] = {
            "submit": self._submit,
            "status": self._status,
            "open": self.byo.open,
            "close": self.byo.close,
        }
        for verb, handler in handlers.items():
            self._served.append(await self._bus.serve(control.subject(verb), _guarded(handler)))
        self._log.info("controller ready", runs=len(self.runs))

    def _owns(self, run: str) -> bool:
        return not self._settings.runs or run in self._settings.runs

    async def stop(self) -> None:
        """Stop serving and following (harnesses and Jobs carry on)."""
        for served in self._served:
            await served.stop()
        for driver in self.runs.values():
            await driver.stop()
        await self.byo.stop()

    async def submit(self, spec: RunSpec) -> RunDriver:
        """Accept a new run (its tasks must load), persist it and start scheduling."""
        async with self._submit_lock:
            if not self._owns(spec.run):
                raise control.ControlError(f"this controller does not own run {spec.run!r}")
            if spec.run in self.runs:
                raise control.ControlError(f"run {spec.run!r} already exists")
            load_tasks(spec.tasks)
            record = RunRecord(spec=spec)
            if not await self.store.create_run(record):
                raise control.ControlError(f"run {spec.run!r} already exists")
            try:
                return await self._start_run(record)
            except LaunchError:
                await self.store.delete_run(spec.run)
                raise

    async def _start_run(self, record: RunRecord) -> RunDriver:
        tasks = load_tasks(record.spec.tasks)
        launcher = self._factory(record.spec, self._settings)
        driver = RunDriver(
            self._bus, self.store, record, tasks=tasks, launcher=launcher, settings=self._settings
        )
        try:
            await driver.start()
        except LaunchError:
            await driver.stop()
            raise
        self.runs[record.spec.run] = driver
        await self.byo.resume(driver)
        return driver

    async def _submit(self, payload: bytes) -> bytes:
        request: control.SubmitRequest = control.parse(payload, control.SubmitRequest)
        try:
            spec = parse_run_spec(request.spec, source="submitted run spec")
            driver = await self.submit(spec)
        except (RunSpecError, TaskFileError, LaunchError) as exc:
            return control.refusal(str(exc))
        return control.reply(run=spec.run, groups=driver.total_groups, group_size=spec.group_size)

    async def _status(self, payload: bytes) -> bytes:
        request: control.StatusRequest = control.parse(payload, control.StatusRequest)
        names = [request.run] if request.run else sorted(self.runs)
        if request.run and request.run not in self.runs:
            record = await self.store.run(request.run)
            if record is None:
                return control.refusal(f"unknown run {request.run!r}")
            return control.reply(runs={request.run: {"state": record.state, "phases": {}}})
        return control.reply(runs={name: run_status(self.runs[name]) for name in names})


def run_status(driver: RunDriver) -> dict[str, Any]:
    """A run's progress: phase counts, failure causes, weight version."""
    records = driver.book.records.values()
    return {
        "state": "done" if driver.done.is_set() else "active",
        "mode": driver.spec.mode,
        "weight_version": driver.version,
        "groups_scheduled": min(driver.total_groups, len({r.group for r in records if not r.byo})),
        "groups_total": driver.total_groups,
        "phases": dict(Counter(r.phase for r in records)),
        "failures": dict(Counter(r.cause for r in records if r.cause)),
    }


def _guarded(handler: Callable[[bytes], Awaitable[bytes]]) -> Callable[[bytes], Awaitable[bytes]]:
    async def answer(payload: bytes) -> bytes:
        try:
            return await handler(payload)
        except control.ControlError as exc:
            return control.refusal(str(exc))

    return answer

"""The controller process as one of an active/standby pair: the `Controller` runs only under the lease.

Every controller process starts as a standby. It polls its group's lease (`lease.py`) and does
nothing else: no consumers, no control API, no launches, so run submissions and status requests
reach only the active controller (while there is none they get "no service answers", and clients
retry). Once it holds the lease it starts the `Controller`, which resumes every run from KV and
adopts running episodes exactly as after a restart: Kubernetes Jobs by relisting them, local
harnesses by their files under `state_dir` (so only on the same machine and folder; anywhere else
they are lost, an infra failure that is retried as a new attempt).

Losing the lease (taken over, or no renewal confirmed by `fence_at`) ends the process at once, as
leader election does in kube-controller-manager: a dead process cannot launch, answer, or send
what it had queued while cut off. Its supervisor starts it again and it comes back as a standby.
A stop (SIGTERM) stops the controller, then hands the lease back, so a standby takes over at its
next poll instead of a TTL later.
"""

from __future__ import annotations

import asyncio
import os
import sys

from harnessrl.controller.lease import Lease, OnLost, holder_id, lease_key
from harnessrl.controller.service import Controller
from harnessrl.controller.settings import ControllerSettings
from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.log import get_logger

# Exit status of a controller that lost its lease (EX_TEMPFAIL: start it again, it waits as a standby).
EXIT_LEASE_LOST = 75

_log = get_logger(__name__)


def exit_fenced(reason: str) -> None:
    """End the process now: nothing it queued, or would still do, may reach the bus or the cluster."""
    _log.error("lease.lost", reason=reason, exit_code=EXIT_LEASE_LOST)
    sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


class ActiveStandby:
    """Waits for the lease, then runs the `Controller` while it is held (see the module doc)."""

    def __init__(self, bus: Bus, settings: ControllerSettings, *, on_lost: OnLost = exit_fenced) -> None:
        self._bus, self._settings, self._on_lost = bus, settings, on_lost
        self.lease: Lease | None = None
        self.controller: Controller | None = None
        self._started = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the lease bucket and begin contending; the rest happens in the background."""
        kv = await self._bus.kv(subjects.CONTROLLER_LEASE)
        key = lease_key(self._settings.lease_group, self._settings.runs)
        self.lease = Lease(kv, key, holder_id(), self._settings.lease_ttl_s)
        self._task = asyncio.create_task(self._run(self.lease), name="controller-lease")
        self._started.set()

    async def wait(self) -> None:
        """Until the background work ends (the lease was lost, or a start failed, which it raises).

        May be awaited before `start` (as `run_until_signalled` does): it waits for the start first.
        """
        await self._started.wait()
        if self._task is not None:
            await self._task

    async def stop(self) -> None:
        """Stop contending; an active controller stops its work (Jobs, harnesses go on), then releases.

        The lease is renewed until the controller has stopped, so a slow stop is not cut short.
        """
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.controller is not None:
            await self.controller.stop()
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        if self.lease is not None:
            await self.lease.release()

    async def _run(self, lease: Lease) -> None:
        await lease.acquire()
        self._keeper = asyncio.create_task(lease.keep(self._on_lost), name="controller-lease-keeper")
        self.controller = Controller(self._bus, self._settings, ensure_active=lease.check)
        await self.controller.start()
        await asyncio.shield(self._keeper)  # a stop cancels this task, not the renewals

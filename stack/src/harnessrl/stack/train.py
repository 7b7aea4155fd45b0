"""`harnessrl train <run spec>`: run a training job locally (or submit it to a deployment) and follow it.

Locally (the embedded default) it starts nats-server, vLLM on the CPU, gateway, reward, controller
and trainer as supervised processes, submits the run and follows it to its last step with a live
terminal view. Ctrl-C stops everything cleanly; the run's state (KV, streams, checkpoints) stays in
the state folder, so the same command resumes it. At the end it prints a summary and writes a plot
under `.harnessrl/runs/<run>/`. Following ends early when the controller stops the run (`RunStopped`:
its first episodes all failed the same way); `RunProgress.problems()` then says why, as it does for a
run in which no step trained anything.

With `--nats-url` it starts nothing: it submits the run to that deployment and follows it. The
deployment trains its own model: a deployment's trainer is configured for one run (its `run`,
`model_dir`, ...; `harnessrl up --trainer` or the chart's trainer settings) and its vLLM serves that
model, so the spec's `model` does not choose the policy there, and a run no trainer subscribed to
gets a warning (its episodes run, but nothing trains).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from harnessrl.shared import control_api
from harnessrl.shared.bus import BusError, NatsBus
from harnessrl.shared.contracts import RunSpec
from harnessrl.shared.net import NatsUnreachable, port_free, probe_nats
from harnessrl.stack.follow import RunFollower, RunProgress, plot, render, step_line
from harnessrl.stack.local import LocalStack, StackPorts
from harnessrl.stack.readiness import trainer_subscribed

console = Console(stderr=True)
VersionHook = Callable[[int, RunProgress], Awaitable[None]]


class TrainError(RuntimeError):
    """The run could not be started or followed; the message is meant for a person."""


async def submit(bus: NatsBus, spec: RunSpec, *, wait_s: float = 90.0) -> dict[str, object]:
    """Hand the run to the controller (request-reply) and return its answer.

    A controller that is still starting (or restarting) has no responder yet: keep asking for
    `wait_s` before giving up.
    """
    payload = control_api.encode(control_api.SubmitRequest(spec=msgspec.to_builtins(spec)))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = await bus.request(control_api.subject("submit"), payload, timeout=30)
            break
        except BusError as exc:
            if time.monotonic() > deadline:
                raise TrainError(f"the controller did not take the run: {exc}") from exc
            await asyncio.sleep(0.5)
    answer = json.loads(reply)
    error = str(answer.get("error", ""))
    if not answer.get("ok") and "already exists" in error:
        # The controller resumed this run from its KV state (e.g. after Ctrl-C): follow it again.
        console.print(f"run {spec.run} already exists: resuming it")
        return {"ok": True, "run": spec.run, "resumed": True}
    if not answer.get("ok"):
        raise TrainError(f"the controller refused the run: {error}")
    return dict(answer)


async def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with a message a person can act on, when no server listens at a NATS URL."""
    try:
        await probe_nats(url, timeout_s)
    except NatsUnreachable as exc:
        raise TrainError(f"{exc}: is the deployment up?") from None


def announce_warnings(view: Live, progress: RunProgress, shown: int) -> int:
    """Print the warnings after the first `shown` above the live view; returns how many are shown."""
    for warning in progress.warnings[shown:]:
        view.console.print(f"[yellow]warning:[/] {escape(warning.message())}")
    return len(progress.warnings)


class TrainSession:
    """One `harnessrl train`: optional local stack, submission, following."""

    def __init__(
        self,
        spec: RunSpec,
        home: Path,
        *,
        model_dir: Path | None = None,
        nats_url: str | None = None,
        ports: StackPorts | None = None,
        trainer_lr: float | None = None,
    ) -> None:
        self.spec = spec
        self.home = home
        self.trainer_lr = trainer_lr
        self.model_dir = model_dir or (Path(spec.model) if spec.model else None)
        self.stack = LocalStack(home, ports, nats_url=nats_url)
        self.local = nats_url is None
        self.progress = RunProgress(run=spec.run, max_steps=spec.max_steps)

    @property
    def run_dir(self) -> Path:
        """Where this run's plot and summary go."""
        return self.home.resolve() / "runs" / self.spec.run

    def preflight(self) -> Path:
        """Refuse early, before anything starts, what would fail later; returns the model folder."""
        if self.model_dir is None or not (self.model_dir / "config.json").exists():
            raise TrainError(f"model path {self.model_dir} is not a model folder (config.json missing)")
        ports = self.stack.ports
        for name, port in (("nats", ports.nats), ("gateway", ports.gateway), ("vllm", ports.vllm)):
            if port and not port_free(port):
                raise TrainError(f"{name} port {port} is already in use")
        return self.model_dir

    def start_stack(self) -> None:
        """Start the local deployment (blocking; minutes on a cold machine because of vLLM)."""
        if not self.local:
            return
        model_dir = self.preflight()
        self.progress.phase = "starting nats-server"
        self.stack.start_nats()
        self.progress.phase = "starting vLLM (CPU) and the trainer"
        self.stack.start_vllm(model_dir)
        self.stack.start_trainer(self.spec, model_dir, lr=self.trainer_lr)
        self.stack.wait_vllm()
        self.progress.phase = "starting services"
        self.stack.start_gateway()
        self.stack.start_reward(Path(self.spec.tasks).parent)
        self.stack.start_controller()

    async def follow(self, on_version: VersionHook | None = None, *, live: bool = True) -> RunProgress:
        """Submit the run and follow it until the trainer finished `max_steps` or the run stopped.

        A stopped run returns too (`progress.stopped` says why); `progress.problems()` lists what
        went wrong.
        """
        if not self.local:
            await check_reachable(self.stack.nats_url)
        bus = NatsBus(self.stack.nats_url)
        await bus.connect()
        try:
            await bus.ensure_streams()
            follower = RunFollower(bus, self.spec.run, self.spec.max_steps)
            follower.progress = self.progress
            await follower.start()
            await submit(bus, self.spec)
            if not self.local:
                await self._explain_deployment(bus)
            self.progress.phase = "training"
            await self._watch(on_version, live)
        finally:
            await bus.close()
        return self.progress

    async def _explain_deployment(self, bus: NatsBus) -> None:
        """Say what a submitted run takes from the deployment; warn when no trainer serves it."""
        run = self.spec.run
        if self.spec.model:
            console.print(
                f"note: the deployment trains and serves its own model; the spec's `model` "
                f"({self.spec.model}) does not choose the policy there"
            )
        if not await trainer_subscribed(bus, run):
            console.print(
                f"[yellow]warning:[/] no trainer has subscribed to run {run} on this deployment: "
                f"its episodes run, but nothing trains until a trainer for run {run} starts"
            )

    async def _watch(self, on_version: VersionHook | None, live: bool) -> None:
        """Refresh the view until training is over or the controller stopped the run."""
        progress, seen_version, warned, logged = self.progress, self.progress.version, 0, 0
        with Live(render(progress), console=console, refresh_per_second=2, transient=not live) as view:
            while progress.stopped is None and not progress.finished():
                if self.local:
                    await asyncio.to_thread(self.stack.check)
                if on_version is not None and progress.version > seen_version:
                    seen_version = progress.version
                    await on_version(seen_version, progress)
                warned = announce_warnings(view, progress, warned)
                if not console.is_terminal and progress.step > logged:  # no live view there
                    logged = progress.step
                    view.console.print(step_line(progress), soft_wrap=True)
                view.update(render(progress))
                await asyncio.sleep(0.5)
            announce_warnings(view, progress, warned)
            progress.phase = "stopped" if progress.stopped is not None else "finished"
            view.update(render(progress))

    def finish(self) -> Path:
        """Write the plot and the summary; returns the plot path."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        summary = msgspec.json.encode(self.progress.summary())
        (self.run_dir / "summary.json").write_bytes(summary)
        return plot(self.progress, self.run_dir / "progress.png")

    def stop(self) -> None:
        """Stop the local deployment (nothing to stop when following a remote one)."""
        if self.local:
            self.stack.stop()

"""Local launcher: one subprocess per episode, in its own process group and work directory.

Each episode gets `<state_dir>/runs/<run>/<episode>/` with `work/` (the harness's cwd; a copy of
the pristine repo for SWE tasks), `stdout.log` and `stderr.log` (the harness's own), `runner.log`
(the episode runner's), `proc.json` (pid, start time, deadline) and, once it ends, `exit.json`
(written by the episode runner) and `outcome.json`.
The files make the launcher restartable: a new controller relists the folder, adopts harnesses still
running (enforcing their deadline) and reads how the others ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from harnessrl.controller.launchers.base import (
    ExitCallback,
    ExitStatus,
    Launcher,
    LaunchError,
    LaunchRequest,
)
from harnessrl.controller.launchers.episode_logs import log_tail
from harnessrl.controller.launchers.forkserver import ForkServer, ForkServerError
from harnessrl.controller.launchers.process import ProcessFacts, alive, process_facts
from harnessrl.shared.log import get_logger
from harnessrl.shared.process import signal_group
from harnessrl.shared.taskpaths import check_base_commit, confined

# Environment the harness must never inherit from the controller (bus and signing credentials).
_PRIVATE_ENV_PREFIXES = ("HRL_", "NATS_")
_POLL_S = 0.2


def _checkout(workdir: Path, commit: str) -> None:
    """Leave the copied task repository at the instance's base commit and nothing else.

    Task repositories may hold other instances' snapshots (tags, branches): those could show the
    fix, so every other ref goes and unreachable objects are pruned.
    """
    steps = [
        ["git", "checkout", "-q", "--detach", "--force", commit],
        ["git", "for-each-ref", "--format=delete %(refname)"],
    ]
    _git(workdir, steps[0])
    refs = _git(workdir, steps[1])
    if refs:
        _git(workdir, ["git", "update-ref", "--stdin"], stdin=refs)
    _git(workdir, ["git", "reflog", "expire", "--expire=now", "--all"])
    _git(workdir, ["git", "gc", "-q", "--prune=now"])


def _git(workdir: Path, argv: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(argv, cwd=workdir, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ValueError(f"{' '.join(argv[:3])} failed in {workdir}: {done.stderr.strip()}")
    return done.stdout


def _harness_env() -> dict[str, str]:
    """This process's environment without bus and signing credentials."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_ENV_PREFIXES)}


class LocalLauncher(Launcher):
    """Runs harnesses as local processes under `root` (one folder per episode)."""

    kind = "local"

    def __init__(
        self,
        run: str,
        root: Path,
        *,
        tasks_dir: Path | None = None,
        kill_grace_s: float = 5.0,
        preload: list[str] | None = None,
    ) -> None:
        self._run = run
        self._root = root / "runs" / run
        self._forkserver = (
            ForkServer(preload, _harness_env(), root / "runs" / f"{run}.forkserver.log") if preload else None
        )
        self._tasks_dir = tasks_dir
        self._grace = kill_grace_s
        self._on_exit: ExitCallback | None = None
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._log = get_logger(__name__, run=run)

    def episode_dir(self, episode: str) -> Path:
        """The folder of one episode (work tree, logs, state files)."""
        return self._root / episode

    async def start(self, on_exit: ExitCallback) -> None:
        """Remember where to report ends."""
        self._root.mkdir(parents=True, exist_ok=True)
        self._on_exit = on_exit

    async def launch(self, request: LaunchRequest) -> str:
        """Start the harness through the episode runner; idempotent per episode."""
        folder = self.episode_dir(request.episode)
        marker = folder / "launch.json"
        if (folder / "proc.json").exists():
            return self._where(folder)
        if marker.exists():
            raise LaunchError("an earlier launch of this episode ended in an unknown state")
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_bytes(msgspec.json.encode({"at": time.time()}))
        deadline = time.time() + request.timeout_s
        try:
            workdir = self._prepare_workdir(request, folder)
            if self._forkserver is not None:
                pid = await self._forkserver.spawn(
                    request.command,
                    workdir,
                    self._episode_env(request, folder, workdir),
                    folder / "stdout.log",
                    folder / "stderr.log",
                )
                facts = process_facts(pid, deadline)
                watcher = self._adopt(request.episode, facts)
            else:
                process = await self._spawn(request, folder, workdir)
                facts = process_facts(process.pid, deadline)
                watcher = self._follow_child(request.episode, process, deadline)
        except (OSError, ValueError, ForkServerError) as exc:
            raise LaunchError(f"cannot start harness: {exc}") from exc
        (folder / "proc.json").write_bytes(msgspec.json.encode(facts))
        self._watchers[request.episode] = asyncio.create_task(watcher)
        self._log.info("harness.launched", episode=request.episode, pid=facts.pid)
        return f"pid:{facts.pid}"

    async def relist(self) -> dict[str, ExitStatus | None]:
        """How every episode under the run folder stands; adopts running ones."""
        found: dict[str, ExitStatus | None] = {}
        if not self._root.is_dir():
            return found
        for folder in sorted(self._root.iterdir()):
            status = self._read_status(folder)
            if status is None and folder.name not in self._watchers:
                facts = msgspec.json.decode((folder / "proc.json").read_bytes(), type=ProcessFacts)
                self._watchers[folder.name] = asyncio.create_task(self._adopt(folder.name, facts))
            found[folder.name] = None if status is None else self._with_evidence(folder, status)
        return found

    async def close(self) -> None:
        """Stop following; harnesses keep running and are adopted by the next controller."""
        for task in self._watchers.values():
            task.cancel()
        self._watchers.clear()
        if self._forkserver is not None:
            await self._forkserver.close()

    def _where(self, folder: Path) -> str:
        facts = msgspec.json.decode((folder / "proc.json").read_bytes(), type=ProcessFacts)
        return f"pid:{facts.pid}"

    def _prepare_workdir(self, request: LaunchRequest, folder: Path) -> Path:
        workdir = folder / "work"
        repo = (request.task.instance or {}).get("repo_path") if request.task.kind == "swe" else None
        if repo:
            source = confined(self._tasks_dir or Path.cwd(), str(repo))
            if not source.is_dir():
                raise ValueError(f"repo_path {source} is not a directory")
            shutil.copytree(source, workdir, symlinks=True, dirs_exist_ok=True)
            base = (request.task.instance or {}).get("base_commit")
            if base and (workdir / ".git").exists():
                _checkout(workdir, check_base_commit(str(base)))
        workdir.mkdir(exist_ok=True)
        return workdir

    def _episode_env(self, request: LaunchRequest, folder: Path, workdir: Path) -> dict[str, str]:
        env = _harness_env()
        env.update(request.env)
        env.update(request.secret_env)
        env["HARNESSRL_WORKDIR"] = str(workdir)
        env["HARNESSRL_EXIT_FILE"] = str(folder / "exit.json")
        env["HARNESSRL_RUNNER_LOG"] = str(folder / "runner.log")
        return env

    async def _spawn(self, request: LaunchRequest, folder: Path, workdir: Path) -> asyncio.subprocess.Process:
        env = self._episode_env(request, folder, workdir)
        command = [sys.executable, "-m", "harnessrl.controller.episode_runner", "--", *request.command]
        with (folder / "stdout.log").open("ab") as out, (folder / "stderr.log").open("ab") as err:
            return await asyncio.create_subprocess_exec(
                *command,
                cwd=workdir,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    async def _follow_child(self, episode: str, process: asyncio.subprocess.Process, deadline: float) -> None:
        try:
            code = await asyncio.wait_for(process.wait(), timeout=max(0.0, deadline - time.time()))
        except TimeoutError:
            await self._stop_group(process.pid, lambda: process.returncode is not None)
            await process.wait()
            status = ExitStatus(outcome="timeout", reason="deadline reached; harness stopped")
        else:
            status = _status_from_code(code)
        signal_group(process.pid, signal.SIGKILL)
        await self._finish(episode, status)

    async def _adopt(self, episode: str, facts: ProcessFacts) -> None:
        folder = self.episode_dir(episode)
        while alive(facts):
            if time.time() >= facts.deadline:
                await self._stop_group(facts.pid, lambda: not alive(facts))
                await self._stop_group(facts.pid, lambda: not alive(facts), sig=signal.SIGKILL)
                await self._finish(episode, ExitStatus(outcome="timeout", reason="deadline reached"))
                return
            await asyncio.sleep(_POLL_S)
        status = self._read_status(folder) or ExitStatus(
            outcome="infra", reason="harness process vanished without an exit status"
        )
        await self._finish(episode, status)

    async def _stop_group(
        self, pid: int, ended: Callable[[], bool], sig: signal.Signals = signal.SIGTERM
    ) -> None:
        """Send `sig` to the group, wait up to the grace period for the end, then SIGKILL."""
        signal_group(pid, sig)
        stop_at = time.monotonic() + self._grace
        # A process we did not start has no wait handle: poll /proc until it is gone.
        while time.monotonic() < stop_at and not ended():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        signal_group(pid, signal.SIGKILL)

    def _with_evidence(self, folder: Path, status: ExitStatus) -> ExitStatus:
        """The status with where the episode's logs are and, when it failed, its stderr's tail."""
        failed = status.outcome != "exited" or status.exit_code != 0
        detail = status.detail or (log_tail(folder / "stderr.log") if failed else "")
        return msgspec.structs.replace(status, detail=detail, logs=str(folder))

    async def _finish(self, episode: str, status: ExitStatus) -> None:
        folder = self.episode_dir(episode)
        status = self._with_evidence(folder, status)
        (folder / "outcome.json").write_bytes(msgspec.json.encode(status))
        self._watchers.pop(episode, None)
        self._log.info("harness.ended", episode=episode, outcome=status.outcome, code=status.exit_code)
        if self._on_exit is not None:
            await self._on_exit(episode, status)

    def _read_status(self, folder: Path) -> ExitStatus | None:
        """How an episode ended, from its files; None while its process still runs."""
        outcome, exit_file, proc = folder / "outcome.json", folder / "exit.json", folder / "proc.json"
        if outcome.exists():
            return msgspec.json.decode(outcome.read_bytes(), type=ExitStatus)
        if exit_file.exists():
            code = msgspec.json.decode(exit_file.read_bytes(), type=dict[str, int])["exit_code"]
            return _status_from_code(code)
        if not proc.exists():
            return ExitStatus(outcome="infra", reason="launch did not complete")
        facts = msgspec.json.decode(proc.read_bytes(), type=ProcessFacts)
        if alive(facts):
            return None
        with contextlib.suppress(FileNotFoundError):
            code = msgspec.json.decode(exit_file.read_bytes(), type=dict[str, int])["exit_code"]
            return _status_from_code(code)
        return ExitStatus(outcome="infra", reason="harness process vanished without an exit status")


# Why an episode whose harness the stopping deployment ended did not finish (retried on resume).
STOPPED_WITH_DEPLOYMENT = "the deployment stopped while the harness ran"


def _status_from_code(code: int) -> ExitStatus:
    if code < 0:
        return ExitStatus(outcome="infra", exit_code=code, reason=f"killed by signal {-code}")
    return ExitStatus(outcome="exited", exit_code=code)


def end_harnesses(state_dir: Path, grace_s: float = 5.0) -> int:
    """End every harness still running under a controller's state folder; how many ran.

    For a deployment stopping as a whole (the local stack): no controller will adopt them, and a
    harness left running would go on calling a gateway that is gone. Each episode's process group
    gets SIGTERM, and SIGKILL if it still runs after `grace_s`.

    Each one's `outcome.json` says first that the deployment ended it, so the controller of a resumed
    deployment retries the episode (an infra failure) instead of grading the runner's exit code 143.
    """
    running = {
        path.parent: facts
        for path in sorted(state_dir.glob("runs/*/*/proc.json"))
        if alive(facts := msgspec.json.decode(path.read_bytes(), type=ProcessFacts))
    }
    ended = msgspec.json.encode(ExitStatus(outcome="infra", reason=STOPPED_WITH_DEPLOYMENT))
    for folder, facts in running.items():
        (folder / "outcome.json").write_bytes(ended)
        signal_group(facts.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(f) for f in running.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for facts in running.values():
        if alive(facts):
            signal_group(facts.pid, signal.SIGKILL)
    return len(running)

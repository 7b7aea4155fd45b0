"""A fork server for local episodes of Python harnesses.

Starting a Python harness costs far more than the episode itself when the episode is short: the
interpreter starts, then imports its SDK (`import openai` alone is most of a CPU-second). A run of 64
two-turn episodes per step would spend most of its time importing. The fork server is a process
that has already imported the run's `preload` modules and the episode runner; for each episode
it forks a child that becomes its own session (process group), gets the episode's environment, work
directory and log files, and runs the episode runner, whose harness step forks once more and runs the
harness script as `__main__` (anything that is not `python script.py` is exec'ed as usual).

The children are not the controller's children: the local launcher follows them like adopted
processes (pid + start time, the exit file the episode runner writes). The server ignores SIGCHLD so
the kernel reaps them. Nothing here holds bus credentials: the server starts with the same scrubbed
environment as any harness.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path
from types import FrameType

from harnessrl.controller import episode_runner
from harnessrl.controller.errors import ControllerError


class ForkServerError(ControllerError):
    """The fork server could not start an episode."""


def _is_python_script(command: list[str]) -> bool:
    return len(command) >= 2 and Path(command[0]).name.startswith("python") and command[1].endswith(".py")


def _run_script(command: list[str]) -> int:
    """Run `python script.py args...` in this (forked) process as `__main__`; returns its exit code."""
    sys.argv = command[1:]
    try:
        runpy.run_path(command[1], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:  # noqa: BLE001 - report the harness's crash like an interpreter would
        traceback.print_exc()
        return 1
    return 0


def _exec(command: list[str]) -> int:
    """Replace this process with a non-Python harness; returns only when that fails."""
    try:
        os.execvp(command[0], command)  # noqa: S606 - the run spec's own harness command
    except OSError as exc:
        sys.stderr.write(f"cannot start harness {command[0]}: {exc}\n")
    return 127


def run_forked(command: list[str]) -> int:
    """The episode runner's harness step inside the fork server: fork, run, wait, forward signals."""
    pid = os.fork()
    if pid == 0:
        code = _run_script(command) if _is_python_script(command) else _exec(command)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def forward(signum: int, _frame: FrameType | None) -> None:
        os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _become_episode(request: dict[str, object]) -> None:
    """In the forked child: own session, the episode's files, directory and environment."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(str(request["stdout"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    err = os.open(str(request["stderr"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(str(request["cwd"]))
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})  # type: ignore[call-overload]


def spawn(request: dict[str, object]) -> int:
    """Fork one episode; returns its pid (the child never returns)."""
    pid = os.fork()
    if pid:
        return pid
    code = 70
    try:
        _become_episode(request)
        code = episode_runner.main(list(request["argv"]), runner=run_forked)  # type: ignore[call-overload]
    except BaseException:  # noqa: BLE001 - a child must never fall back into the server loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(preload: list[str]) -> None:
    """The server loop: one JSON request a line on stdin, one JSON answer a line on stdout."""
    for module in preload:
        importlib.import_module(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        try:
            answer: dict[str, object] = {"pid": spawn(json.loads(line))}
        except (OSError, ValueError, KeyError) as exc:
            answer = {"error": str(exc)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


class ForkServer:
    """The controller's handle on one fork server process (restarted if it dies)."""

    def __init__(self, preload: list[str], env: dict[str, str], log_path: Path) -> None:
        self.preload, self.env, self.log_path = preload, env, log_path
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def _ensure(self) -> asyncio.subprocess.Process:
        if self._process is not None and self._process.returncode is None:
            return self._process
        argv = [sys.executable, "-m", "harnessrl.controller.launchers.forkserver", *self.preload]
        with self.log_path.open("ab") as log:
            self._process = await asyncio.create_subprocess_exec(
                *argv, env=self.env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log
            )
        return self._process

    async def spawn(self, argv: list[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path) -> int:
        """Start one episode; returns its pid."""
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
        async with self._lock:
            process = await self._ensure()
            assert process.stdin is not None and process.stdout is not None  # noqa: S101 - pipes requested above
            process.stdin.write(json.dumps(request).encode() + b"\n")
            await process.stdin.drain()
            line = await process.stdout.readline()
        if not line:
            raise ForkServerError(f"fork server exited (see {self.log_path})")
        answer = json.loads(line)
        if "pid" not in answer:
            raise ForkServerError(f"fork server could not start the episode: {answer.get('error')}")
        return int(answer["pid"])

    async def close(self) -> None:
        """Stop the server (episodes it started keep running in their own sessions)."""
        if self._process is not None and self._process.returncode is None:
            assert self._process.stdin is not None  # noqa: S101 - pipe requested in _ensure
            self._process.stdin.close()
            await self._process.wait()


if __name__ == "__main__":
    serve(sys.argv[1:])

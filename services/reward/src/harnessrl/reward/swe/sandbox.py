"""The local sandbox: run one command over a workspace with a timeout, limits and no network.

Hardening (each probed once, reported in every result): a new network namespace (`unshare -n`,
so only a down loopback exists), an unprivileged user of its own (`setpriv` to a uid drawn for this
grading alone, so the command cannot write the pristine repositories, the grader's files or another
grading's workspace, and every process it leaves, even one in a session of its own, is killed when
the command ends), rlimits (address space, file size, processes of that user, CPU, no core dumps), a
scrubbed environment, its own process group killed whole on timeout, and output capped by the
file-size limit.

What the limits ask for, the sandbox gives or refuses (`SandboxUnavailableError`): model code never
runs with network access or as the grader's user because this machine could not isolate it. A
deployment that accepts less says so in its settings (`isolate_network`, `drop_privileges`);
`available_limits` is that choice made from what this machine can do, for local runs that log it.
"""

from __future__ import annotations

import asyncio
import os
import resource
import secrets
import subprocess
import time
from functools import cache
from pathlib import Path

import msgspec

from harnessrl.reward.errors import RewardError
from harnessrl.reward.settings import SandboxLimits
from harnessrl.shared.process import signal_group

NOBODY = 65534
# Gradings run as uids drawn from here, one per grading: no passwd entry, no files outside the
# grading's own workspace, and nothing else running as them.
GRADING_UIDS = range(1_000_000, 2_000_000)


class SandboxUnavailableError(RewardError):
    """The configured sandbox cannot be built here; grading refuses instead of running weaker."""


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one sandboxed command did."""

    exit_code: int
    timed_out: bool
    duration_s: float
    network_isolated: bool
    unprivileged: bool


@cache
def network_isolation_available() -> bool:
    """Whether `unshare -n` works here (needs root or user namespaces)."""
    return _probe(["unshare", "-n", "--", "true"])


@cache
def privilege_drop_available(python: str) -> bool:
    """Whether `python` can run pytest as nobody.

    That needs root, `setpriv`, and an interpreter nobody can reach (a virtualenv under a private
    home directory is not).
    """
    probe = [*_setpriv_prefix(), python, "-I", "-c", "import pytest"]
    return os.geteuid() == 0 and _probe(probe)


def missing_isolation(limits: SandboxLimits, python: str) -> list[str]:
    """The isolations `limits` asks for that this machine cannot give `python`, each with why."""
    missing = []
    if limits.isolate_network and not network_isolation_available():
        missing.append("isolate_network (`unshare -n` fails here: it needs root or user namespaces)")
    if limits.drop_privileges and not privilege_drop_available(python):
        missing.append(
            f"drop_privileges (running {python} as nobody fails here: it needs root, setpriv and an "
            "interpreter nobody can reach)"
        )
    return missing


def check_sandbox(limits: SandboxLimits, python: str) -> None:
    """Raise `SandboxUnavailableError` unless every isolation `limits` asks for is available."""
    missing = missing_isolation(limits, python)
    if missing:
        raise SandboxUnavailableError(
            "the sandbox is weaker than configured, so nothing is graded: "
            + "; ".join(missing)
            + ". Fix the machine, or turn the setting off to accept grading without it"
        )


def available_limits(limits: SandboxLimits, python: str) -> SandboxLimits:
    """`limits` with each isolation this machine cannot give turned off (an explicit choice)."""
    return msgspec.structs.replace(
        limits,
        isolate_network=limits.isolate_network and network_isolation_available(),
        drop_privileges=limits.drop_privileges and privilege_drop_available(python),
    )


def _probe(command: list[str]) -> bool:
    try:
        done = subprocess.run(command, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _setpriv_prefix(uid: int = NOBODY) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def confinement(limits: SandboxLimits, uid: int) -> list[str]:
    """The command prefix that runs a command without network and as `uid`, as `limits` ask."""
    network = ["unshare", "-n", "--"] if limits.isolate_network else []
    return network + (_setpriv_prefix(uid) if limits.drop_privileges else [])


def grading_uid() -> int:
    """A uid for one grading (concurrent gradings draw different ones but for a 1e-6 chance)."""
    return GRADING_UIDS.start + secrets.randbelow(len(GRADING_UIDS))


def _limit_child(limits: SandboxLimits) -> None:
    """Runs in the child between fork and exec: apply rlimits."""
    cpu = int(limits.timeout_s) + 5
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def base_environment(home: Path) -> dict[str, str]:
    """The only variables a sandboxed command sees (nothing from the grader's environment)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "TMPDIR": str(home),
    }


def give_to(root: Path, uid: int) -> None:
    """Hand a workspace to the grading's user so the sandboxed command can write there."""
    os.chown(root, uid, uid)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(folder, name), uid, uid, follow_symlinks=False)


async def kill_user(uid: int, python: str) -> None:
    """SIGKILL every process of `uid` (kill(-1) as that user: a fork racing it is caught too)."""
    if uid not in GRADING_UIDS:
        raise ValueError(f"uid {uid} is not a grading uid: killing all its processes could hit others")
    # ProcessLookupError: nothing of the uid was left to kill.
    code = (
        "import contextlib, os, signal\n"
        "with contextlib.suppress(ProcessLookupError):\n    os.kill(-1, signal.SIGKILL)"
    )
    quiet = asyncio.subprocess.DEVNULL
    killer = await asyncio.create_subprocess_exec(
        *_setpriv_prefix(uid), python, "-I", "-c", code, stdin=quiet, stdout=quiet, stderr=quiet
    )
    await killer.wait()


async def run_sandboxed(
    command: list[str],
    *,
    cwd: Path,
    log_path: Path,
    env: dict[str, str],
    limits: SandboxLimits,
    uid: int | None = None,
) -> RunResult:
    """Run `command` in `cwd` as `uid`, stdout and stderr to `log_path`, under `limits`.

    The first word of `command` is the grading interpreter; `uid` is a fresh grading uid unless
    given, and every process of it is killed when the command ends. Raises
    `SandboxUnavailableError` when an isolation `limits` asks for is not available.
    """
    check_sandbox(limits, command[0])
    uid = grading_uid() if uid is None else uid
    isolated, unprivileged = limits.isolate_network, limits.drop_privileges
    prefix = confinement(limits, uid)
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *prefix,
            *command,
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: _limit_child(limits),
        )
        timed_out = False
        try:
            exit_code = await asyncio.wait_for(process.wait(), timeout=limits.timeout_s)
        except TimeoutError:
            timed_out = True
            signal_group(process.pid)
            exit_code = await process.wait()
    signal_group(process.pid)  # leftovers a test may have spawned in the background
    if unprivileged:
        await kill_user(uid, command[0])  # and those that left the group (setsid, double fork)
    return RunResult(
        exit_code=exit_code,
        timed_out=timed_out,
        duration_s=time.monotonic() - started,
        network_isolated=isolated,
        unprivileged=unprivileged,
    )

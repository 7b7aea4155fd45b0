"""Child processes that die with the process that started them.

Every local process harnessrl supervises (nats-server, vLLM, the services) is started here, in its
own session (process group), so that stopping it can signal the whole group. On Linux the child also
asks the kernel for SIGTERM when its parent dies (`prctl(PR_SET_PDEATHSIG)`), so a `harnessrl up` or
`harnessrl train` that is killed with SIGKILL leaves nothing running: each child gets SIGTERM and
stops the way it stops on Ctrl-C (vLLM takes its engine process with it; the supervisor's stop is
not needed).

Two details make that reliable:

- The kernel sends the signal when the parent *thread* that forked the child exits, not the parent
  process. `spawn` therefore always forks from one thread that lives as long as this process, so a
  restart from a worker thread (e.g. `asyncio.to_thread`) does not tie the child to that thread.
- A parent that dies between `fork` and `prctl` would never signal: the child compares its parent
  pid with the one it was forked from and exits at once when they differ.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_PR_SET_PDEATHSIG = 1


def _new_spawner() -> ThreadPoolExecutor:
    """One thread that never exits before this process does: the children's kernel-level parent."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="harnessrl-spawn")


_spawner = _new_spawner()


def _after_fork() -> None:
    global _spawner  # noqa: PLW0603 - a forked child has no spawner thread: it needs its own
    _spawner = _new_spawner()


os.register_at_fork(after_in_child=_after_fork)


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
    prctl.restype = ctypes.c_int
    return prctl  # type: ignore[no-any-return]


# Resolved here, not in the child: between fork and exec the child should do as little as possible.
_PRCTL = _prctl()


def _die_with(parent: int) -> Callable[[], None] | None:
    """The child's pre-exec step: SIGTERM when `parent` dies, and exit now if it already has."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def pre_exec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return pre_exec


def spawn(argv: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(argv, **popen)` in a new session, tied to this process's lifetime."""
    pre_exec = _die_with(os.getpid())

    def start() -> subprocess.Popen[bytes]:
        # The pre-exec step only calls prctl (resolved before the fork) and getppid: nothing that
        # could wait on a lock another thread held at fork time.
        return subprocess.Popen(argv, start_new_session=True, preexec_fn=pre_exec, **popen)  # noqa: PLW1509

    return _spawner.submit(start).result()

"""The launcher interface: launch an episode, report its end once, relist after a restart."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec

from harnessrl.controller.errors import ControllerError
from harnessrl.shared.contracts import TaskSpec

Outcome = Literal["exited", "timeout", "infra"]


class LaunchError(ControllerError):
    """The harness could not be started (an infra failure: the episode is retried)."""


class LauncherUnavailableError(LaunchError):
    """The launcher's back end is unreachable right now: the launch is retried, not failed."""


class ExitStatus(msgspec.Struct, frozen=True, kw_only=True):
    """How a harness ended: it exited (with a code), hit its deadline, or the infrastructure failed."""

    outcome: Outcome
    exit_code: int | None = None
    reason: str = ""
    # The tail of the harness's stderr when it failed, and where its logs are (a folder, a Job).
    detail: str = ""
    logs: str = ""


class LaunchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to start one episode's harness.

    `secret_env` holds the episode key variables: the local launcher passes them as environment,
    the Kubernetes launcher stores them in a per-episode Secret and never in the Job template.
    """

    run: str
    episode: str
    task: TaskSpec
    attempt: int = 0
    command: list[str]
    env: dict[str, str] = msgspec.field(default_factory=dict)
    secret_env: dict[str, str] = msgspec.field(default_factory=dict)
    timeout_s: float = 600.0
    artifact_kind: Literal["patch", "answer"] = "answer"


ExitCallback = Callable[[str, ExitStatus], Awaitable[None]]


class Launcher(abc.ABC):
    """Starts harnesses for one run; reports each episode's end through the exit callback.

    The callback may be called more than once for an episode (a relist after a restart sees a
    finished episode again); the controller ignores repeats. `launch` is idempotent: launching an
    episode that already runs is not an error.
    """

    kind: str = "abstract"

    @abc.abstractmethod
    async def start(self, on_exit: ExitCallback) -> None:
        """Begin following the run's episodes; `on_exit` receives every end."""

    @abc.abstractmethod
    async def launch(self, request: LaunchRequest) -> str:
        """Start the harness; returns where it runs (a pid or Job name). Raises `LaunchError`."""

    @abc.abstractmethod
    async def relist(self) -> dict[str, ExitStatus | None]:
        """Every episode of the run this launcher knows: None while running, else how it ended."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop following (running harnesses are left alone)."""

"""Launchers: start one harness per episode and report how it ended, behind one interface."""

from harnessrl.controller.launchers.base import (
    ExitCallback,
    ExitStatus,
    Launcher,
    LaunchError,
    LauncherUnavailableError,
    LaunchRequest,
)

__all__ = [
    "ExitCallback",
    "ExitStatus",
    "LaunchError",
    "LaunchRequest",
    "Launcher",
    "LauncherUnavailableError",
]

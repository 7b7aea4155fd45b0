"""The controller's request-reply API on the bus: run submit/status, episode open/close.

Requests and replies are JSON on `hrl.ctl.controller.<verb>`; every reply has `ok` and, when not ok,
an `error` sentence meant for a person. Bring-your-own episodes (a harness someone starts
themselves) go through the same records, events, reward and rollouts as scheduled ones.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

import msgspec

from harnessrl.shared import subjects

SERVICE = "controller"
VERBS = ("submit", "status", "open", "close")


class SubmitRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Start a run from a validated spec (`tasks` must be readable by the controller)."""

    spec: dict[str, Any]


class StatusRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Phase counts of one run, or of every run."""

    run: str | None = None


class OpenRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Open a bring-your-own episode in `run` (on `task`, or the run's next task)."""

    run: str
    task: str | None = None


class CloseRequest(msgspec.Struct, frozen=True, kw_only=True):
    """End a bring-your-own episode; the key proves which episode it is."""

    key: str
    exit_code: int = 0
    artifact_b64: str | None = None
    kind: Literal["patch", "answer"] = "answer"

    def artifact(self) -> bytes | None:
        """The artifact bytes, if any were sent."""
        return base64.b64decode(self.artifact_b64) if self.artifact_b64 is not None else None


Request = SubmitRequest | StatusRequest | OpenRequest | CloseRequest


def subject(verb: str) -> str:
    """Subject of one control verb."""
    return subjects.control(SERVICE, verb)


def encode(request: Request) -> bytes:
    """A request as the JSON the controller decodes."""
    return msgspec.json.encode(request)


def reply(**fields: Any) -> bytes:
    """A successful reply."""
    return json.dumps({"ok": True, **fields}).encode()


def refusal(error: str) -> bytes:
    """A refused request's reply."""
    return json.dumps({"ok": False, "error": error}).encode()

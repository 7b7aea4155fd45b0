"""What the controller remembers per run and per episode (kept in the `hrl-episodes` KV bucket).

An episode moves scheduled -> started -> exited -> scored -> completed, or to failed with a cause,
and never leaves a terminal phase. Each record also says whether the bus messages its phase implies
were published (`published`): a restarted controller republishes exactly the unpublished ones,
under the same `Nats-Msg-Id`, so every event, and above all every terminal event, appears once.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from harnessrl.shared.contracts import ArtifactRef, FailureCause, RunSpec, RunStopped, now

Phase = Literal["scheduled", "started", "exited", "completed", "failed"]
TERMINAL_PHASES: frozenset[str] = frozenset({"completed", "failed"})
LIVE_PHASES: frozenset[str] = frozenset({"scheduled", "started"})
# Allowed moves; anything else is ignored as a stale or duplicate observation.
_NEXT: dict[str, frozenset[str]] = {
    "scheduled": frozenset({"started", "exited", "failed"}),
    "started": frozenset({"exited", "failed"}),
    "exited": frozenset({"completed", "failed"}),
    "completed": frozenset(),
    "failed": frozenset(),
}


class EpisodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt at one group member: its phase and everything its events carry."""

    run: str
    episode: str
    task: str
    group: str
    batch: int = 0
    slot: int = 0
    member: int = 0
    attempt: int = 0
    group_size: int = 1
    phase: Phase = "scheduled"
    published: bool = False
    byo: bool = False
    expected_version: int = 0
    where: str = ""
    exit_code: int | None = None
    artifact: ArtifactRef | None = None
    reward: float = 0.0
    details: dict[str, object] = msgspec.field(default_factory=dict)
    cause: FailureCause | None = None
    reason: str = ""
    # A failed harness's stderr tail and where its logs are (from the launcher).
    detail: str = ""
    logs: str = ""
    # A failed infra attempt names the attempt that replaces it.
    retried_as: str | None = None
    # The reward service published the terminal `failed(reward-error)` itself.
    terminal_by_reward: bool = False
    span_count: int = 0
    last_seq: int = -1
    versions_seen: list[int] = msgspec.field(default_factory=list)
    created_at: float = msgspec.field(default_factory=now)

    @property
    def terminal(self) -> bool:
        """Whether the episode reached completed or failed."""
        return self.phase in TERMINAL_PHASES

    def can_move_to(self, phase: Phase) -> bool:
        """Whether `phase` is a legal next phase from here."""
        return phase in _NEXT[self.phase]


class RunRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A submitted run: its spec and whether every episode of it has ended, or why it was stopped.

    A stopped run is never resumed. `stop_published` says whether its `RunStopped` reached the bus:
    a controller killed in between publishes it on restart, under the same `Nats-Msg-Id`.
    """

    spec: RunSpec
    state: Literal["active", "done", "stopped"] = "active"
    stopped: RunStopped | None = None
    stop_published: bool = False
    submitted_at: float = msgspec.field(default_factory=now)


def episode_key(run: str, episode: str) -> str:
    """KV key of an episode record."""
    return f"ep.{run}.{episode}"


def run_key(run: str) -> str:
    """KV key of a run record."""
    return f"run.{run}"


def episode_id(batch: int, slot: int, member: int, attempt: int) -> str:
    """The deterministic id of a scheduled attempt: a restart recomputes the same id."""
    return f"e{batch:04d}-{slot:03d}-{member:02d}-a{attempt}"


def group_id(batch: int, slot: int) -> str:
    """The deterministic id of a group (N attempts at one task in one batch)."""
    return f"g{batch:04d}-{slot:03d}"

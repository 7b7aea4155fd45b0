"""The bus messages an episode record's phase implies, with their deduplication keys.

Building them from the record alone (never from transient state) is what lets a restarted
controller republish an unpublished phase byte-for-byte under the same `Nats-Msg-Id`.
"""

from __future__ import annotations

from typing import Any

from harnessrl.controller.records import EpisodeRecord
from harnessrl.shared import subjects
from harnessrl.shared.bus import Outgoing
from harnessrl.shared.contracts import (
    AgentExited,
    EpisodeCompleted,
    EpisodeEventBase,
    EpisodeFailed,
    EpisodeRetried,
    EpisodeScheduled,
    EpisodeStarted,
    RolloutComplete,
    Sampling,
    TaskSpec,
)


def event_msg_id(record: EpisodeRecord, kind: str) -> str:
    """`Nats-Msg-Id` of a lifecycle event: one per episode and kind."""
    return f"{record.run}:{record.episode}:{kind}"


def outbox(
    record: EpisodeRecord,
    task: TaskSpec | None,
    launcher: str,
    sampling: Sampling,
    token_in: bool | None = None,
) -> list[Outgoing]:
    """Everything to publish for the record's current phase.

    `sampling` and `token_in` are the run's, for the gateway (`token_in` None: the gateway decides).
    """
    base: dict[str, Any] = {
        "run": record.run,
        "episode": record.episode,
        "task": record.task,
        "group": record.group,
        "attempt": record.attempt,
    }
    events: list[EpisodeEventBase] = []
    if record.phase == "scheduled":
        events.append(
            EpisodeScheduled(
                **base,
                launcher=launcher,
                expected_version=record.expected_version,
                sampling=sampling,
                token_in=token_in,
            )
        )
    elif record.phase == "started":
        events.append(EpisodeStarted(**base, where=record.where))
    elif record.phase == "exited":
        events.append(
            AgentExited(**base, exit_code=record.exit_code, artifact=record.artifact, task_spec=task)
        )
    elif record.phase == "completed":
        events.append(
            EpisodeCompleted(
                **base,
                reward=record.reward,
                span_count=record.span_count,
                last_seq=record.last_seq,
            )
        )
    elif not record.terminal_by_reward:
        events.append(
            EpisodeFailed(
                **base,
                cause=record.cause or "infra",
                reason=record.reason,
                detail=record.detail,
                logs=record.logs,
            )
        )
        if record.retried_as:
            events.append(EpisodeRetried(**base, new_episode=record.retried_as))
    items = [
        Outgoing(
            subject=subjects.episode_event(record.run, record.episode, event.__struct_config__.tag),  # type: ignore[arg-type]
            message=event,
            msg_id=event_msg_id(record, str(event.__struct_config__.tag)),
        )
        for event in events
    ]
    if record.terminal and not record.retried_as:
        items.append(_rollout(record))
    return items


def _rollout(record: EpisodeRecord) -> Outgoing:
    rollout = RolloutComplete(
        run=record.run,
        episode=record.episode,
        task=record.task,
        group=record.group,
        attempt=record.attempt,
        group_size=record.group_size,
        reward=record.reward if record.phase == "completed" else 0.0,
        span_count=record.span_count,
        last_seq=record.last_seq,
        versions_seen=record.versions_seen,
        admitted_version=record.expected_version,
        failure=record.cause if record.phase == "failed" else None,
        details=dict(record.details),
    )
    return Outgoing(
        subject=subjects.rollout(record.run),
        message=rollout,
        msg_id=f"{record.run}:{record.episode}:rollout",
    )

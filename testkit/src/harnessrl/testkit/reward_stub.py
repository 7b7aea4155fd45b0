"""A stand-in reward service for controller tests and the benchmark.

It consumes `agent_exited` events of a run and answers each with `scored` (reward 1.0 when the
uploaded answer equals the task's answer, else 0.0) or, for tasks listed in `reward_errors`, with
`failed(cause=reward-error)`, exactly as the real reward service publishes them.
"""

from __future__ import annotations

from typing import Any

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, ConsumerSpec, Delivery, Subscription
from harnessrl.shared.contracts import AgentExited, EpisodeFailed, EpisodeScored


class StubReward:
    """Scores a run's episodes from their answer artifacts."""

    def __init__(self, bus: Bus, run: str, *, reward_errors: frozenset[str] = frozenset()) -> None:
        self._bus, self._run, self._errors = bus, run, reward_errors
        self._subscription: Subscription | None = None
        self.scored = 0

    async def start(self) -> None:
        """Begin consuming the run's `agent_exited` events."""
        spec = ConsumerSpec(
            stream=subjects.EPISODES.name,
            filter_subject=subjects.episode_events_of_run(self._run, "agent_exited"),
            durable=f"stub-reward-{self._run}",
            batch=256,
        )
        self._subscription = await self._bus.subscribe(spec, self._on_exit)

    async def stop(self) -> None:
        """Stop consuming."""
        if self._subscription is not None:
            await self._subscription.stop()

    async def _on_exit(self, delivery: Delivery) -> None:
        event = delivery.decode(AgentExited)
        base: dict[str, Any] = {
            "run": event.run,
            "episode": event.episode,
            "task": event.task,
            "group": event.group,
            "attempt": event.attempt,
        }
        if event.task in self._errors:
            failed = EpisodeFailed(**base, cause="reward-error", reason="grader crashed")
            subject = subjects.episode_event(event.run, event.episode, "failed")
            await self._bus.publish(subject, failed, msg_id=f"{event.run}:{event.episode}:failed")
            return
        reward = 0.0
        if event.artifact is not None and event.artifact.object_name and event.task_spec is not None:
            data = await self._bus.get_object(subjects.ARTIFACTS_BUCKET, event.artifact.object_name)
            reward = float(data.decode().strip() == (event.task_spec.answer or "").strip())
        scored = EpisodeScored(**base, reward=reward)
        subject = subjects.episode_event(event.run, event.episode, "scored")
        await self._bus.publish(subject, scored, msg_id=f"{event.run}:{event.episode}:scored")
        self.scored += 1

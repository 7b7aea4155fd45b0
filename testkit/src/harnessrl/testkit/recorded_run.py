"""A recorded-looking training run of the demo task, published onto a real bus as the services would.

Every message is a `harnessrl.shared.contracts` message on its `harnessrl.shared.subjects` subject,
generated here from a seed (no stored blobs): for each step, groups of episodes of "What is a*b?"
with their lifecycle (scheduled, started, agent_exited, scored, completed), their LLM calls as the
gateway records them (ChatML encoded with the policy's tokenizer, token ids and logprobs; a `CALC`
turn, the calculator's `RESULT` and an `ANSWER`), the controller's rollouts, then the trainer's weight
version and step metrics, and every second step a held-out evaluation. The policy gets better step
by step. Each step also holds the cases a token view must tell apart: a retried call (a dead end), a
completion whose last logprobs are missing, a greedy call (sampling the loss can't model), an
episode whose harness failed and an infra failure retried as a new attempt. `publish_in_flight`
adds episodes of the next step still running.

    recorded = await publish_recorded_run(bus, "demo-run", tokenizer=tiny_model, steps=6)
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, Outgoing
from harnessrl.shared.contracts import (
    HELDOUT_GREEDY,
    HELDOUT_SAMPLED,
    AgentExited,
    ArtifactRef,
    EpisodeCompleted,
    EpisodeEventBase,
    EpisodeFailed,
    EpisodeRetried,
    EpisodeScheduled,
    EpisodeScored,
    EpisodeStarted,
    Span,
    StepMetrics,
    WeightVersion,
    event_kind,
)
from harnessrl.testkit.span_sequences import EpisodeRecorder

HELDOUT_EVERY = 2


def _user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


class RecordedRun:
    """Generates and publishes one run step by step; `counts` says what was published, by kind."""

    def __init__(
        self, run: str, tokenizer: Path, *, seed: int = 0, tasks_per_step: int = 4, group_size: int = 4
    ) -> None:
        from tokenizers import Tokenizer

        path = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
        self.tokenizer = Tokenizer.from_file(str(path))
        self.run = run
        self.rng = random.Random(seed)  # noqa: S311 (seeded test data, not secrets)
        self.tasks_per_step = tasks_per_step
        self.group_size = group_size
        self.step = 0
        self.clock = time.time() - 3600.0
        self.counts: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()  # grades published, by outcome
        # One finished episode per step that shows every token role (its id, newest step).
        self.showcase = ""
        self.in_flight: list[str] = []
        # What was published, to check a reader against: each episode's last lifecycle kind and spans.
        self.states: dict[str, str] = {}
        self.spans: dict[str, list[Span]] = {}
        self.heldout_steps: list[int] = []
        self._out: list[Outgoing] = []

    # --- one step -------------------------------------------------------------------------------

    def skill(self) -> float:
        """How often the policy answers right at the current step (the curve the page draws)."""
        return min(0.95, 0.3 + 0.6 * (1 - math.exp(-self.step / 3)))

    async def publish_step(self, bus: Bus) -> int:
        """One training step: its episodes, rollouts, weights and metrics; returns the step."""
        self.step += 1
        version = self.step - 1
        rewards: list[float] = []
        for task in range(self.tasks_per_step):
            a, b = self.rng.randrange(10, 100), self.rng.randrange(10, 100)
            group = f"s{self.step}-t{task}"
            for attempt in range(self.group_size):
                episode = f"{self.run}-{group}-a{attempt}"
                special = (task * self.group_size + attempt) % 8
                reward = self._episode(episode, group, attempt, a, b, version, special)
                if reward is not None:
                    rewards.append(reward)
        self._trainer_step(rewards)
        if self.step % HELDOUT_EVERY == 0:
            self._heldout()
        await self._flush(bus)
        return self.step

    def _episode(
        self, episode: str, group: str, attempt: int, a: int, b: int, version: int, special: int
    ) -> float | None:
        """One episode of the step; `special` picks the odd case it shows. Returns its reward."""
        task = f"mul-{a}x{b}"
        base: dict[str, Any] = {
            "run": self.run,
            "episode": episode,
            "task": task,
            "group": group,
            "attempt": attempt,
        }
        self._event(
            EpisodeScheduled(**base, expected_version=version, sampling={"temperature": 1.0}, at=self._tick())
        )
        self._event(
            EpisodeStarted(**base, where=f"local pid {4000 + self.rng.randrange(5000)}", at=self._tick())
        )
        if special == 7:
            self._event(
                EpisodeFailed(**base, cause="infra", reason="launcher lost the process", at=self._tick())
            )
            self._event(EpisodeRetried(**base, new_episode=f"{episode}-r1", at=self._tick()))
            return None
        recorder = EpisodeRecorder(self.run, episode)
        answer = self._calls(recorder, a, b, version, special)
        if special == 6:
            self._spans(recorder)
            self._event(
                EpisodeFailed(
                    **base, cause="agent", reason="harness exited 1", detail="Traceback ...", at=self._tick()
                )
            )
            return None
        reward = float(answer == a * b)
        self._spans(recorder)
        artifact = ArtifactRef(kind="answer", size=len(str(answer)), inline=str(answer).encode())
        self._event(AgentExited(**base, exit_code=0, artifact=artifact, at=self._tick()))
        # Now and then a wrong answer's grade is a detected forgery (reward 0 all the same).
        outcome = "forgery" if special == 5 and not reward else "graded"
        why = {"reason": "the failing canary test was reported passing"} if outcome == "forgery" else {}
        scored = EpisodeScored(
            **base, reward=reward, resolved=bool(reward), outcome=outcome, details=why, at=self._tick()
        )
        self._event(scored)
        self.outcomes[outcome] += 1
        spans = len(recorder.spans)
        self._event(
            EpisodeCompleted(**base, reward=reward, span_count=spans, last_seq=spans - 1, at=self._tick())
        )
        rollout = recorder.rollout(task=task, group=group, reward=reward, group_size=self.group_size)
        self._out.append(
            Outgoing(subject=subjects.rollout(self.run), message=rollout, msg_id=f"{episode}:complete")
        )
        self.counts["rollout"] += 1
        if special == 1:
            self.showcase = episode
        return reward

    def _calls(self, recorder: EpisodeRecorder, a: int, b: int, version: int, special: int) -> int:
        """The episode's LLM calls; returns the number it answered."""
        uses_tool = special in (1, 2) or self.rng.random() < self.skill()
        # Without the calculator the policy guesses; with it, it copies the RESULT.
        answer = a * b if self.rng.random() < 0.1 else a * b + self.rng.choice([-10, -1, 1, 10, 100])
        prompt = self._ids(_user(f"What is {a}*{b}?"))
        first = f"CALC {a}*{b}<|im_end|>" if uses_tool else f"ANSWER {answer}<|im_end|>"
        # In an async run weights change mid-episode: some episodes' first calls are a version behind.
        early = max(version - 1, 0) if special in (1, 4) else version
        if special == 1:  # the harness timed out on the first answer and re-sent the call: a dead end
            self._call(recorder, prompt, first, early)
        self._call(recorder, prompt, first, early, missing_tail=2 if special == 3 else 0)
        if not uses_tool:
            return answer
        context = prompt + self._ids(first) + self._ids("\n" + _user(f"RESULT {a * b}"))
        self._call(recorder, context, f"ANSWER {a * b}<|im_end|>", version, greedy=special == 2)
        return a * b

    def _call(
        self,
        recorder: EpisodeRecorder,
        prompt: list[int],
        text: str,
        version: int,
        *,
        missing_tail: int = 0,
        greedy: bool = False,
    ) -> None:
        """One call as the gateway records it, with the request's sampling and a plausible timing."""
        completion = self._ids(text)
        logprobs = [-self.rng.uniform(0.01, 2.5) * (1 - self.skill() / 2) for _ in completion]
        for index in range(len(completion) - missing_tail, len(completion)):
            logprobs[index] = float("nan")
        span = recorder.call(prompt, completion, logprobs=logprobs, version=version)
        latency = 0.05 + 0.01 * len(completion) + self.rng.random() * 0.05
        recorder.spans[-1] = msgspec.structs.replace(
            span, request={"temperature": 0.0 if greedy else 1.0, "max_tokens": 16}, model="tiny-qwen3",
            upstream="http://127.0.0.1:8000", started_at=self._tick(latency), latency_s=latency,
            ttft_s=latency / 3,
        )  # fmt: skip

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _tick(self, seconds: float = 0.02) -> float:
        self.clock += seconds
        return self.clock

    # --- the rest of the run --------------------------------------------------------------------

    def _trainer_step(self, rewards: list[float]) -> None:
        step = self.step
        stale = {"0": len(rewards)} if step < 3 else {"0": len(rewards) - 3, "1": 3}
        values = {
            "reward/mean": sum(rewards) / max(len(rewards), 1),
            "reward/pass_rate": sum(r > 0 for r in rewards) / max(len(rewards), 1),
            "perf/step_s": 0.6 + self.rng.random() * 0.2,
            "perf/tokens_per_s": 1500.0 + 120.0 * step + self.rng.random() * 80.0,
            "tokens/trained": float(len(rewards) * 14),
        }
        at = self._tick(0.6)
        weights = WeightVersion(
            run=self.run, version=step, step=step, checkpoint_uri=f"file:///ckpt/{step}", created_at=at
        )
        metrics = StepMetrics(run=self.run, step=step, version=step, values=values, staleness=stale, at=at)
        run = self.run
        self._out += [
            Outgoing(subject=subjects.weights(run), message=weights, msg_id=f"{run}:weights:{step}"),
            Outgoing(
                subject=subjects.metrics(run, subjects.TRAINER_SOURCE),
                message=metrics,
                msg_id=f"{run}:metrics:{step}",
            ),
        ]
        self.counts.update(weights=1, metrics=1)

    def _heldout(self) -> None:
        greedy = min(1.0, self.skill() + 0.03)
        values = {HELDOUT_GREEDY: greedy, HELDOUT_SAMPLED: greedy * 0.85}
        metrics = StepMetrics(run=self.run, step=self.step, version=self.step, values=values, at=self._tick())
        subject = subjects.metrics(self.run, subjects.HELDOUT_SOURCE)
        self._out.append(Outgoing(subject=subject, message=metrics, msg_id=f"{self.run}:heldout:{self.step}"))
        self.counts["metrics"] += 1
        self.heldout_steps.append(self.step)

    async def publish_in_flight(self, bus: Bus, count: int = 5) -> list[str]:
        """Episodes of the next step that still run: scheduled and started, some with a first call."""
        for index in range(count):
            a, b = self.rng.randrange(10, 100), self.rng.randrange(10, 100)
            episode, group = f"{self.run}-s{self.step + 1}-live{index}", f"s{self.step + 1}-live"
            base: dict[str, Any] = {
                "run": self.run,
                "episode": episode,
                "task": f"mul-{a}x{b}",
                "group": group,
            }
            self._event(EpisodeScheduled(**base, expected_version=self.step, at=self._tick()))
            self.in_flight.append(episode)
            if index % 3 == 2:
                continue
            self._event(EpisodeStarted(**base, where="local", at=self._tick()))
            if index % 2 == 0:
                recorder = EpisodeRecorder(self.run, episode)
                self._call(
                    recorder, self._ids(_user(f"What is {a}*{b}?")), f"CALC {a}*{b}<|im_end|>", self.step
                )
                self._spans(recorder)
        await self._flush(bus)
        return self.in_flight[-count:]

    def _event(self, event: EpisodeEventBase) -> None:
        kind = event_kind(event)
        subject = subjects.episode_event(self.run, event.episode, kind)
        self._out.append(Outgoing(subject=subject, message=event, msg_id=f"{event.episode}:{kind}"))
        self.counts["lifecycle"] += 1
        self.states[event.episode] = kind

    def _spans(self, recorder: EpisodeRecorder) -> None:
        for span in recorder.spans:
            self._out.append(
                Outgoing(subject=subjects.span(span.run, span.episode), message=span, msg_id=span.span_id)
            )
        self.counts["span"] += len(recorder.spans)
        self.spans.setdefault(recorder.episode, []).extend(recorder.spans)

    async def _flush(self, bus: Bus) -> None:
        out, self._out = self._out, []
        await bus.publish_batch(out)


async def publish_recorded_run(
    bus: Bus, run: str, *, tokenizer: Path, steps: int = 6, in_flight: int = 5, seed: int = 0
) -> RecordedRun:
    """Publish `steps` finished steps of a run and `in_flight` episodes of the next; returns the generator."""
    recorded = RecordedRun(run, tokenizer, seed=seed)
    for _ in range(steps):
        await recorded.publish_step(bus)
    await recorded.publish_in_flight(bus, in_flight)
    return recorded

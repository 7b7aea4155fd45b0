"""Recorded-looking span sequences: what the gateway would publish for a scripted episode.

Used by the tests (pathological harness behaviours) and the benchmark (a corpus of multi-turn
episodes). `EpisodeRecorder.call` encodes each prompt against the previous call exactly like the
gateway does (`harnessrl.shared.tokens.prompt_delta`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.contracts import Completion, RolloutComplete, Span
from harnessrl.shared.tokens import prompt_delta, span_context


class EpisodeRecorder:
    """Builds the spans of one episode call by call."""

    def __init__(self, run: str, episode: str) -> None:
        self.run = run
        self.episode = episode
        self.spans: list[Span] = []
        self._previous: tuple[str, list[int]] | None = None

    def call(
        self,
        prompt: Sequence[int],
        completion: Sequence[int],
        *,
        logprobs: Sequence[float] | None = None,
        version: int = 0,
        status: str = "ok",
        finish_reason: str = "stop",
    ) -> Span:
        """Record one LLM call: `prompt` in full, `completion` as sampled."""
        parent, parent_context = self._previous or (None, None)
        prefix_len, suffix = prompt_delta(parent_context, list(prompt))
        tokens = list(completion)
        span = Span(
            span_id=f"{self.episode}-s{len(self.spans)}",
            run=self.run,
            episode=self.episode,
            seq=len(self.spans),
            api="chat",
            status=status,  # type: ignore[arg-type]
            parent_span=parent,
            prefix_len=prefix_len,
            prompt_suffix_ids=suffix,
            prompt_len=len(prompt),
            completions=[
                Completion(
                    token_ids=tokens,
                    logprobs=list(logprobs) if logprobs is not None else [-1.0] * len(tokens),
                    finish_reason=finish_reason,
                )
            ]
            if tokens
            else [],
            weight_version_start=version,
            weight_version_end=version,
        )
        self.spans.append(span)
        self._previous = (span.span_id, span_context(list(prompt), span))
        return span

    def rollout(self, *, task: str, group: str, reward: float, group_size: int) -> RolloutComplete:
        """The controller's rollout-complete for this episode."""
        return RolloutComplete(
            run=self.run,
            episode=self.episode,
            task=task,
            group=group,
            group_size=group_size,
            reward=reward,
            span_count=len(self.spans),
            last_seq=len(self.spans) - 1,
            versions_seen=sorted({span.weight_version_start for span in self.spans}),
        )


def agent_episode(
    run: str, episode: str, rng: random.Random, *, turns: int, vocab: int = 500, version: int = 0
) -> list[Span]:
    """A well-behaved multi-turn agent episode: each prompt extends the previous context."""
    recorder = EpisodeRecorder(run, episode)
    context = [rng.randrange(vocab) for _ in range(rng.randint(16, 64))]
    for _ in range(turns):
        completion = [rng.randrange(vocab) for _ in range(rng.randint(8, 48))]
        recorder.call(context, completion, logprobs=[-rng.random() for _ in completion], version=version)
        tool_output = [rng.randrange(vocab) for _ in range(rng.randint(4, 32))]
        context = [*context, *completion, *tool_output]
    return recorder.spans


RecordedEpisode = tuple[EpisodeRecorder, RolloutComplete]


def coding_episode(
    run: str,
    episode: str,
    rng: random.Random,
    *,
    turns: int = 8,
    task_tokens: int = 1_024,
    completion_tokens: int = 96,
    tool_tokens: int = 3_872,
    logprob: float = -6.2,
) -> EpisodeRecorder:
    """A coding agent's shape: a task, `turns` short calls each followed by a long tool output, a last call.

    With the defaults the last prompt is 32,768 tokens (1,024 + 8 x (96 + 3,872)); ids stay in
    10..499 (inside the tiny model's vocabulary, clear of its specials) and `logprob` is about
    log(1/516), the tiny model's view of random tokens.
    """
    recorder = EpisodeRecorder(run, episode)
    context = [rng.randrange(10, 500) for _ in range(task_tokens)]
    for turn in range(turns + 1):
        completion = [rng.randrange(10, 500) for _ in range(completion_tokens)]
        recorder.call(context, completion, logprobs=[logprob] * completion_tokens)
        if turn < turns:
            context = [*context, *completion, *(rng.randrange(10, 500) for _ in range(tool_tokens))]
    return recorder


def record_group(
    run: str,
    group: str,
    rng: random.Random,
    *,
    size: int = 4,
    version: int = 0,
    turns: int = 2,
    prompt_tokens: int = 10,
    completion_tokens: int = 5,
) -> list[RecordedEpisode]:
    """`size` attempts at one task (alternating rewards 0/1), each a multi-turn episode."""
    prompt = [rng.randrange(10, 500) for _ in range(prompt_tokens)]
    episodes = []
    for attempt in range(size):
        recorder = EpisodeRecorder(run, f"{run}-{group}-a{attempt}")
        context = list(prompt)
        for _ in range(turns):
            completion = [rng.randrange(10, 500) for _ in range(completion_tokens)]
            recorder.call(context, completion, logprobs=[-6.0] * completion_tokens, version=version)
            context = [*context, *completion, rng.randrange(10, 500)]
        rollout = recorder.rollout(task=group, group=group, reward=float(attempt % 2), group_size=size)
        episodes.append((recorder, rollout))
    return episodes


async def publish_episodes(
    bus: Bus, episodes: Sequence[RecordedEpisode], *, publish_spans: bool = True
) -> None:
    """Publish spans (as the gateway does) and rollout-complete (as the controller does)."""
    for recorder, rollout in episodes:
        if publish_spans:
            for span in recorder.spans:
                await bus.publish(subjects.span(span.run, span.episode), span, msg_id=span.span_id)
        await bus.publish(subjects.rollout(rollout.run), rollout, msg_id=f"{rollout.episode}:complete")

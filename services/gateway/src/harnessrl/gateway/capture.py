"""What one call sampled, accumulated from a response body or from stream events.

The gateway asks vLLM for token ids and logprobs (see `apis`), copies them into a `Capture` and
removes them from what the client sees unless the client asked for them itself. A streamed call's
capture equals the non-streamed one: prompt ids arrive in the first chunk, token id and logprob
deltas in every chunk.
"""

from __future__ import annotations

from typing import Any

import msgspec

from harnessrl.shared.contracts import Completion, Usage


class Asked(msgspec.Struct, kw_only=True):
    """Which capture extras the client requested itself (those stay in its response)."""

    token_ids: bool = False
    logprobs: bool = False
    usage: bool = False
    response_messages: bool = False
    # Responses only: the client's request, whose fields its answer echoes (see `responses.Shape`).
    request: dict[str, Any] | None = None
    # Parts of the request not forwarded to vLLM, by kind (counted in the gateway's metrics).
    left_out: dict[str, int] = msgspec.field(default_factory=dict)


class ChoiceCapture:
    """Token ids, logprobs, text and finish reason of one choice."""

    __slots__ = ("finish_reason", "logprobs", "text", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text: list[str] = []
        self.finish_reason: str | None = None

    def add(self, token_ids: Any, logprobs: list[float], text: Any) -> None:
        """Append one delta (a whole non-streamed choice is one delta)."""
        if isinstance(token_ids, list):
            self.token_ids.extend(token_ids)
            # Echo prepends prompt logprobs: keep the ones of the sampled tokens.
            if len(logprobs) > len(token_ids):
                logprobs = logprobs[len(logprobs) - len(token_ids) :]
        self.logprobs.extend(logprobs)
        if isinstance(text, str):
            self.text.append(text)

    def completion(self) -> Completion:
        """The frozen contract form."""
        logprobs = self.logprobs if len(self.logprobs) == len(self.token_ids) else []
        return Completion(
            token_ids=self.token_ids,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            text="".join(self.text),
        )


class Capture:
    """Everything the span needs from the upstream's answer."""

    __slots__ = ("choices", "model", "prompt_ids", "usage")

    def __init__(self) -> None:
        self.prompt_ids: list[int] | None = None
        self.choices: dict[int, ChoiceCapture] = {}
        self.usage = Usage()
        self.model = ""

    def choice(self, index: Any) -> ChoiceCapture:
        """The accumulator of choice `index` (created on first use)."""
        key = index if isinstance(index, int) else 0
        found = self.choices.get(key)
        if found is None:
            found = self.choices[key] = ChoiceCapture()
        return found

    def set_prompt(self, ids: Any) -> None:
        """Record the prompt ids the first time they appear."""
        if self.prompt_ids is None and isinstance(ids, list):
            self.prompt_ids = ids

    def set_usage(self, usage: Any, *, anthropic: bool = False) -> None:
        """Record usage from an OpenAI (`prompt_tokens`) or Anthropic (`input_tokens`) object."""
        if not isinstance(usage, dict):
            return
        prompt_key, completion_key = (
            ("input_tokens", "output_tokens") if anthropic else ("prompt_tokens", "completion_tokens")
        )
        prompt = usage.get(prompt_key) or self.usage.prompt_tokens
        completion = usage.get(completion_key) or self.usage.completion_tokens
        self.usage = Usage(prompt_tokens=int(prompt), completion_tokens=int(completion))

    def completions(self) -> list[Completion]:
        """Choices in index order."""
        return [self.choices[i].completion() for i in sorted(self.choices)]

    def context_ids(self) -> list[int] | None:
        """Prompt + first completion: what the episode's next call is delta-encoded against."""
        if self.prompt_ids is None:
            return None
        first = self.choices.get(min(self.choices)) if self.choices else None
        return [*self.prompt_ids, *(first.token_ids if first else [])]


def content_logprobs(logprobs: Any) -> list[float]:
    """Sampled-token logprobs from a chat `logprobs` object (`{"content": [{"logprob": ..}]}`)."""
    if not isinstance(logprobs, dict):
        return []
    content = logprobs.get("content")
    if not isinstance(content, list):
        return []
    return [float(item["logprob"]) for item in content if isinstance(item, dict)]


def token_logprobs(logprobs: Any) -> list[float]:
    """Sampled-token logprobs from a completions `logprobs` object (`token_logprobs`)."""
    if not isinstance(logprobs, dict):
        return []
    values = logprobs.get("token_logprobs")
    if not isinstance(values, list):
        return []
    return [float(v) if v is not None else 0.0 for v in values]

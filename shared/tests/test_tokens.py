"""Delta encoding of prompts: encode with `prompt_delta`, decode with `reconstruct_prompts`."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.shared.contracts import Completion, Span
from harnessrl.shared.tokens import (
    TokenDeltaError,
    common_prefix_len,
    prompt_delta,
    reconstruct_prompts,
    span_context,
)


def _span(
    span_id: str,
    prompt: list[int],
    completion: list[int],
    parent: Span | None,
    parent_prompt: list[int] | None,
    seq: int = 0,
) -> Span:
    parent_ids = None
    if parent is not None and parent_prompt is not None:
        parent_ids = span_context(parent_prompt, parent)
    prefix_len, suffix = prompt_delta(parent_ids, prompt)
    return Span(
        span_id=span_id,
        run="r",
        episode="e",
        seq=seq,
        api="chat",
        parent_span=parent.span_id if parent else None,
        prefix_len=prefix_len,
        prompt_suffix_ids=suffix,
        prompt_len=len(prompt),
        completions=[Completion(token_ids=completion, logprobs=[0.0] * len(completion))],
    )


def _episode(prompts: list[list[int]], completions: list[list[int]]) -> list[Span]:
    spans: list[Span] = []
    parent: Span | None = None
    parent_prompt: list[int] | None = None
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        span = _span(f"s{i}", prompt, completion, parent, parent_prompt, seq=i)
        spans.append(span)
        parent, parent_prompt = span, prompt
    return spans


def test_common_prefix_len() -> None:
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_len([1, 2, 3], [1, 2]) == 2
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix_len([5], [6]) == 0


def test_first_call_stores_the_whole_prompt() -> None:
    assert prompt_delta(None, [1, 2, 3]) == (0, [1, 2, 3])
    assert prompt_delta([], [1, 2]) == (0, [1, 2])


def test_growing_conversation_stores_only_new_tokens() -> None:
    prompt1 = [1, 2, 3]
    completion1 = [10, 11]
    prompt2 = [*prompt1, *completion1, 20, 21]
    spans = _episode([prompt1, prompt2], [completion1, [30]])
    assert spans[1].prefix_len == 5
    assert spans[1].prompt_suffix_ids == [20, 21]
    assert reconstruct_prompts(spans) == {"s0": prompt1, "s1": prompt2}


def test_rerendered_history_keeps_only_the_common_prefix() -> None:
    prompt1 = [1, 2, 3]
    prompt2 = [1, 2, 7, 8, 9]  # the harness rewrote the last turn
    spans = _episode([prompt1, prompt2], [[4, 5], [6]])
    assert spans[1].prefix_len == 2
    assert reconstruct_prompts(reversed(spans)) == {"s0": prompt1, "s1": prompt2}


def test_missing_parent_is_an_error() -> None:
    spans = _episode([[1], [1, 2, 3]], [[2], [4]])
    with pytest.raises(TokenDeltaError, match="missing parent"):
        reconstruct_prompts(spans[1:])


def test_length_mismatch_is_an_error() -> None:
    span = _episode([[1, 2]], [[3]])[0]
    bad = Span(**{**_fields(span), "prompt_len": 5})
    with pytest.raises(TokenDeltaError, match="decodes to 2"):
        reconstruct_prompts([bad])


def test_cycle_is_an_error() -> None:
    a = Span(span_id="a", run="r", episode="e", seq=0, api="chat", parent_span="b", prefix_len=0)
    b = Span(span_id="b", run="r", episode="e", seq=1, api="chat", parent_span="a", prefix_len=0)
    with pytest.raises(TokenDeltaError, match="cyclic"):
        reconstruct_prompts([a, b])


def test_prefix_without_parent_is_an_error() -> None:
    span = Span(span_id="a", run="r", episode="e", seq=0, api="chat", prefix_len=2, prompt_len=2)
    with pytest.raises(TokenDeltaError, match="no parent"):
        reconstruct_prompts([span])


def test_long_episode_stores_linear_tokens() -> None:
    rng = random.Random(7)
    prompt: list[int] = [rng.randrange(1000) for _ in range(50)]
    prompts, completions = [], []
    for _ in range(200):
        completion = [rng.randrange(1000) for _ in range(20)]
        prompts.append(prompt)
        completions.append(completion)
        prompt = [*prompt, *completion, *[rng.randrange(1000) for _ in range(30)]]
    spans = _episode(prompts, completions)
    stored = sum(len(s.prompt_suffix_ids) for s in spans)
    assert stored == len(prompts[-1]) - 20 * 199  # every token once, minus the sampled ones
    decoded = reconstruct_prompts(spans)
    assert [decoded[f"s{i}"] for i in range(200)] == prompts


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 5), max_size=8),
            st.integers(0, 20),
            st.lists(st.integers(0, 5), max_size=6),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_any_conversation_round_trips(turns: list[tuple[list[int], int, list[int]]]) -> None:
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    previous: list[int] = []
    for extra, keep, completion in turns:
        prompt = [*previous[:keep], *extra]
        prompts.append(prompt)
        completions.append(completion)
        previous = [*prompt, *completion]
    spans = _episode(prompts, completions)
    decoded = reconstruct_prompts(spans)
    assert [decoded[s.span_id] for s in spans] == prompts


def _fields(span: Span) -> dict[str, object]:
    return {f: getattr(span, f) for f in span.__struct_fields__}

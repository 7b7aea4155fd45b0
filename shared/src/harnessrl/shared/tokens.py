"""Delta encoding of prompt token ids across the calls of one episode.

An agent's calls grow one conversation: each prompt usually starts with the previous prompt plus the
previous completion. Storing every prompt in full costs O(turns x context); the gateway stores each
span's prompt as a delta against the episode's previous span instead (`Span.parent_span`,
`Span.prefix_len`, `Span.prompt_suffix_ids`), which costs O(context) per episode.

The rule shared by the encoder (gateway) and every decoder (trainer, analytics):

    context(span) = prompt(span) + span.completions[0].token_ids   (just the prompt if no choice)
    prompt(span)  = context(parent)[:prefix_len] + prompt_suffix_ids   (suffix only if no parent)

`prefix_len` is the longest common prefix of the parent's context and the new prompt, so the
encoding is exact whatever the harness did to the conversation (re-rendered, truncated, forked).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from harnessrl.shared.contracts import Span


class TokenDeltaError(ValueError):
    """Spans can't be decoded: a parent is missing, a chain is cyclic or a length disagrees."""


def common_prefix_len(left: Sequence[int], right: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    limit = min(len(left), len(right))
    if left[:limit] == right[:limit]:
        return limit
    low, high = 0, limit
    # Binary search on prefix equality: slices compare in C, so this beats a Python loop.
    while low < high:
        mid = (low + high + 1) // 2
        if left[:mid] == right[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def prompt_delta(parent_ids: Sequence[int] | None, prompt_ids: Sequence[int]) -> tuple[int, list[int]]:
    """Encode `prompt_ids` against the parent's context: `(prefix_len, suffix_ids)`.

    `parent_ids` is the parent's context (its prompt followed by its first completion), or None
    for an episode's first call, which stores the whole prompt as the suffix.
    """
    if not parent_ids:
        return 0, list(prompt_ids)
    prefix_len = common_prefix_len(parent_ids, prompt_ids)
    return prefix_len, list(prompt_ids[prefix_len:])


def span_context(prompt_ids: Sequence[int], span: Span) -> list[int]:
    """Return a span's context: its prompt followed by its first completion's token ids."""
    completion = span.completions[0].token_ids if span.completions else []
    return [*prompt_ids, *completion]


def reconstruct_prompts(spans: Iterable[Span]) -> dict[str, list[int]]:
    """Decode the full prompt token ids of every span, keyed by span id.

    Spans may come in any order (parents are resolved first). Raises `TokenDeltaError` when a
    parent is not among `spans`, when parents form a cycle, or when a decoded prompt's length
    differs from the recorded `prompt_len`.
    """
    by_id = {span.span_id: span for span in spans}
    prompts: dict[str, list[int]] = {}
    for span_id in by_id:
        _resolve(span_id, by_id, prompts)
    return prompts


def _resolve(span_id: str, by_id: dict[str, Span], prompts: dict[str, list[int]]) -> None:
    """Decode `span_id` and any undecoded ancestors, oldest first (iterative: chains are long)."""
    chain: list[Span] = []
    current: str | None = span_id
    seen: set[str] = set()
    while current is not None and current not in prompts:
        if current in seen:
            raise TokenDeltaError(f"span {span_id} has a cyclic parent chain")
        seen.add(current)
        span = by_id.get(current)
        if span is None:
            raise TokenDeltaError(f"span {chain[-1].span_id} has missing parent {current}")
        chain.append(span)
        current = span.parent_span
    for span in reversed(chain):
        prompts[span.span_id] = _decode_one(span, by_id, prompts)


def _decode_one(span: Span, by_id: dict[str, Span], prompts: dict[str, list[int]]) -> list[int]:
    parent = span.parent_span
    return decode_prompt(span, None if parent is None else span_context(prompts[parent], by_id[parent]))


def decode_prompt(span: Span, parent_context: Sequence[int] | None) -> list[int]:
    """Decode one span's prompt from its parent's context (None for a span without a parent).

    Raises `TokenDeltaError` when the span does not fit that context or its recorded `prompt_len`.
    """
    if span.parent_span is None:
        if span.prefix_len:
            raise TokenDeltaError(f"span {span.span_id} has prefix_len but no parent")
        prefix: Sequence[int] = []
    elif parent_context is None:
        raise TokenDeltaError(f"span {span.span_id} needs the context of its parent {span.parent_span}")
    else:
        if span.prefix_len > len(parent_context):
            raise TokenDeltaError(f"span {span.span_id} prefix_len exceeds its parent's context")
        prefix = parent_context[: span.prefix_len]
    prompt = [*prefix, *span.prompt_suffix_ids]
    if len(prompt) != span.prompt_len:
        raise TokenDeltaError(
            f"span {span.span_id} decodes to {len(prompt)} prompt tokens, recorded {span.prompt_len}"
        )
    return prompt

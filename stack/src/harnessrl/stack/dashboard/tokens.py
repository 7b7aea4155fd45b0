"""The token view of an episode: each call's tokens, marked as the trainer would train them.

The trainer's own `build_rows` decides; nothing here re-implements its rules. Rows say which
tokens carry loss but not which call a token came from or why an untrained one is not trained, so
the rows are built once per prefix of the episode's calls and each call gets what its arrival
changed in the `BuildReport`: its own tokens are trained (with the weight version that sampled
them), or skipped, prompt_too_long, unmodeled_sampling (all of the completion), or a trained prefix
followed by missing_logprob and truncated tails. A later retry turns the retried call's trained
tokens into a dead end (the report's `dead_end_tokens` grows when the retry arrives; the call it
retried is the latest earlier one with the same prompt). What a call adds to the prompt (its
`prompt_suffix_ids`) is context. When the marked tokens don't add up to the report of the whole
episode, the view says so (`consistent`), rather than showing a guess as fact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from harnessrl.shared.contracts import Span
from harnessrl.shared.tokens import reconstruct_prompts
from harnessrl.stack.replay import by_seq
from harnessrl.trainer.samples import MISMATCH_KINDS, BuildReport, build_rows
from harnessrl.trainer.sampling import run_temperature
from harnessrl.trainer.settings import SampleLimits

TokenRole = Literal["trained", "context", "masked"]
# Why a sampled token trains in no row (`BuildReport.<reason>_tokens`, `tokens/<reason>` in metrics).
MASK_REASONS = (
    "skipped", "prompt_too_long", "unmodeled_sampling", "missing_logprob", "truncated", "dead_end",
)  # fmt: skip
# The most prompt tokens a call shows (its last ones): a coding agent's tool output runs to thousands.
MAX_CONTEXT_SHOWN = 160


class Token(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One token as shown: id, text, role, the version that sampled it (trained only), mask reason."""

    id: int
    text: str
    role: TokenRole
    version: int | None = None
    reason: str | None = None


class CallTokens(msgspec.Struct, kw_only=True):
    """One call (span): what it added to the prompt, what it sampled, and how rows took it."""

    seq: int
    span_id: str
    status: str
    weight_version: int
    # `extends` (joins an open row), `new` (the first row) or the break class that started a row.
    row: str
    context_hidden: int
    context: list[Token]
    completion: list[Token]
    counts: dict[str, int]


class TokenView(msgspec.Struct, kw_only=True):
    """The calls of one episode shown (the last `shown` of `calls`), and whether the marks add up."""

    run: str
    episode: str
    calls: int
    shown: int
    trained_tokens: int
    untrained_by_reason: dict[str, int]
    consistent: bool
    spans: list[CallTokens]


Decode = Callable[[int], str]
# A sampled token's role and, when masked, why.
Mark = tuple[TokenRole, str | None]
TRAINED: Mark = ("trained", None)


def _delta(after: BuildReport, before: BuildReport) -> dict[str, int]:
    """How many tokens of each mask reason the newest call added."""
    return {
        reason: getattr(after, f"{reason}_tokens") - getattr(before, f"{reason}_tokens")
        for reason in MASK_REASONS
    }


def _break(after: BuildReport, before: BuildReport, first: bool) -> str:
    """Whether the newest call extended a row, or which break class made it start one."""
    for kind in MISMATCH_KINDS:
        if after.mismatches.get(kind, 0) > before.mismatches.get(kind, 0):
            return kind
    return "new" if first else "extends"


def _marks(span: Span, added: dict[str, int]) -> list[Mark]:
    """The role (and mask reason) of each token of the call's first completion."""
    count = len(span.completions[0].token_ids) if span.completions else 0
    for whole in ("skipped", "prompt_too_long", "unmodeled_sampling"):
        if added[whole]:
            return [_masked(whole)] * count
    fitted = count - added["truncated"]
    trained = fitted - added["missing_logprob"]
    return (
        [TRAINED] * trained
        + [_masked("missing_logprob")] * (fitted - trained)
        + [_masked("truncated")] * (count - fitted)
    )


def _masked(reason: str) -> Mark:
    return ("masked", reason)


def episode_tokens(
    run: str,
    episode: str,
    spans: Sequence[Span],
    decode: Decode,
    *,
    limits: SampleLimits | None = None,
    last: int = 8,
) -> TokenView:
    """The token view of an episode's calls (in seq order, one per seq), the last `last` shown."""
    limits = limits or SampleLimits()
    ordered = by_seq(spans)
    prompts = reconstruct_prompts(ordered)
    temperature = run_temperature(ordered)
    reports = [
        build_rows(episode, ordered[:k], limits, temperature=temperature)[1] for k in range(len(ordered) + 1)
    ]
    marks, rows = [], []
    for k, span in enumerate(ordered):
        added = _delta(reports[k + 1], reports[k])
        marks.append(_marks(span, added))
        rows.append(_break(reports[k + 1], reports[k], k == 0))
        if added["dead_end"]:
            _mark_dead_end(ordered, prompts, marks, k)
    final = reports[-1]
    trained = sum(role == "trained" for call in marks for role, _ in call)
    untrained = {reason: getattr(final, f"{reason}_tokens") for reason in MASK_REASONS}
    marked = {reason: sum(why == reason for call in marks for _, why in call) for reason in MASK_REASONS}
    shown = [
        _call(span, prompts[span.span_id], marks[k], rows[k], decode)
        for k, span in enumerate(ordered)
        if k >= len(ordered) - last
    ]
    return TokenView(
        run=run, episode=episode, calls=len(ordered), shown=len(shown), trained_tokens=final.trained_tokens,
        untrained_by_reason=untrained, consistent=trained == final.trained_tokens and marked == untrained,
        spans=shown,
    )  # fmt: skip


def _mark_dead_end(
    ordered: Sequence[Span],
    prompts: dict[str, list[int]],
    marks: list[list[Mark]],
    k: int,
) -> None:
    """Call `k` retried an earlier call (same prompt): that call's trained tokens become a dead end."""
    prompt = prompts[ordered[k].span_id]
    for j in range(k - 1, -1, -1):
        if prompts[ordered[j].span_id] == prompt and any(role == "trained" for role, _ in marks[j]):
            marks[j] = [
                ("masked", "dead_end") if role == "trained" else (role, why) for role, why in marks[j]
            ]
            return


def _call(span: Span, prompt: list[int], marks: list[Mark], row: str, decode: Decode) -> CallTokens:
    """One call's tokens for the page."""
    added = prompt[span.prefix_len :] if span.parent_span else prompt
    shown = added[-MAX_CONTEXT_SHOWN:]
    version = span.weight_version_start
    sampled = span.completions[0].token_ids if span.completions else []
    completion = [
        Token(id=tid, text=decode(tid), role=role, version=version if role == "trained" else None, reason=why)
        for tid, (role, why) in zip(sampled, marks, strict=True)
    ]
    counts = {"context": len(added), "trained": sum(t.role == "trained" for t in completion)}
    for token in completion:
        if token.reason:
            counts[token.reason] = counts.get(token.reason, 0) + 1
    return CallTokens(
        seq=span.seq, span_id=span.span_id, status=span.status, weight_version=version, row=row,
        context_hidden=len(added) - len(shown), completion=completion, counts=counts,
        context=[Token(id=t, text=decode(t), role="context") for t in shown],
    )  # fmt: skip


def id_decoder(tokenizer_path: str | None) -> Decode:
    """Token id -> text with the policy's tokenizer (`tokenizer.json` or its folder), else `#id`."""
    if tokenizer_path is None:
        return lambda tid: f"#{tid}"
    from pathlib import Path

    from tokenizers import Tokenizer

    path = Path(tokenizer_path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    cache: dict[int, str] = {}

    def decode(tid: int) -> str:
        if tid not in cache:
            cache[tid] = (
                tokenizer.decode([tid], skip_special_tokens=False) or tokenizer.id_to_token(tid) or f"#{tid}"
            )
        return cache[tid]

    return decode

"""Sample building: turn one rollout's spans into training rows, training only sampled tokens.

A row is one token sequence the policy is trained on: a prompt (context, loss mask 0) followed by
a response region where the tokens vLLM sampled carry loss mask 1, their rollout logprobs and the
weight version that sampled them, and everything else (tool output, user turns) is context.

Merge rule: a call joins an open row when its prompt starts with that row's whole sequence (exact
token prefix); the tokens between are context. Several rows stay open, so a sub-agent interleaving
its calls with the main conversation extends its own row. A prompt that extends no open row starts
a new row; the reason is classified against the open row it shares the longest prefix with:

- `retry`: the prompt equals that row's last prompt: the harness re-sent the call.
- `template_dropped`: the last prompt survives but the re-rendered model turn lacks a leading part
  of what was sampled (a template that drops past reasoning).
- `retokenized`: the last prompt survives but the model turn was re-rendered or re-tokenized into
  different ids (a tool call serialised differently).
- `rewrote_history`: the divergence is before the last model turn: the harness edited history.
- `branch`: the prompt shares less than the row's first prompt: another conversation (sub-agent).

In a new row the whole prompt is context, so a re-rendered model turn is never trained (mask 0):
only ids we hold as sampled get mask 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec

from harnessrl.shared.contracts import Span
from harnessrl.shared.tokens import common_prefix_len, reconstruct_prompts
from harnessrl.trainer.settings import SampleLimits

MISMATCH_KINDS = ("retry", "template_dropped", "retokenized", "rewrote_history", "branch")


class TrainingRow(msgspec.Struct, kw_only=True):
    """One training sequence of a rollout (verl layout: prompt, then response region).

    `loss_mask`, `logprobs` and `versions` cover the response region only
    (`input_ids[prompt_len:]`); `versions` is -1 where the mask is 0. `temperature` is the one
    every trained token of the row was sampled at.
    """

    rollout_id: str
    input_ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    truncated: bool = False
    temperature: float = 1.0

    @property
    def trained_tokens(self) -> int:
        """How many tokens carry loss in this row."""
        return sum(self.loss_mask)


class BuildReport(msgspec.Struct, kw_only=True):
    """What sample building saw in one rollout: rows, mismatches by kind, dropped tokens."""

    rows: int = 0
    mismatches: dict[str, int] = msgspec.field(default_factory=dict)
    skipped_spans: int = 0
    prompt_too_long: int = 0
    truncated_rows: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0


class _OpenRow:
    """A row being extended: its sequence, where its first and last prompts end."""

    __slots__ = ("first_prompt_len", "last_completion", "row")

    def __init__(self, row: TrainingRow) -> None:
        self.row = row
        self.first_prompt_len = row.prompt_len
        self.last_completion: list[int] = []

    @property
    def ids(self) -> list[int]:
        return self.row.input_ids


def build_rows(
    rollout_id: str, spans: Sequence[Span], limits: SampleLimits | None = None
) -> tuple[list[TrainingRow], BuildReport]:
    """Build the training rows of one rollout from its spans (any order; sorted by seq here)."""
    limits = limits or SampleLimits()
    ordered = sorted(spans, key=lambda span: span.seq)
    prompts = reconstruct_prompts(ordered)
    report = BuildReport()
    mismatches: Counter[str] = Counter()
    open_rows: list[_OpenRow] = []
    rows: list[TrainingRow] = []
    for span in ordered:
        if span.status != "ok" or not span.completions or not span.completions[0].token_ids:
            report.skipped_spans += 1
            continue
        prompt = prompts[span.span_id]
        target = _extendable(open_rows, prompt)
        if target is None:
            if open_rows:
                mismatches[classify_mismatch(open_rows, prompt)] += 1
            if len(prompt) > limits.max_prompt_len:
                report.prompt_too_long += 1
                continue
            target = _OpenRow(_new_row(rollout_id, prompt))
            open_rows.append(target)
            rows.append(target.row)
        else:
            _append_context(target, prompt[len(target.ids) :])
        report.sampled_tokens += len(span.completions[0].token_ids)
        if not _append_completion(target, span, limits):
            open_rows.remove(target)
            report.truncated_rows += 1
    kept = [row for row in rows if row.trained_tokens]
    report.rows = len(kept)
    report.mismatches = dict(mismatches)
    report.trained_tokens = sum(row.trained_tokens for row in kept)
    return kept, report


def _extendable(open_rows: list[_OpenRow], prompt: list[int]) -> _OpenRow | None:
    """The open row with the longest sequence that `prompt` starts with exactly."""
    best: _OpenRow | None = None
    for candidate in open_rows:
        size = len(candidate.ids)
        fits = size <= len(prompt) and prompt[:size] == candidate.ids
        if fits and (best is None or size > len(best.ids)):
            best = candidate
    return best


def classify_mismatch(open_rows: Sequence[_OpenRow], prompt: list[int]) -> str:
    """Why `prompt` extends none of `open_rows` (see the module doc for the kinds)."""
    shared = [(common_prefix_len(candidate.ids, prompt), candidate) for candidate in open_rows]
    common, row = max(shared, key=lambda pair: pair[0])
    if common < row.first_prompt_len:
        return "branch"
    completion_start = len(row.ids) - len(row.last_completion)
    if common == completion_start == len(prompt):
        return "retry"
    if common < completion_start:
        return "rewrote_history"
    rendered = prompt[completion_start:]
    sampled = row.last_completion
    if rendered:
        for cut in range(1, len(sampled)):
            tail = sampled[cut:]
            if sampled[cut] == rendered[0] and rendered[: len(tail)] == tail:
                return "template_dropped"
    return "retokenized"


def _new_row(rollout_id: str, prompt: list[int]) -> TrainingRow:
    return TrainingRow(
        rollout_id=rollout_id,
        input_ids=list(prompt),
        prompt_len=len(prompt),
        loss_mask=[],
        logprobs=[],
        versions=[],
    )


def _append_context(target: _OpenRow, tokens: list[int]) -> None:
    row = target.row
    row.input_ids.extend(tokens)
    row.loss_mask.extend([0] * len(tokens))
    row.logprobs.extend([0.0] * len(tokens))
    row.versions.extend([-1] * len(tokens))


def _append_completion(target: _OpenRow, span: Span, limits: SampleLimits) -> bool:
    """Append the sampled tokens; returns False when the row hit `max_seq_len` (then closed)."""
    row = target.row
    completion = span.completions[0]
    room = max(limits.max_seq_len - len(row.input_ids), 0)
    tokens = completion.token_ids[:room]
    logprobs = list(completion.logprobs[: len(tokens)])
    if len(logprobs) < len(tokens):
        # A completion without logprobs can't be importance-weighted: keep it as context.
        _append_context(target, tokens)
    else:
        row.input_ids.extend(tokens)
        row.loss_mask.extend([1] * len(tokens))
        row.logprobs.extend(logprobs)
        row.versions.extend([span.weight_version_start] * len(tokens))
    target.last_completion = list(tokens)
    if len(tokens) < len(completion.token_ids):
        row.truncated = True
        return False
    return True

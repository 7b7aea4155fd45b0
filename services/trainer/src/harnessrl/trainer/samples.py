"""Sample building: turn one rollout's spans into training rows, training only sampled tokens.

A row is one token sequence the policy is trained on: a prompt (context, loss mask 0) followed by
a response region where the tokens vLLM sampled carry loss mask 1, their rollout logprobs and the
weight version that sampled them, and everything else (tool output, user turns) is context.

Merge rule: a call joins an open row when its prompt starts with that row's whole sequence (exact
token prefix); the tokens between are context. Several rows stay open, so a sub-agent interleaving
its calls with the main conversation extends its own row. A prompt that extends no open row starts
a new row; the reason is classified against the open row it shares the longest prefix with (the
most recently extended one on a tie):

- `retry`: the prompt equals that row's last prompt: the harness re-sent the call.
- `template_dropped`: the last prompt survives but the re-rendered model turn lacks a leading part
  of what was sampled (a template that drops past reasoning).
- `retokenized`: the last prompt survives but the model turn was re-rendered or re-tokenized into
  different ids (a tool call serialised differently).
- `rewrote_history`: the divergence is before the last model turn: the harness edited history.
- `branch`: the prompt shares less than the row's first prompt: another conversation (sub-agent).

In a new row the whole prompt is context, so a re-rendered model turn is never trained (mask 0):
only ids we hold as sampled get mask 1.

Length: no row grows past `max_seq_len`. A completion longer than the room left in its row is cut
(`truncated_rows`), which closes the row; a prompt that leaves no room in the row it extends closes
that row and, like a new row's prompt over `max_prompt_len`, trains nothing (`prompt_too_long`).
Closing a row and starting another would not help: the new row would hold the same prompt, so the
same tokens, twice over. When the rows are finished, context trailing a row's last trained token
is trimmed (no loss, only compute).

Which sampled tokens train (mask 1), and what the others are counted as:

- a call the loss can't model (see `unmodeled_reason`): its completion is context
  (`unmodeled_sampling_tokens`, by reason);
- tokens without a finite logprob can't be importance-weighted: a completion trains the prefix
  that has logprobs, the rest is context (`missing_logprob_tokens`);
- a retry means the harness threw the retried row's last completion away: unless
  `limits.train_dead_ends` it is turned into context (`dead_end_tokens`); a row left with no
  trained token is dropped like any other;
- spans that failed upstream or hold no tokens (`skipped_tokens`), calls whose prompt is too
  long (`prompt_too_long_tokens`) and cut completions (`truncated_tokens`) start nothing.

`BuildReport.sampled_tokens == trained_tokens + untrained_tokens` always, `untrained_tokens` being
the sum of those categories.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import msgspec

from harnessrl.shared.contracts import Completion, Span
from harnessrl.shared.tokens import common_prefix_len, reconstruct_prompts
from harnessrl.trainer.sampling import DEFAULT_TEMPERATURE, run_temperature, unmodeled_reason
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
    """What sample building saw in one rollout (the module doc explains each rule).

    Counts of things: `rows` kept, `mismatches` by kind, `skipped_spans`, `prompt_too_long` calls
    and `truncated_rows`. Counts of sampled tokens (the first completion of every span):
    `sampled_tokens` = `trained_tokens` (mask 1 in the rows kept) + the `*_tokens` categories
    that make up `untrained_tokens`; `unmodeled_sampling` splits its category by reason.
    """

    rows: int = 0
    mismatches: dict[str, int] = msgspec.field(default_factory=dict)
    skipped_spans: int = 0
    prompt_too_long: int = 0
    truncated_rows: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    skipped_tokens: int = 0
    prompt_too_long_tokens: int = 0
    truncated_tokens: int = 0
    missing_logprob_tokens: int = 0
    dead_end_tokens: int = 0
    unmodeled_sampling_tokens: int = 0
    unmodeled_sampling: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def untrained_tokens(self) -> int:
        """Sampled tokens that train in no row, whatever the reason."""
        return (
            self.skipped_tokens
            + self.prompt_too_long_tokens
            + self.truncated_tokens
            + self.missing_logprob_tokens
            + self.dead_end_tokens
            + self.unmodeled_sampling_tokens
        )


def _sampled(span: Span) -> list[int]:
    """The tokens of the span's first completion, the one rows are built from."""
    return span.completions[0].token_ids if span.completions else []


def _logprob_prefix(logprobs: Sequence[float], count: int) -> int:
    """How many of the first `count` tokens have a finite logprob before the first one that hasn't."""
    for index, value in enumerate(logprobs[:count]):
        if not math.isfinite(value):
            return index
    return min(len(logprobs), count)


# --- rows ------------------------------------------------------------------------------------------


class _OpenRow:
    """A row being extended: where its first prompt ends, and its last completion."""

    __slots__ = ("first_prompt_len", "last_call", "last_completion", "last_start", "row")

    def __init__(self, row: TrainingRow) -> None:
        self.row = row
        self.first_prompt_len = row.prompt_len
        self.last_completion: list[int] = []
        self.last_start = 0  # where the last completion starts in the response region
        self.last_call = 0  # the ordinal of the call that extended it last

    @property
    def ids(self) -> list[int]:
        return self.row.input_ids

    def append_context(self, tokens: Sequence[int]) -> None:
        """Tokens the model didn't sample here: mask 0, no logprob, no version."""
        row = self.row
        row.input_ids.extend(tokens)
        row.loss_mask.extend([0] * len(tokens))
        row.logprobs.extend([0.0] * len(tokens))
        row.versions.extend([-1] * len(tokens))

    def append_completion(self, tokens: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """Sampled tokens: the first `len(logprobs)` train (mask 1), the rest are context."""
        row, trained = self.row, len(logprobs)
        self.last_start = len(row.loss_mask)
        self.last_completion = list(tokens)
        row.input_ids.extend(tokens[:trained])
        row.loss_mask.extend([1] * trained)
        row.logprobs.extend(logprobs)
        row.versions.extend([version] * trained)
        self.append_context(tokens[trained:])

    def untrain_last_completion(self) -> int:
        """Turn the last completion into context (a dead end); returns how many tokens had trained."""
        start, end = self.last_start, self.last_start + len(self.last_completion)
        row = self.row
        trained = sum(row.loss_mask[start:end])
        row.loss_mask[start:end] = [0] * (end - start)
        row.logprobs[start:end] = [0.0] * (end - start)
        row.versions[start:end] = [-1] * (end - start)
        return trained


def build_rows(
    rollout_id: str,
    spans: Sequence[Span],
    limits: SampleLimits | None = None,
    *,
    temperature: float | None = None,
) -> tuple[list[TrainingRow], BuildReport]:
    """Build the training rows of one rollout from its spans (any order; sorted by seq here).

    `temperature` is the sampling the loss models (the run's); None takes the rollout's own
    (`run_temperature`, 1.0 when none shows).
    """
    ordered = sorted(spans, key=lambda span: span.seq)
    modeled = temperature if temperature is not None else run_temperature(ordered) or DEFAULT_TEMPERATURE
    builder = _RowBuilder(rollout_id, limits or SampleLimits(), modeled)
    prompts = reconstruct_prompts(ordered)
    for span in ordered:
        builder.add(span, prompts[span.span_id])
    return builder.finish()


class _RowBuilder:
    """The rows of one rollout as its calls come in (in seq order), and what was counted."""

    def __init__(self, rollout_id: str, limits: SampleLimits, temperature: float) -> None:
        self.rollout_id = rollout_id
        self.limits = limits
        self.temperature = temperature
        self.report = BuildReport()
        self.mismatches: Counter[str] = Counter()
        self.unmodeled: Counter[str] = Counter()
        self.open_rows: list[_OpenRow] = []
        self.rows: list[TrainingRow] = []
        self.calls = 0

    def add(self, span: Span, prompt: list[int]) -> None:
        """One call: its completion joins a row (or starts one), or is counted as untrained."""
        report = self.report
        tokens = _sampled(span)
        report.sampled_tokens += len(tokens)
        if span.status != "ok" or not tokens:
            report.skipped_spans += 1
            report.skipped_tokens += len(tokens)
            return
        target = self._target(prompt)
        if target is None:
            report.prompt_too_long += 1
            report.prompt_too_long_tokens += len(tokens)
            return
        self._append_completion(target, span, span.completions[0])

    def _target(self, prompt: list[int]) -> _OpenRow | None:
        """The row this call extends, else a new row; None when the prompt leaves no room in a row."""
        target = _extendable(self.open_rows, prompt)
        if target is None:
            if self.open_rows:
                self._count_mismatch(prompt)
            return self._open(prompt) if len(prompt) <= self.limits.max_prompt_len else None
        if len(prompt) >= self.limits.max_seq_len:
            self.open_rows.remove(target)  # full: it can take no sampled token any more
            return None
        target.append_context(prompt[len(target.ids) :])
        return target

    def _count_mismatch(self, prompt: list[int]) -> None:
        """Classify why `prompt` extends no open row; a retry makes the retried completion a dead end."""
        common, row = _closest(self.open_rows, prompt)
        kind = classify_mismatch(row, common, prompt)
        self.mismatches[kind] += 1
        if kind == "retry" and not self.limits.train_dead_ends:
            self.report.dead_end_tokens += row.untrain_last_completion()

    def _open(self, prompt: list[int]) -> _OpenRow:
        row = TrainingRow(
            rollout_id=self.rollout_id, input_ids=list(prompt), prompt_len=len(prompt),
            loss_mask=[], logprobs=[], versions=[], temperature=self.temperature,
        )  # fmt: skip
        target = _OpenRow(row)
        self.open_rows.append(target)
        self.rows.append(row)
        return target

    def _append_completion(self, target: _OpenRow, span: Span, completion: Completion) -> None:
        """Append what fits of the completion; a cut one closes its row (truncated)."""
        report = self.report
        room = self.limits.max_seq_len - len(target.ids)
        tokens = completion.token_ids[:room]
        trained = self._trainable(span, completion, len(tokens))
        self.calls += 1
        target.last_call = self.calls
        target.append_completion(tokens, completion.logprobs[:trained], span.weight_version_start)
        cut = len(completion.token_ids) - len(tokens)
        if cut:
            target.row.truncated = True
            self.open_rows.remove(target)
            report.truncated_rows += 1
            report.truncated_tokens += cut

    def _trainable(self, span: Span, completion: Completion, count: int) -> int:
        """How many of the first `count` sampled tokens train; the others are counted by reason."""
        reason = unmodeled_reason(span.request, self.temperature)
        if reason is not None:
            self.unmodeled[reason] += count
            self.report.unmodeled_sampling_tokens += count
            return 0
        trained = _logprob_prefix(completion.logprobs, count)
        self.report.missing_logprob_tokens += count - trained
        return trained

    def finish(self) -> tuple[list[TrainingRow], BuildReport]:
        """The rows with a trained token, trimmed after it, and the report."""
        kept = [_trimmed(row) for row in self.rows if row.trained_tokens]
        report = self.report
        report.rows = len(kept)
        report.mismatches = dict(self.mismatches)
        report.unmodeled_sampling = dict(self.unmodeled)
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


def _closest(open_rows: Sequence[_OpenRow], prompt: list[int]) -> tuple[int, _OpenRow]:
    """The open row sharing the longest prefix with `prompt` (the latest extended on a tie)."""
    shared = [(common_prefix_len(row.ids, prompt), row.last_call, row) for row in open_rows]
    common, _, row = max(shared, key=lambda item: item[:2])
    return common, row


def classify_mismatch(row: _OpenRow, common: int, prompt: list[int]) -> str:
    """Why `prompt`, sharing `common` tokens with `row`, doesn't extend it (kinds in the module doc)."""
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


def _trimmed(row: TrainingRow) -> TrainingRow:
    """`row` without the context after its last trained token (it carries no loss)."""
    end = len(row.loss_mask) - row.loss_mask[::-1].index(1)
    del row.input_ids[row.prompt_len + end :]
    del row.loss_mask[end:], row.logprobs[end:], row.versions[end:]
    return row

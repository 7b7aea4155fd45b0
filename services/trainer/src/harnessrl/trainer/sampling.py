"""Sampling fidelity: which calls the loss can model, read from the parameters each span was sent with.

The loss models plain sampling from softmax(logits / T) at the run's temperature T, which is what
vLLM's processed logprobs report for such a call. The gateway records every call's parameters in
`Span.request` (the run's sampling policy applied); a call sampled any other way (greedy, another
temperature, nucleus or top-k truncation, penalties, a grammar) has tokens whose behaviour
probability the trainer can't reproduce, so `samples` keeps them as context and counts them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from harnessrl.shared.contracts import Span

# vLLM samples at temperature 1 when a request names none (with `--generation-config vllm`; the
# default `auto` would apply the model's generation_config.json, which no span records).
DEFAULT_TEMPERATURE = 1.0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _equals(*neutral: float) -> Callable[[Any], bool]:
    return lambda value: _is_number(value) and value in neutral


def _no_constraint(value: Any) -> bool:
    return not value


def _free_tool_choice(value: Any) -> bool:
    kind = value.get("type") if isinstance(value, dict) else value
    return kind in ("auto", "none")


def _plain_text_format(value: Any) -> bool:
    kind = value.get("type") if isinstance(value, dict) else value
    return kind == "text"


def _plain_responses_text(value: Any) -> bool:
    return not isinstance(value, dict) or value.get("format") is None or _plain_text_format(value["format"])


# Request parameters (OpenAI, vLLM's extras, Anthropic) that change the distribution a token is drawn
# from unless at the neutral value tested here; an absent or null one is neutral. Forced tool calls and
# structured outputs are sampled under a grammar mask. Parameters not listed (max_tokens, stop, seed,
# n, ...) end or repeat sampling without changing the distribution.
_NEUTRAL: Mapping[str, Callable[[Any], bool]] = {
    "top_p": lambda value: _is_number(value) and value >= 1,
    "top_k": _equals(0, -1),
    "min_p": _equals(0),
    "presence_penalty": _equals(0),
    "frequency_penalty": _equals(0),
    "repetition_penalty": _equals(1),
    "min_tokens": _equals(0),
    "logit_bias": _no_constraint,
    "bad_words": _no_constraint,
    "allowed_token_ids": _no_constraint,
    "logits_processors": _no_constraint,
    "use_beam_search": _no_constraint,
    "guided_json": _no_constraint,
    "guided_regex": _no_constraint,
    "guided_choice": _no_constraint,
    "guided_grammar": _no_constraint,
    "structured_outputs": _no_constraint,
    "response_format": _plain_text_format,
    "text": _plain_responses_text,
    "tool_choice": _free_tool_choice,
}


def sampling_temperature(request: Mapping[str, Any]) -> float | None:
    """The temperature a call was sampled at: its `temperature`, 1.0 when absent; None if unreadable."""
    value = request.get("temperature")
    if value is None:
        return DEFAULT_TEMPERATURE
    return float(value) if _is_number(value) else None


def unmodeled_reason(request: Mapping[str, Any], temperature: float) -> str | None:
    """Why the loss can't model how a call was sampled, or None when it can.

    The loss models plain sampling from softmax(logits / `temperature`). A call sampled otherwise
    is named by the first reason found: `greedy` (temperature 0), `temperature` (another one, or
    unreadable), else the first parameter of `_NEUTRAL` away from its neutral value.
    """
    sampled_at = sampling_temperature(request)
    if sampled_at == 0:
        return "greedy"
    if sampled_at is None or not math.isclose(sampled_at, temperature, rel_tol=1e-6):
        return "temperature"
    for name, neutral in _NEUTRAL.items():
        value = request.get(name)
        if value is not None and not neutral(value):
            return name
    return None


def run_temperature(spans: Sequence[Span]) -> float | None:
    """The sampling temperature of the first ok span with tokens (by seq) not sampled greedily.

    A run samples at one temperature (the gateway applies the run's sampling to every call), so
    the first call that shows one is taken as the run's; greedy calls can't be trained, so they
    don't set it. None when no span shows one.
    """
    for span in sorted(spans, key=lambda item: item.seq):
        temperature = sampling_temperature(span.request)
        if (
            span.status == "ok"
            and span.completions
            and span.completions[0].token_ids
            and temperature is not None
            and temperature > 0
        ):
            return temperature
    return None


def _sampled(span: Span) -> list[int]:
    """The tokens of the span's first completion, the one rows are built from."""
    return span.completions[0].token_ids if span.completions else []

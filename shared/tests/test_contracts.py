"""Every contract survives a msgpack round trip; garbage and foreign schemas raise ContractError."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.shared import contracts as c

ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=24)
token_ids = st.lists(st.integers(min_value=0, max_value=200_000), max_size=64)
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), floats, st.text(max_size=20))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
common = {"run": ids, "episode": ids, "task": ids, "group": ids, "attempt": st.integers(0, 10)}


@st.composite
def completions(draw: st.DrawFn) -> c.Completion:
    tokens = draw(token_ids)
    logprobs = draw(st.lists(st.floats(-50, 0), min_size=len(tokens), max_size=len(tokens)))
    return c.Completion(
        token_ids=tokens, logprobs=logprobs, finish_reason=draw(st.sampled_from(["stop", "length", None]))
    )


spans = st.builds(
    c.Span,
    span_id=ids,
    run=ids,
    episode=ids,
    seq=st.integers(0, 10_000),
    api=st.sampled_from(["chat", "completions", "responses", "messages"]),
    stream=st.booleans(),
    status=st.sampled_from(["ok", "aborted", "error"]),
    request=st.dictionaries(st.text(max_size=10), json_values, max_size=5),
    parent_span=st.one_of(st.none(), ids),
    prefix_len=st.integers(0, 5000),
    prompt_suffix_ids=token_ids,
    completions=st.lists(completions(), max_size=3),
    weight_version_start=st.integers(0, 1000),
    weight_version_end=st.integers(0, 1000),
    usage=st.builds(c.Usage, prompt_tokens=st.integers(0, 10**6), completion_tokens=st.integers(0, 10**6)),
)
artifacts = st.builds(
    c.ArtifactRef,
    kind=st.sampled_from(["patch", "answer", "file"]),
    size=st.integers(0, 10**9),
    inline=st.one_of(st.none(), st.binary(max_size=64)),
    object_name=st.one_of(st.none(), ids),
)
tasks = st.builds(
    c.TaskSpec,
    task_id=ids,
    kind=st.sampled_from(["qa", "swe"]),
    prompt=st.text(max_size=40),
    answer=st.one_of(st.none(), st.text(max_size=10)),
    instance=st.one_of(st.none(), st.dictionaries(st.text(max_size=8), json_values, max_size=3)),
)
events = st.one_of(
    st.builds(c.EpisodeScheduled, **common, launcher=st.sampled_from(["local", "kubernetes"])),
    st.builds(c.EpisodeStarted, **common, where=st.text(max_size=20)),
    st.builds(
        c.AgentExited,
        **common,
        exit_code=st.one_of(st.none(), st.integers(-9, 255)),
        artifact=st.one_of(st.none(), artifacts),
        task_spec=st.one_of(st.none(), tasks),
    ),
    st.builds(
        c.EpisodeScored,
        **common,
        reward=floats,
        resolved=st.one_of(st.none(), st.booleans()),
        details=st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    ),
    st.builds(c.EpisodeCompleted, **common, reward=floats, span_count=st.integers(0, 100)),
    st.builds(
        c.EpisodeFailed, **common, cause=st.sampled_from(["infra", "agent", "timeout", "reward-error"])
    ),
    st.builds(c.EpisodeRetried, **common, new_episode=ids),
)
rollouts = st.builds(
    c.RolloutComplete,
    **common,
    reward=floats,
    versions_seen=st.lists(st.integers(0, 99)),
    failure=st.one_of(st.none(), st.sampled_from(["infra", "agent", "timeout", "reward-error"])),
)
weights = st.builds(c.WeightVersion, run=ids, version=st.integers(0, 10**6), step=st.integers(0, 10**6))
run_specs = st.builds(
    c.RunSpec,
    run=ids,
    tasks=st.text(min_size=1, max_size=30),
    group_size=st.integers(1, 64),
    mode=st.sampled_from(["sync", "async"]),
    staleness=st.integers(0, 8),
)


@settings(max_examples=150, deadline=None)
@given(message=st.one_of(spans, rollouts, weights, run_specs, tasks))
def test_round_trip(message: Any) -> None:
    assert c.decode(c.encode(message), type(message)) == message


@settings(max_examples=150, deadline=None)
@given(event=events)
def test_episode_events_round_trip_through_the_union(event: Any) -> None:
    decoded = c.decode_event(c.encode(event))
    assert decoded == event and type(decoded) is type(event)


@settings(max_examples=200, deadline=None)
@given(garbage=st.binary(max_size=256))
def test_garbage_raises_contract_error(garbage: bytes) -> None:
    for kind in (c.Span, c.RolloutComplete, c.WeightVersion):
        with pytest.raises(c.ContractError):
            c.decode(garbage, kind)
    with pytest.raises(c.ContractError):
        c.decode_event(garbage)


def test_foreign_schema_version_is_rejected() -> None:
    future = c.WeightVersion(run="r", version=1, step=1, schema=2)
    with pytest.raises(c.ContractError, match="schema 2"):
        c.decode(c.encode(future), c.WeightVersion)


def test_wrong_message_type_is_rejected() -> None:
    with pytest.raises(c.ContractError):
        c.decode(c.encode(c.WeightVersion(run="r", version=1, step=1)), c.Span)
    with pytest.raises(c.ContractError):
        c.decode_event(c.encode(c.WeightVersion(run="r", version=1, step=1)))


def test_unknown_event_kind_is_rejected() -> None:
    payload = msgspec.msgpack.encode(
        {"kind": "exploded", "run": "r", "episode": "e", "task": "t", "group": "g"}
    )
    with pytest.raises(c.ContractError):
        c.decode_event(payload)


@pytest.mark.parametrize("field,value", [("group_size", 0), ("staleness", -1), ("episode_timeout_s", 0.0)])
def test_run_spec_rejects_impossible_values(field: str, value: float) -> None:
    raw = msgspec.msgpack.encode({"run": "r", "tasks": "t.jsonl", field: value})
    with pytest.raises(c.ContractError, match=field):
        c.decode(raw, c.RunSpec)

"""Row building from recorded span sequences, well-behaved and pathological."""

import math
import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.shared.contracts import RolloutComplete, Span
from harnessrl.testkit.span_sequences import EpisodeRecorder, agent_episode
from harnessrl.trainer.advantages import AssembledRollout, score_groups
from harnessrl.trainer.assembly import RolloutPool
from harnessrl.trainer.metrics import batch_metrics
from harnessrl.trainer.samples import BuildReport, build_rows
from harnessrl.trainer.sampling import run_temperature, unmodeled_reason
from harnessrl.trainer.settings import AdvantageSettings, PoolSettings, SampleLimits

SYSTEM = [1, 2, 3, 4]
USER = [5, 6, 7]


def sampled(row, spans):
    """The (token, logprob) pairs a row trains on."""
    response = row.input_ids[row.prompt_len :]
    return [(t, lp) for t, lp, m in zip(response, row.logprobs, row.loss_mask, strict=False) if m]


def test_consecutive_calls_join_one_row_with_tool_output_masked():
    rec = EpisodeRecorder("run", "ep")
    prompt1 = [*SYSTEM, *USER]
    rec.call(prompt1, [10, 11, 12], logprobs=[-0.1, -0.2, -0.3], version=3)
    tool = [20, 21]
    prompt2 = [*prompt1, 10, 11, 12, *tool]
    rec.call(prompt2, [13, 14], logprobs=[-0.4, -0.5], version=4)

    rows, report = build_rows("ep", rec.spans)

    assert len(rows) == 1 and report.rows == 1
    row = rows[0]
    assert row.input_ids == [*prompt2, 13, 14]
    assert row.prompt_len == len(prompt1)
    assert row.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert row.logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert row.versions == [3, 3, 3, -1, -1, 4, 4]
    assert report.mismatches == {}
    assert report.trained_tokens == 5 == report.sampled_tokens


def test_template_that_drops_past_reasoning_masks_the_rerendered_turn():
    rec = EpisodeRecorder("run", "ep")
    think, answer = [30, 31, 32, 33], [40, 41, 2]
    prompt1 = [*SYSTEM, *USER]
    rec.call(prompt1, [*think, *answer])
    # The chat template re-renders the assistant turn without its reasoning.
    prompt2 = [*prompt1, *answer, 50, 51]
    rec.call(prompt2, [60, 61])

    rows, report = build_rows("ep", rec.spans)

    assert report.mismatches == {"template_dropped": 1}
    assert len(rows) == 2
    first, second = rows
    assert sampled(first, rec.spans) == [(t, -1.0) for t in [*think, *answer]]
    # In the second row the re-rendered answer is prompt (mask 0); only the new call is trained.
    assert second.prompt_len == len(prompt2)
    assert second.input_ids[second.prompt_len :] == [60, 61]
    assert second.loss_mask == [1, 1]


def test_tool_call_rerendered_differently_is_classified_retokenized():
    rec = EpisodeRecorder("run", "ep")
    prompt1 = [*SYSTEM, *USER]
    rec.call(prompt1, [70, 71, 72, 73])  # e.g. '{"cmd": "ls"}' as sampled
    prompt2 = [*prompt1, 70, 74, 75, 73, 80]  # re-serialised with other spacing
    rec.call(prompt2, [81])

    rows, report = build_rows("ep", rec.spans)

    assert report.mismatches == {"retokenized": 1}
    assert [r.trained_tokens for r in rows] == [4, 1]
    assert rows[1].input_ids[: rows[1].prompt_len] == prompt2


def test_retried_call_starts_a_new_row_and_failed_spans_are_skipped():
    rec = EpisodeRecorder("run", "ep")
    prompt = [*SYSTEM, *USER]
    rec.call(prompt, [90, 91])
    rec.call(prompt, [95], status="error")  # the retry's first attempt broke off upstream
    rec.call(prompt, [92, 93, 94])

    rows, report = build_rows("ep", rec.spans)

    assert report.skipped_spans == 1 and report.skipped_tokens == 1
    assert report.mismatches == {"retry": 1}
    # The harness threw [90, 91] away: a dead end, not trained, and its row has nothing else.
    assert [r.input_ids[r.prompt_len :] for r in rows] == [[92, 93, 94]]
    assert report.dead_end_tokens == 2
    assert (report.sampled_tokens, report.trained_tokens, report.untrained_tokens) == (6, 3, 3)

    kept, kept_report = build_rows("ep", rec.spans, SampleLimits(train_dead_ends=True))
    assert [r.input_ids[r.prompt_len :] for r in kept] == [[90, 91], [92, 93, 94]]
    assert kept_report.dead_end_tokens == 0


def test_subagent_interleaving_extends_its_own_row():
    rec = EpisodeRecorder("run", "ep")
    main1 = [*SYSTEM, *USER]
    rec.call(main1, [100, 101])
    sub1 = [9, 9, 8]  # a sub-agent with its own system prompt
    rec.call(sub1, [110])
    rec.call([*sub1, 110, 111], [112])
    rec.call([*main1, 100, 101, 102], [103])

    rows, report = build_rows("ep", rec.spans)

    assert report.mismatches == {"branch": 1}
    assert len(rows) == 2
    main, sub = rows
    assert main.input_ids == [*main1, 100, 101, 102, 103]
    assert main.loss_mask == [1, 1, 0, 1]
    assert sub.input_ids == [*sub1, 110, 111, 112]
    assert sub.loss_mask == [1, 0, 1]


def test_harness_that_rewrites_history_is_classified():
    rec = EpisodeRecorder("run", "ep")
    prompt1 = [*SYSTEM, *USER]
    rec.call(prompt1, [120, 121])
    rec.call([*prompt1, 120, 121, 122, 123], [124])
    # The harness summarised the middle of the conversation.
    rec.call([*prompt1, 120, 121, 199, 125], [126])

    rows, report = build_rows("ep", rec.spans)

    assert report.mismatches == {"rewrote_history": 1}
    assert len(rows) == 2


def test_prompt_longer_than_the_limit_starts_no_row():
    rec = EpisodeRecorder("run", "ep")
    rec.call(list(range(50)), [1, 2])
    rows, report = build_rows("ep", rec.spans, SampleLimits(max_prompt_len=20, max_seq_len=64))
    assert rows == [] and report.prompt_too_long == 1


def test_recorded_agent_episodes_are_one_row_each():
    rng = random.Random(7)
    for index in range(20):
        spans = agent_episode("run", f"ep{index}", rng, turns=rng.randint(1, 6))
        rows, report = build_rows(f"ep{index}", list(reversed(spans)))
        assert len(rows) == 1
        assert report.trained_tokens == sum(len(s.completions[0].token_ids) for s in spans)
        assert report.mismatches == {}


def with_request(span: Span, **params: object) -> Span:
    """The span as if its call had been sent upstream with `params`."""
    return msgspec.structs.replace(span, request={"model": "policy", **params})


def test_a_completion_that_would_outgrow_its_row_is_cut_there_and_closes_it():
    rec = EpisodeRecorder("run", "ep")
    prompt1 = list(range(10))
    rec.call(prompt1, [100, 101, 102])
    prompt2 = [*prompt1, 100, 101, 102, 55, 56]
    rec.call(prompt2, [103, 104, 105, 106, 107, 108])  # 15 + 6 > 20: cut to 5, the row closes
    rec.call([*prompt2, 103, 104, 105, 106, 107, 108, 57], [109])  # 22 tokens: no row takes it
    limits = SampleLimits(max_prompt_len=16, max_seq_len=20)

    rows, report = build_rows("ep", rec.spans, limits)

    [row] = rows  # a second row would hold the same prompt again: no more room, twice the compute
    assert row.truncated and len(row.input_ids) == 20
    assert row.input_ids == [*prompt2, 103, 104, 105, 106, 107]
    assert row.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    assert (report.truncated_rows, report.truncated_tokens) == (1, 1)
    assert (report.prompt_too_long, report.prompt_too_long_tokens) == (1, 1)
    assert (report.sampled_tokens, report.trained_tokens, report.untrained_tokens) == (10, 8, 2)


def test_a_prompt_that_fills_its_row_trains_nothing_and_a_new_row_is_cut_too():
    rec = EpisodeRecorder("run", "ep")
    prompt1 = list(range(10))
    rec.call(prompt1, list(range(100, 108)))
    prompt2 = [*prompt1, *range(100, 108), *range(60, 66)]  # 24 tokens: fills the row
    rec.call(prompt2, list(range(200, 210)))
    rec.call(list(range(300, 312)), list(range(400, 420)))  # a new row: 12 + 20 > 24
    limits = SampleLimits(max_prompt_len=12, max_seq_len=24)

    rows, report = build_rows("ep", rec.spans, limits)

    first, cut = rows
    assert first.input_ids == [*prompt1, *range(100, 108)] and not first.truncated
    assert (report.prompt_too_long, report.prompt_too_long_tokens) == (1, 10)
    assert cut.truncated and len(cut.input_ids) == 24 and cut.trained_tokens == 12
    assert (report.truncated_rows, report.truncated_tokens) == (1, 8)
    assert report.sampled_tokens == 38 == report.trained_tokens + report.untrained_tokens
    assert all(len(row.input_ids) <= limits.max_seq_len for row in rows)


def test_a_dead_end_inside_a_conversation_is_untrained_and_its_context_trimmed():
    rec = EpisodeRecorder("run", "ep")
    prompt1 = [*SYSTEM, *USER]
    rec.call(prompt1, [10, 11])
    prompt2 = [*prompt1, 10, 11, 20, 21]
    rec.call(prompt2, [12, 13, 14])  # thrown away: the harness re-sends prompt2 twice
    rec.call(prompt2, [15])
    rec.call(prompt2, [16, 17])

    rows, report = build_rows("ep", rec.spans)

    assert report.mismatches == {"retry": 2}
    assert report.dead_end_tokens == 4  # [12, 13, 14] and [15]: each retry ends the latest attempt
    first, last = rows
    assert first.input_ids == [*prompt1, 10, 11] and first.loss_mask == [1, 1]
    assert last.input_ids == [*prompt2, 16, 17] and last.loss_mask == [1, 1]
    assert report.trained_tokens == 4 and report.rows == 2


def test_tokens_without_logprobs_are_context_after_the_prefix_that_has_them():
    rec = EpisodeRecorder("run", "ep")
    prompt1 = [*SYSTEM, *USER]
    rec.call(prompt1, [10, 11, 12, 13], logprobs=[-0.1, -0.2])
    prompt2 = [*prompt1, 10, 11, 12, 13, 30]
    rec.call(prompt2, [14, 15, 16], logprobs=[-0.3, float("nan"), -0.5])

    rows, report = build_rows("ep", rec.spans)

    [row] = rows
    assert row.loss_mask == [1, 1, 0, 0, 0, 1]  # trailing context after the last trained token trimmed
    assert row.input_ids == [*prompt2, 14]
    assert row.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert row.versions == [0, 0, -1, -1, -1, 0]
    assert report.missing_logprob_tokens == 4 and report.trained_tokens == 3


def test_calls_sampled_otherwise_than_the_run_are_context_counted_by_reason():
    rec = EpisodeRecorder("run", "ep")
    context = [*SYSTEM, *USER]
    requests = [
        {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "tool_choice": "auto"},  # the run's sampling
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 0},
        {"temperature": 1.0},
        {"temperature": 0.7, "logit_bias": {"12": 5}},
        {"temperature": 0.7, "tool_choice": "required"},
        {"temperature": 0.7, "presence_penalty": 0.0, "response_format": {"type": "text"}},
    ]
    for index in range(len(requests)):
        completion = [100 + 2 * index, 101 + 2 * index]
        rec.call(context, completion)
        context = [*context, *completion, 50]
    spans = [with_request(span, **params) for span, params in zip(rec.spans, requests, strict=True)]

    rows, report = build_rows("ep", spans)

    [row] = rows
    assert row.temperature == 0.7  # learned from the first call
    assert row.loss_mask == [1, 1] + [0] * 16 + [1, 1]
    assert report.unmodeled_sampling == {"top_p": 2, "greedy": 2, "temperature": 2, "logit_bias": 2,
                                         "tool_choice": 2}  # fmt: skip
    assert report.unmodeled_sampling_tokens == 10 and report.trained_tokens == 4
    _, at_one = build_rows("ep", spans, temperature=1.0)
    assert at_one.trained_tokens == 2 and at_one.unmodeled_sampling["temperature"] == 10


def test_the_run_temperature_is_the_first_sampled_call_s_and_absent_means_one():
    rec = EpisodeRecorder("run", "ep")
    rec.call([1, 2], [3], status="error")
    rec.call([1, 2], [4])
    rec.call([1, 2, 4, 5], [6])
    spans = rec.spans
    assert run_temperature([with_request(spans[0], temperature=0.5), *spans[1:]]) == 1.0
    assert run_temperature([spans[0], with_request(spans[1], temperature=0), spans[2]]) == 1.0
    assert run_temperature([with_request(s, temperature=0) for s in spans]) is None
    assert run_temperature([spans[0], with_request(spans[1], temperature=0.6), spans[2]]) == 0.6
    assert unmodeled_reason({"temperature": "hot"}, 1.0) == "temperature"
    assert unmodeled_reason({"top_k": 0, "min_p": 0, "repetition_penalty": 1, "seed": 3, "n": 2}, 1.0) is None


def pooled(episode: str, temperature: float) -> tuple[RolloutComplete, list[Span]]:
    rec = EpisodeRecorder("run", episode)
    rec.call([*SYSTEM, *USER], [10, 11])
    spans = [with_request(span, temperature=temperature) for span in rec.spans]
    return rec.rollout(task="t", group="g", reward=1.0, group_size=2), spans


def test_the_pool_learns_the_run_temperature_from_the_first_rollout_unless_configured():
    pool = RolloutPool(PoolSettings(), SampleLimits())
    for episode, temperature in (("a", 0.8), ("b", 1.0)):
        assert pool.offer(*pooled(episode, temperature), now=0.0) == "assembled"
    assert pool.temperature == 0.8
    assert pool.reports["a"].trained_tokens == 2
    assert pool.reports["b"].unmodeled_sampling == {"temperature": 2}
    [member, other] = pool.take(["g"])
    assert member.rows[0].temperature == 0.8 and other.rows == []

    configured = RolloutPool(PoolSettings(), SampleLimits(), temperature=1.0)
    configured.offer(*pooled("c", 0.8), now=0.0)
    assert configured.temperature == 1.0 and configured.reports["c"].unmodeled_sampling_tokens == 2


def test_step_metrics_count_what_every_reported_rollout_left_untrained():
    reports: dict[str, BuildReport] = {}
    rollouts = []
    # one group that trains (rewards 1/0) and one with zero variance: both are counted
    for group, rewards in (("g1", (1.0, 0.0)), ("g2", (0.0, 0.0))):
        for attempt, reward in enumerate(rewards):
            rec = EpisodeRecorder("run", f"{group}-{attempt}")
            prompt = [*SYSTEM, *USER]
            rec.call(prompt, [10, 11, 12], logprobs=[-0.1, -0.2])
            rec.call(prompt, [13, 14])  # a retry: [10, 11] become a dead end
            rollout = rec.rollout(task=group, group=group, reward=reward, group_size=2)
            rows, reports[rollout.episode] = build_rows(rollout.episode, rec.spans)
            rollouts.append(AssembledRollout(rollout=rollout, rows=rows))
    outcome = score_groups(rollouts, AdvantageSettings())

    values, _ = batch_metrics(rollouts, outcome, reports, version=0, pass_threshold=1.0)

    assert values["tokens/sampled"] == 20 and values["tokens/trainable"] == 8
    assert values["tokens/trained"] == 4  # only g1 trained
    assert values["tokens/untrained"] == 12 == values["tokens/missing_logprob"] + values["tokens/dead_end"]
    assert values["tokens/dead_end"] == 8 and values["mismatch/retry"] == 4
    assert values["tokens/truncated"] == values["spans/skipped"] == 0


REQUESTS = ({}, {}, {}, {"temperature": 1.0}, {"temperature": 0}, {"top_p": 0.5}, {"temperature": 0.3})
CALLS = st.lists(
    st.tuples(
        st.sampled_from(["extend", "extend", "extend", "retry", "rewrite", "branch"]),
        st.integers(0, 12),  # new context tokens (tool output, a user turn)
        st.integers(1, 30),  # completion length
        st.sampled_from(["ok", "ok", "ok", "ok", "error", "aborted"]),
        st.sampled_from(["all", "all", "all", "short", "nan"]),
        st.integers(0, len(REQUESTS) - 1),
    ),
    min_size=1,
    max_size=14,
)


def random_episode(calls, rng: random.Random) -> list[Span]:
    """Spans of a harness doing `calls`; every sampled token gets its own logprob (to trace it)."""
    rec = EpisodeRecorder("run", "ep")
    prompt: list[int] = [rng.randrange(500) for _ in range(rng.randint(1, 20))]
    context = list(prompt)
    for how, new, length, status, logprobs_kind, request in calls:
        fresh = [rng.randrange(500) for _ in range(new)]
        if how == "extend":
            prompt = [*context, *fresh]
        elif how == "rewrite":
            prompt = [*context[: len(context) // 2], *fresh]
        elif how == "branch":
            prompt = [rng.randrange(500) for _ in range(new + 1)]
        completion = [rng.randrange(500) for _ in range(length)]
        logprobs = [-(len(rec.spans) * 100 + index + 1) / 1e4 for index in range(length)]
        if logprobs_kind == "short":
            logprobs = logprobs[: length // 2]
        elif logprobs_kind == "nan":
            logprobs[length // 3] = math.nan
        span = rec.call(prompt, completion, logprobs=logprobs, status=status)
        rec.spans[-1] = with_request(span, **REQUESTS[request])
        if status == "ok":
            context = [*prompt, *completion]
    return rec.spans


@settings(max_examples=300, deadline=None)
@given(calls=CALLS, seed=st.integers(0, 2**16), dead_ends=st.booleans())
def test_every_sampled_token_is_trained_once_or_counted_and_no_row_outgrows_the_limits(
    calls, seed, dead_ends
):
    spans = random_episode(calls, random.Random(seed))
    limits = SampleLimits(max_prompt_len=48, max_seq_len=80, train_dead_ends=dead_ends)

    rows, report = build_rows("ep", list(reversed(spans)), limits)

    assert report.sampled_tokens == sum(len(span.completions[0].token_ids) for span in spans)
    assert report.sampled_tokens == report.trained_tokens + report.untrained_tokens
    assert report.trained_tokens == sum(row.trained_tokens for row in rows)
    assert sum(report.unmodeled_sampling.values()) == report.unmodeled_sampling_tokens
    assert report.rows == len(rows)
    sampled = {
        (token, logprob)
        for span in spans
        for token, logprob in zip(span.completions[0].token_ids, span.completions[0].logprobs, strict=False)
    }
    trained = []
    for row in rows:
        response = len(row.input_ids) - row.prompt_len
        assert len(row.input_ids) <= limits.max_seq_len and row.prompt_len <= limits.max_prompt_len
        assert len(row.loss_mask) == len(row.logprobs) == len(row.versions) == response
        assert row.loss_mask[-1] == 1  # trailing context trimmed
        assert all(
            (version == -1) == (mask == 0) for version, mask in zip(row.versions, row.loss_mask, strict=True)
        )
        tokens = row.input_ids[row.prompt_len :]
        trained += [(t, lp) for t, lp, m in zip(tokens, row.logprobs, row.loss_mask, strict=True) if m]
    assert len(trained) == len(set(trained)) and set(trained) <= sampled  # each sampled token at most once
    if dead_ends:
        assert report.dead_end_tokens == 0

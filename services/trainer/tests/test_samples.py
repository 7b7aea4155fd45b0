"""Row building from recorded span sequences, well-behaved and pathological."""

import random

from harnessrl.testkit.span_sequences import EpisodeRecorder, agent_episode
from harnessrl.trainer.samples import build_rows
from harnessrl.trainer.settings import SampleLimits

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
    rec.call(prompt, [], status="error")  # the retry's first attempt failed upstream
    rec.call(prompt, [92, 93, 94])

    rows, report = build_rows("ep", rec.spans)

    assert report.skipped_spans == 1
    assert report.mismatches == {"retry": 1}
    assert [r.input_ids[r.prompt_len :] for r in rows] == [[90, 91], [92, 93, 94]]


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


def test_truncated_episode_and_length_limits():
    rec = EpisodeRecorder("run", "ep")
    prompt1 = list(range(10))
    rec.call(prompt1, list(range(100, 108)), finish_reason="length")
    rec.call([*prompt1, *range(100, 108), 55], list(range(200, 210)))
    limits = SampleLimits(max_prompt_len=12, max_seq_len=24)

    rows, report = build_rows("ep", rec.spans, limits)

    # Row 1: 10 prompt + 8 sampled + 1 context + 5 of the 10 sampled tokens that fit.
    assert len(rows) == 1 and rows[0].truncated
    assert len(rows[0].input_ids) == 24
    assert rows[0].trained_tokens == 13
    assert report.truncated_rows == 1
    assert report.sampled_tokens == 18


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

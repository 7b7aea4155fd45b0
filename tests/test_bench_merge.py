"""A small `make bench-merge`: two zoo templates, two harnesses, live episodes through the gateway.

In plain mode the figures are what the template implies: `plain` merges every episode into one
row, `drops_reasoning` breaks at every call that follows a model turn (`template_dropped`).
"""

import json

import pytest

from harnessrl.benchmarks import merge
from harnessrl.shared.bus import Bus
from harnessrl.testkit.template_zoo import Sampling

EPISODES, TURNS = 2, 3
HARNESSES = ("tool_agent", "text_agent")


@pytest.fixture(scope="module")
def sampling() -> Sampling:
    # Temperature 0.5 (the rows model it, as the run's): the zoo model strays from its reply even less.
    return Sampling(turns=TURNS, temperature=0.5)


async def test_plain_merges_every_episode_and_drops_reasoning_breaks_at_every_turn(
    bus: Bus, sampling: Sampling, say
) -> None:
    pairs = []
    for template in ("plain", "drops_reasoning"):
        pairs += await merge.measure_template(bus, template, HARNESSES, episodes=EPISODES, sampling=sampling)
    say(merge._table(pairs))
    by_key = {(p.template, p.harness, p.token_in): p for p in pairs}
    assert len(by_key) == 8
    for pair in pairs:
        assert pair.episodes == EPISODES and pair.missing_spans == 0
        assert pair.calls == EPISODES * TURNS and pair.trained_tokens > 0
        assert pair.mismatch_kl < 1e-3  # vLLM's logprobs are the recomputed ones (float32)
    for harness in HARNESSES:
        stable = by_key[("plain", harness, False)]
        assert (stable.single_row_rate, stable.rows_per_rollout, stable.breaks) == (1.0, 1.0, {})
        assert stable.masked_share == 0.0
        dropped = by_key[("drops_reasoning", harness, False)]
        assert dropped.single_row_rate == 0.0 and dropped.rows_per_rollout == TURNS
        assert dropped.breaks == {"template_dropped": EPISODES * (TURNS - 1)}
        # Token-in must not break a template that was stable without it.
        assert by_key[("plain", harness, True)].single_row_rate == 1.0

    figures = json.loads(json.dumps(merge.summary(pairs)))
    assert figures["single_row_rate_plain"] == 0.5  # half of the rollouts: the plain template's
    for key in ("single_row_rate_token_in", "logprob_mismatch_kl_token_in", "logprob_mismatch_kl_plain"):
        assert isinstance(figures[key], float)
    assert len(figures["pairs"]) == 8 and figures["missing_spans"] == 0

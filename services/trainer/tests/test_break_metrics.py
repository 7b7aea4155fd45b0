"""Break classes per harness and model: in the step metrics and on the trainer's Prometheus registry."""

import asyncio
from pathlib import Path

import msgspec

from harnessrl.shared.bus import Bus
from harnessrl.shared.ids import new_id
from harnessrl.shared.metrics_export import exported
from harnessrl.shared.net import free_port
from harnessrl.testkit.prometheus import scrape
from harnessrl.testkit.span_sequences import EpisodeRecorder, RecordedEpisode, publish_episodes
from harnessrl.trainer.advantages import score_groups
from harnessrl.trainer.assembly import RolloutPool
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.metrics import LabelledReport, MetricsSink, batch_metrics, merge_key, split_merge_key
from harnessrl.trainer.service import TrainerService
from harnessrl.trainer.settings import AdvantageSettings, PoolSettings, SampleLimits, TrainerSettings
from harnessrl.trainer.training import Trainer
from harnessrl.trainer.weight_sync import ReplicaSync

PROMPT = [11, 12, 13, 14, 15]
THINK, ANSWER = [30, 31, 32], [40, 41]


def episode(
    run: str, name: str, *, harness: str | None, model: str, broken: bool, reward: float
) -> RecordedEpisode:
    """Four calls. Well-behaved: each extends the last. Broken: a reasoning drop, then a retry."""
    rec = EpisodeRecorder(run, name)
    rec.call(PROMPT, [*THINK, *ANSWER])
    # Broken, the template dropped THINK from the past turn.
    second = [*PROMPT, *ANSWER, 50] if broken else [*PROMPT, *THINK, *ANSWER, 50]
    rec.call(second, [60, 61])
    rec.call([*second, 60, 61, 70], [80])
    if broken:
        rec.call([*second, 60, 61, 70], [81])  # the harness re-sent that call
    else:
        rec.call([*second, 60, 61, 70, 80, 71], [82])
    client = f"{harness}/2.4.6 (Python 3.11)" if harness is not None else ""
    rec.spans[:] = [msgspec.structs.replace(span, model=model, client=client) for span in rec.spans]
    return rec, rec.rollout(task="t", group="g", reward=reward, group_size=2)


def test_the_step_metrics_split_break_classes_by_harness_and_model():
    pool = RolloutPool(PoolSettings(), SampleLimits())
    recorded = [
        episode("run", "a", harness="mini-swe-agent", model="Qwen/Qwen3-8B", broken=False, reward=1.0),
        episode("run", "b", harness=None, model="Qwen/Qwen3-8B", broken=True, reward=0.0),
    ]
    for rec, rollout in recorded:
        assert pool.offer(rollout, rec.spans, now=0.0) == "assembled"
    reports = dict(pool.reports)
    assert isinstance(reports["b"], LabelledReport)
    assert (reports["b"].harness, reports["b"].model, reports["b"].calls) == ("unknown", "Qwen/Qwen3-8B", 4)
    members = pool.take(["g"])

    values, _ = batch_metrics(
        members, score_groups(members, AdvantageSettings()), reports, version=0, pass_threshold=1.0
    )

    merge = {name: value for name, value in values.items() if name.startswith("merge/")}
    assert merge == {
        "merge/mini-swe-agent/Qwen_Qwen3-8B/extended": 3.0,
        "merge/mini-swe-agent/Qwen_Qwen3-8B/break_rate": 0.0,
        "merge/unknown/Qwen_Qwen3-8B/extended": 1.0,
        "merge/unknown/Qwen_Qwen3-8B/template_dropped": 1.0,
        "merge/unknown/Qwen_Qwen3-8B/retry": 1.0,
        "merge/unknown/Qwen_Qwen3-8B/break_rate": 2 / 3,
    }
    # The same counts as the trainer's own totals, which stay what they were.
    assert values["mismatch/template_dropped"] == values["mismatch/retry"] == 1.0
    assert split_merge_key(merge_key("a/b", "c", "retry")) == ("a_b", "c", "retry")
    assert split_merge_key("mismatch/retry") is None


async def test_the_service_serves_break_classes_per_harness_and_model(
    bus: Bus, policy_engine: PolicyEngine, tiny_model: Path, tmp_path: Path
) -> None:
    run = new_id("run")
    settings = TrainerSettings(
        run=run, model_dir=str(tiny_model), checkpoint_dir=str(tmp_path), mode="async", batch_groups=1,
        pool=PoolSettings(span_wait_s=30.0, group_wait_s=600.0), metrics_port=free_port(),
    )  # fmt: skip
    trainer = Trainer(settings, engine=policy_engine)
    service = TrainerService(bus, trainer, ReplicaSync([], settings.probe_token_ids), MetricsSink(run))
    recorded = [
        episode(run, f"{run}-a", harness="mini-swe-agent", model="tiny", broken=False, reward=1.0),
        episode(run, f"{run}-b", harness="mini-swe-agent", model="tiny", broken=True, reward=0.0),
    ]
    async with exported(bus, service.prometheus.registry, service="trainer", settings=settings, run=run):
        await service.start()
        try:
            await publish_episodes(bus, recorded)
            async with asyncio.timeout(120):
                while service.last_metrics is None:
                    await asyncio.sleep(0.2)
            samples = await scrape(f"http://127.0.0.1:{settings.metrics_port}/metrics")
        finally:
            await service.stop()

    served = {
        dict(labels)["outcome"]: value
        for (name, labels), value in samples.items()
        if name == "harnessrl_trainer_merge_calls_total"
        and dict(labels)["harness"] == "mini-swe-agent"
        and dict(labels)["model"] == "tiny"
    }
    assert served == {"extended": 4.0, "template_dropped": 1.0, "retry": 1.0}
    step = service.last_metrics.values
    assert step[merge_key("mini-swe-agent", "tiny", "break_rate")] == 2 / 6

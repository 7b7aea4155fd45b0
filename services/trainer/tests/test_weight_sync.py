"""Weight sync: the probe rule, labels set only after a pass, failed replicas withdrawn.

The rule and the ring bookkeeping are checked on plain values; the sync itself against the
session's real vLLM CPU replica and the real engine: a replica left on the previous weights after
one ordinary training step fails the probe, is withdrawn over the bus and keeps its old label.
"""

import logging
import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from harnessrl.shared import subjects
from harnessrl.shared.bus import MemoryBus
from harnessrl.shared.contracts import RolloutComplete, UpstreamRegistration
from harnessrl.shared.net import free_port
from harnessrl.trainer.advantages import AssembledRollout, score_groups, token_weights
from harnessrl.trainer.batch import RowBatch
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.errors import WeightSyncError
from harnessrl.trainer.replica import LogprobProbe, PauseMode, VllmReplica
from harnessrl.trainer.samples import TrainingRow
from harnessrl.trainer.settings import AdvantageSettings, TrainerSettings
from harnessrl.trainer.weight_sync import (
    ProbeHistory,
    ProbeReference,
    ReplicaOutcome,
    ReplicaSync,
    RingMembership,
    TrainerProbe,
    UpstreamAnnouncer,
    judge_probe,
)

PROBE = list(range(10, 42))
TOLERANCE = TrainerSettings(run="r", model_dir="m").probe_tolerance  # what the service runs with
log = logging.getLogger(__name__)


# --- the probe rule and the ring, on plain values ------------------------------------------------


def shifted(values: Sequence[float], by: float) -> list[float]:
    return [value + by * (-1) ** index for index, value in enumerate(values)]


NEW = [-2.0, -3.5, -1.25, -4.0]
OLD = shifted(NEW, 4e-4)  # one step apart by less than the tolerance


def test_a_replica_on_the_new_weights_passes_within_noise() -> None:
    reference = ProbeReference(version=2, expected=NEW, previous_version=1, previous=OLD)
    verdict = judge_probe(shifted(NEW, 1e-5), reference, 1e-3)
    assert verdict.passed and math.isclose(verdict.gap, 1e-5, rel_tol=1e-6)


def test_a_replica_on_the_previous_weights_fails_though_within_tolerance() -> None:
    reference = ProbeReference(version=2, expected=NEW, previous_version=1, previous=OLD)
    verdict = judge_probe(shifted(OLD, 1e-5), reference, 1e-3)
    assert not verdict.passed and verdict.gap < 1e-3
    assert "nearer to version 1's" in verdict.reason


def test_a_gap_over_the_tolerance_fails_with_or_without_a_previous_version() -> None:
    for previous in (None, OLD):
        reference = ProbeReference(version=2, expected=NEW, previous_version=1, previous=previous)
        verdict = judge_probe(shifted(NEW, 2e-3), reference, 1e-3)
        assert not verdict.passed and "differ from the trainer's for version 2 by 0.002" in verdict.reason


def test_the_first_sync_and_an_unchanged_probe_judge_by_the_tolerance_alone() -> None:
    first = ProbeReference(version=1, expected=NEW)
    assert judge_probe(shifted(NEW, 5e-4), first, 1e-3).passed
    unchanged = ProbeReference(version=2, expected=NEW, previous_version=1, previous=list(NEW))
    assert judge_probe(shifted(NEW, 5e-4), unchanged, 1e-3).passed


def test_the_history_keeps_the_version_before_the_one_synced() -> None:
    history = ProbeHistory()
    assert history.reference(1, [1.0]).previous is None
    second = history.reference(2, [2.0])
    assert (second.previous_version, second.previous) == (1, [1.0])
    again = history.reference(2, [2.5])  # the same version re-synced: still judged against 1
    assert (again.previous_version, again.previous, again.expected) == (1, [1.0], [2.5])
    third = history.reference(3, [3.0])
    assert (third.previous_version, third.previous) == (2, [2.5])


class Ring:
    """Records what the syncer told the gateways."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    async def withdraw(self, url: str, reason: str) -> None:
        self.events.append(("withdraw", url))

    async def restore(self, url: str) -> None:
        self.events.append(("restore", url))


async def test_failed_replicas_leave_the_ring_and_rejoin_when_they_pass() -> None:
    ring = Ring()
    membership = RingMembership(ring.withdraw, ring.restore)
    a_ok, b_ok = (
        ReplicaOutcome(url="a", passed=True, gap=1e-5),
        ReplicaOutcome(url="b", passed=True, gap=2e-5),
    )
    b_bad = ReplicaOutcome(url="b", passed=False, gap=0.3, reason="stale")

    first = await membership.settle([a_ok, b_ok], 1)  # a process's first sync announces both
    second = await membership.settle([a_ok, b_bad], 2)
    third = await membership.settle([a_ok, b_ok], 3)

    assert (first.gap, first.failed) == (2e-5, ())
    assert (second.gap, second.failed) == (1e-5, ("b",))
    assert third.failed == ()
    assert ring.events == [("restore", "a"), ("restore", "b"), ("withdraw", "b"), ("restore", "b")]


async def test_when_every_replica_fails_all_are_withdrawn_and_the_sync_raises() -> None:
    ring = Ring()
    membership = RingMembership(ring.withdraw, ring.restore)
    outcomes = [ReplicaOutcome(url=url, passed=False, reason="refused") for url in ("a", "b")]
    with pytest.raises(WeightSyncError, match="no replica took version 4: a: refused; b: refused"):
        await membership.settle(outcomes, 4)
    assert ring.events == [("withdraw", "a"), ("withdraw", "b")]


async def test_the_announcer_publishes_withdrawals_and_returns_for_the_gateways() -> None:
    bus = MemoryBus()
    await bus.ensure_streams([subjects.UPSTREAMS])
    announcer = UpstreamAnnouncer(bus, "policy")
    await announcer.withdraw("http://r1:8000", "stale")
    await announcer.restore("http://r1:8000")
    sent = [d.decode(UpstreamRegistration) for d in await bus.replay("UPSTREAMS", subjects.upstreams())]
    assert sent == [
        UpstreamRegistration(url="http://r1:8000", model="policy", active=False),
        UpstreamRegistration(url="http://r1:8000", model="policy", active=True),
    ]
    assert {message.weight_version for message in sent} == {0}  # the gateway's version stamps stay WEIGHTS'


# --- against the real replica and engine ----------------------------------------------------------


class RecordingReplica(VllmReplica):
    """The real client, recording the order of the admin calls a sync makes."""

    def __init__(self, base_url: str, model: str) -> None:
        super().__init__(base_url, model, timeout_s=30.0)
        self.calls: list[str] = []

    async def pause(self, mode: PauseMode = "keep") -> None:
        self.calls.append("pause")
        await super().pause(mode)

    async def resume(self) -> None:
        self.calls.append("resume")
        await super().resume()

    async def reload_from(self, checkpoint_dir: Path | str) -> None:
        self.calls.append("reload")
        await super().reload_from(checkpoint_dir)

    async def probe_logprobs(self, prompt_token_ids: Sequence[int], n_tokens: int = 0) -> LogprobProbe:
        self.calls.append("probe")
        return await super().probe_logprobs(prompt_token_ids, n_tokens)

    async def set_weight_version(self, version: int | str) -> None:
        self.calls.append(f"label {version}")
        await super().set_weight_version(version)


@pytest.fixture
async def replica(vllm_server, tiny_model: Path) -> AsyncIterator[RecordingReplica]:
    """A client for the session's vLLM server; its original weights are back after the test."""
    async with RecordingReplica(vllm_server.url, vllm_server.model) as client:
        yield client
        await client.resume()
        await client.reload_from(tiny_model)


@pytest.fixture
async def gateways() -> MemoryBus:
    """The bus the gateways would read UpstreamRegistrations from."""
    bus = MemoryBus()
    await bus.ensure_streams([subjects.UPSTREAMS])
    return bus


async def registrations(bus: MemoryBus) -> list[tuple[str, bool]]:
    stored = await bus.replay(subjects.UPSTREAMS.name, subjects.upstreams())
    return [(m.url, m.active) for m in (d.decode(UpstreamRegistration) for d in stored)]


def syncer(replicas: list[VllmReplica], bus: MemoryBus, *, collocated: bool = False) -> ReplicaSync:
    announcer = UpstreamAnnouncer(bus, "tiny")
    return ReplicaSync(
        replicas, PROBE, tolerance=TOLERANCE, collocated=collocated,
        on_failed=announcer.withdraw, on_restored=announcer.restore,
    )  # fmt: skip


def trainer_probe(engine: PolicyEngine):
    async def probe(ids):
        row = TrainingRow(
            rollout_id="probe", input_ids=list(ids), prompt_len=1,
            loss_mask=[1] * (len(ids) - 1), logprobs=[0.0] * (len(ids) - 1),
            versions=[0] * (len(ids) - 1),
        )  # fmt: skip
        return engine.row_logprobs([row])[0]

    return probe


def batch_of(rewards: Sequence[float], scale: float) -> RowBatch:
    """One GRPO batch of a group of 8 on the probe's prefix; advantages times `scale`."""
    rollouts = [
        AssembledRollout(
            rollout=RolloutComplete(run="r", episode=f"e{i}", task="t", group="g", reward=reward),
            rows=[
                TrainingRow(
                    rollout_id=f"e{i}", input_ids=[*PROBE[:8], *range(50 + i, 60 + i)], prompt_len=8,
                    loss_mask=[1] * 10, logprobs=[-6.0] * 10, versions=[0] * 10,
                )
            ],
        )
        for i, reward in enumerate(rewards)
    ]  # fmt: skip
    outcome = score_groups(rollouts, AdvantageSettings())
    weights = token_weights(outcome.scored)
    return RowBatch(
        rows=[s.assembled.rows[0] for s in outcome.scored],
        advantages=[s.advantage * scale for s in outcome.scored],
        weights=[weights[s.assembled.rollout_id] for s in outcome.scored],
    )


def ordinary_step(engine: PolicyEngine) -> None:
    """One optimizer update with plain GRPO advantages, as a training step makes."""
    engine.train(batch_of([float(i % 2) for i in range(8)], 1.0), step=200)


def big_step(engine: PolicyEngine) -> None:
    """Three updates with advantages times 20, so the probe's logprobs move far."""
    batch = batch_of([float(i % 2) for i in range(8)], 20.0)
    for step in range(3):
        engine.train(batch, step=100 + step)


def max_gap(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_after_an_update_vllm_matches_the_trainer_and_differs_from_before(
    policy_engine: PolicyEngine, replica: RecordingReplica, gateways: MemoryBus, tmp_path: Path
):
    sync = syncer([replica], gateways)
    probe = trainer_probe(policy_engine)
    first = await sync.sync(policy_engine.export_hf(tmp_path / "v1"), 1, probe)
    before = (await replica.probe_logprobs(PROBE)).prompt

    big_step(policy_engine)
    second = await sync.sync(policy_engine.export_hf(tmp_path / "v2"), 2, probe)

    after = (await replica.probe_logprobs(PROBE)).prompt
    log.info("float32 probe gap (vLLM vs trainer, same weights): %.3g, %.3g", first.gap, second.gap)
    assert first.gap <= TOLERANCE and second.gap <= TOLERANCE and second.failed == ()
    assert max_gap(before, after) > 0.02  # >> tolerance
    assert await replica.weight_info() == "2"


async def test_a_replica_left_on_the_previous_version_fails_is_withdrawn_and_keeps_its_label(
    policy_engine: PolicyEngine, replica: RecordingReplica, gateways: MemoryBus, tmp_path: Path
):
    sync = syncer([replica], gateways)
    probe = trainer_probe(policy_engine)
    previous = policy_engine.export_hf(tmp_path / "v1")
    await sync.sync(previous, 1, probe)
    old_expected = await probe(PROBE)

    ordinary_step(policy_engine)
    new_expected = await probe(PROBE)
    log.info("probe movement of one ordinary step: %.3g", max_gap(old_expected, new_expected))
    replica.calls.clear()
    # The replica "reloads" but still serves version 1's weights (a reload that did not take).
    with pytest.raises(WeightSyncError, match="no replica took version 2"):
        await sync.sync(previous, 2, probe)

    assert replica.calls == ["reload", "probe"]  # probed, never labelled 2
    assert await replica.weight_info() == "1"
    assert await registrations(gateways) == [(replica.base_url, True), (replica.base_url, False)]

    recovered = await sync.sync(policy_engine.export_hf(tmp_path / "v2"), 2, probe)
    assert recovered.failed == () and await replica.weight_info() == "2"
    assert (await registrations(gateways))[-1] == (replica.base_url, True)  # back in the ring


@pytest.fixture(scope="module")
def nudged_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every parameter moved by N(0, 5e-6): a step smaller than the tolerance."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    noise = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * 5e-6)
    out = tmp_path_factory.mktemp("nudged") / "step-2"
    model.save_pretrained(out)
    return out


def reference_probe(model_dir: Path) -> TrainerProbe:
    """The probe logprobs of `model_dir` from a float32 transformers forward pass."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    async def probe(ids: Sequence[int]) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([list(ids)])).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return [float(x) for x in logprobs]

    return probe


async def test_a_replica_a_step_smaller_than_the_tolerance_behind_fails_by_nearness(
    replica: RecordingReplica, gateways: MemoryBus, tiny_model: Path, nudged_model: Path
):
    sync = syncer([replica], gateways)
    old, new = reference_probe(tiny_model), reference_probe(nudged_model)
    first = await sync.sync(tiny_model, 1, old)
    movement = max_gap(await old(PROBE), await new(PROBE))
    log.info("transformers probe gap %.3g; nudged step movement %.3g", first.gap, movement)
    assert first.gap < movement / 10 and movement < TOLERANCE

    with pytest.raises(WeightSyncError, match="nearer to version 1's"):
        await sync.sync(tiny_model, 2, new)  # the reload left the previous weights in place
    assert await replica.weight_info() == "1"
    assert (await registrations(gateways))[-1] == (replica.base_url, False)

    result = await sync.sync(nudged_model, 2, new)
    assert result.gap < movement / 10 and await replica.weight_info() == "2"


async def test_a_reloaded_replica_is_labelled_after_it_passed_and_a_dead_one_is_withdrawn(
    policy_engine: PolicyEngine, replica: RecordingReplica, gateways: MemoryBus, tmp_path: Path
):
    dead = RecordingReplica(f"http://127.0.0.1:{free_port()}", "tiny")  # nothing listens there
    sync = syncer([replica, dead], gateways)
    await replica.set_weight_version("before")
    replica.calls.clear()
    result = await sync.sync(policy_engine.export_hf(tmp_path / "v5"), 5, trainer_probe(policy_engine))
    await dead.close()

    assert replica.calls == ["reload", "probe", "label 5"]
    assert await replica.weight_info() == "5"
    assert result.failed == (dead.base_url,) and result.gap <= TOLERANCE
    assert dead.calls == ["reload"]
    assert (dead.base_url, False) in await registrations(gateways)


async def test_a_first_sync_to_other_weights_fails_on_the_tolerance(
    policy_engine: PolicyEngine, replica: RecordingReplica, gateways: MemoryBus, tiny_model: Path
):
    big_step(policy_engine)
    # The "checkpoint" holds the original weights while the trainer moved on: the probe must see it.
    with pytest.raises(WeightSyncError, match="differ from the trainer's for version 3"):
        await syncer([replica], gateways).sync(tiny_model, 3, trainer_probe(policy_engine))
    assert "label 3" not in replica.calls


async def test_collocated_sync_reloads_frozen_then_probes_then_labels(
    policy_engine: PolicyEngine, replica: RecordingReplica, gateways: MemoryBus, tmp_path: Path
):
    sync = syncer([replica], gateways, collocated=True)
    result = await sync.sync(policy_engine.export_hf(tmp_path / "v7"), 7, trainer_probe(policy_engine))
    assert result.gap <= TOLERANCE
    # Paused across the reload; resumed before the probe, which a paused replica would never run.
    assert replica.calls == ["pause", "reload", "resume", "probe", "label 7"]
    assert not await replica.is_paused()
    assert await replica.weight_info() == "7"

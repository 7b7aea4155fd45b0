"""One training step from assembled rollouts to a committed checkpoint (no bus involved).

`Trainer.step` is what the service loop calls for every batch and what the demo can call
directly: staleness filter, group rules and advantages, one engine update, checkpoint. Rollouts it
trains or drops become *settled*: persisted, so a restart neither retrains nor loses them.

Staleness is decided per group: a group trains only when every member is within the bound, else the
whole group is dropped (`stale`, and `groups/stale`), so a baseline is never computed over the fast
members alone (long episodes, the slow ones, would otherwise be the first to go).

Only a step that trains makes a new version. A batch of current rollouts with nothing to learn from
(every group skipped) is still a step: it is checkpointed (state only) and announced, carrying the
previous version's weights, so the controller's admission, which counts steps, never stalls.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from harnessrl.shared.contracts import StepMetrics
from harnessrl.shared.log import get_logger
from harnessrl.trainer.advantages import (
    AssembledRollout,
    GroupOutcome,
    ScoredRollout,
    score_groups,
    split_stale,
    token_weights,
)
from harnessrl.trainer.batch import RowBatch
from harnessrl.trainer.checkpoint import CheckpointStore, TrainerState, weights_digest
from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.errors import TrainerError
from harnessrl.trainer.metrics import batch_metrics
from harnessrl.trainer.samples import BuildReport
from harnessrl.trainer.settings import TrainerSettings

log = get_logger(__name__)


class StepResult(msgspec.Struct, kw_only=True):
    """What one call to `Trainer.step` did.

    `trained`: new weights, a new version. `checkpoint` without `trained`: a step that trained
    nothing (the previous weights carried over). Neither: no step (stale or settled rollouts only).
    """

    trained: bool
    metrics: StepMetrics
    checkpoint: Path | None = None


class Trainer:
    """Holds the engine, the checkpoint store and the trainer state of one run."""

    def __init__(self, settings: TrainerSettings, engine: PolicyEngine | None = None) -> None:
        self.settings = settings
        self.store = CheckpointStore(settings.checkpoint_root)
        self.state = self.store.load_state(settings.run)
        self.settled: set[str] = self._load_settled()
        self.engine = engine or PolicyEngine(Path(settings.model_dir), settings.engine, settings.loss)
        weights = self.store.weights_dir(self.state)
        if weights is not None:
            self._check_ranks()
            self.engine.load(weights / "engine")
        if self.state.step > 0:
            log.info("trainer.resumed", step=self.state.step, version=self.state.version)

    def _check_ranks(self) -> None:
        """The engine checkpoint holds one verl shard per rank: resuming needs the same rank count."""
        if self.state.ranks != self.engine.ranks.size:
            raise TrainerError(
                f"run {self.settings.run} was checkpointed on {self.state.ranks} rank(s) and resumes"
                f" on {self.engine.ranks.size}: start the trainer with {self.state.ranks} rank(s)"
            )

    @property
    def version(self) -> int:
        """The current policy version (0 = the starting model)."""
        return self.state.version

    def hf_dir(self) -> Path:
        """The HF weights of the current version (the base model before the first trained step)."""
        weights = self.store.weights_dir(self.state)
        return weights / "hf" if weights is not None else Path(self.settings.model_dir)

    def settle_window(self, version: int) -> int:
        """The oldest version whose settled ids still matter at `version`.

        A rollout settled at version v had min_version <= v, so at a version beyond
        v + allowed_lag it is stale: a redelivery is dropped by the staleness filter instead.
        """
        return version - self.settings.allowed_lag - 1

    def _load_settled(self) -> set[str]:
        recent = [*self.state.trained.values(), *self.store.load_dropped().values()]
        return {rollout_id for ids in recent for rollout_id in ids}

    def drop(self, ids: Sequence[str]) -> None:
        """Settle rollouts without training them (persisted before returning)."""
        fresh = [rollout_id for rollout_id in ids if rollout_id not in self.settled]
        self.store.add_dropped(self.version, fresh)
        self.settled.update(fresh)

    def step(
        self,
        rollouts: Sequence[AssembledRollout],
        reports: Mapping[str, BuildReport] | None = None,
    ) -> StepResult:
        """Train on `rollouts` (whole groups) and checkpoint; drops what can't be trained."""
        started = time.monotonic()
        fresh = [item for item in rollouts if item.rollout_id not in self.settled]
        current, stale = split_stale(fresh, version=self.version, lag=self.settings.allowed_lag)
        outcome = score_groups(current, self.settings.advantages)
        dropped = Counter(outcome.dropped)
        if stale:
            dropped["stale"] += len(stale)
        self.drop([item.rollout_id for item in stale] + outcome.dropped_ids)
        values, staleness = batch_metrics(
            fresh, outcome, reports or {}, version=self.version,
            pass_threshold=self.settings.pass_threshold,
        )  # fmt: skip
        values["groups/stale"] = float(len({item.rollout.group for item in stale}))
        if not outcome.scored:
            return self._untrained(values, staleness, dropped, is_step=bool(current))
        batch = self._row_batch(outcome.scored)
        rows = batch.rows
        update = self.engine.train(batch, step=self.state.step + 1)
        if not math.isfinite(update.get("grad_norm", 0.0)):
            return self._skipped_update(values, update, staleness, dropped, outcome)
        values.update(update)
        checkpoint = self._checkpoint([item.assembled.rollout_id for item in outcome.scored])
        elapsed = time.monotonic() - started
        values["perf/step_s"] = elapsed
        values["perf/tokens_per_s"] = sum(len(row.input_ids) for row in rows) / max(elapsed, 1e-9)
        metrics = self._metrics(values, staleness, dropped, trained=True)
        return StepResult(trained=True, metrics=metrics, checkpoint=checkpoint)

    def _row_batch(self, scored: Sequence[ScoredRollout]) -> RowBatch:
        """The step's rows with their advantages, per-rollout weights and sampling temperature."""
        weights = token_weights(scored)
        batch = RowBatch(rows=[], advantages=[], weights=[], temperature=self._temperature(scored))
        for item in scored:
            for row in item.assembled.rows:
                batch.rows.append(row)
                batch.advantages.append(item.advantage)
                batch.weights.append(weights[item.assembled.rollout_id])
        return batch

    def _temperature(self, scored: Sequence[ScoredRollout]) -> float:
        """The configured temperature, else the one the rows were sampled at (the run's sampling)."""
        if self.settings.engine.temperature is not None:
            return self.settings.engine.temperature
        seen = Counter(row.temperature for item in scored for row in item.assembled.rows)
        return seen.most_common(1)[0][0] if seen else 1.0

    def _skipped_update(
        self,
        values: dict[str, float],
        update: dict[str, float],
        staleness: dict[str, int],
        dropped: Counter[str],
        outcome: GroupOutcome,
    ) -> StepResult:
        """Verl skipped the optimizer step (non-finite gradient norm): the weights did not change.

        The step carries the previous version like one that trained nothing; its rollouts are
        settled as `nonfinite_gradient` (retraining them would fail the same way) and the update's
        non-finite values are left out of the metrics (kept: how many there were).
        """
        ids = [item.assembled.rollout_id for item in outcome.scored]
        self.drop(ids)
        dropped["nonfinite_gradient"] += len(ids)
        finite = {key: value for key, value in update.items() if math.isfinite(value)}
        values.update(finite)
        values["step/nonfinite_gradient"] = 1.0
        values["step/nonfinite_values"] = float(len(update) - len(finite))
        log.warning("step.nonfinite_gradient", step=self.state.step + 1, rollouts=len(ids))
        return self._untrained(values, staleness, dropped, is_step=True)

    def _untrained(
        self, values: dict[str, float], staleness: dict[str, int], dropped: Counter[str], *, is_step: bool
    ) -> StepResult:
        """A batch with nothing to learn from; `dropped` counts why.

        With current rollouts (every group skipped: zero variance, too small, no trainable tokens)
        it is a step that carries the previous weights; with only stale or settled ones, no step.
        """
        if not is_step:
            return StepResult(trained=False, metrics=self._metrics(values, staleness, dropped, trained=False))
        values["step/skipped"] = 1.0
        checkpoint = self._carry_step()
        metrics = self._metrics(values, staleness, dropped, trained=False)
        return StepResult(trained=False, metrics=metrics, checkpoint=checkpoint)

    def _checkpoint(self, trained_ids: list[str]) -> Path:
        """Commit a trained step: its weights (HF and engine) under a new version."""
        step = self.state.step + 1
        staging = self.store.staging(step)
        self.engine.export_hf(staging / "hf")
        self.engine.save(staging / "engine", step)
        state = self._next_state(
            trained_ids, version=self.state.version + 1, weights_step=step,
            digest=weights_digest(staging / "hf"),
        )  # fmt: skip
        return self._commit(staging, state)

    def _carry_step(self) -> Path:
        """Commit a step that trained nothing: state only; version and weights stay the previous."""
        digest = self.state.digest or weights_digest(self.hf_dir())
        state = self._next_state(
            [], version=self.state.version, weights_step=self.state.weights_step, digest=digest
        )
        return self._commit(self.store.staging(state.step), state)

    def _next_state(
        self, trained_ids: list[str], *, version: int, weights_step: int, digest: str
    ) -> TrainerState:
        """The state after this step: settled ids outside the window at `version` forgotten."""
        oldest = self.settle_window(version)
        trained = {v: ids for v, ids in self.state.trained.items() if v >= oldest}
        if trained_ids:
            trained[self.state.version] = [*trained.get(self.state.version, []), *trained_ids]
        return TrainerState(
            run=self.settings.run, step=self.state.step + 1, version=version, trained=trained,
            weights_step=weights_step, digest=digest, ranks=self.engine.ranks.size,
        )  # fmt: skip

    def _commit(self, staging: Path, state: TrainerState) -> Path:
        final = self.store.commit(staging, state)
        self.store.forget_dropped_before(self.settle_window(state.version))
        self.state = state
        self.settled = self._load_settled()
        return final

    def mark_published(self) -> None:
        """Record that the current step's WeightVersion went out."""
        self.store.mark_published(self.state)

    def _metrics(
        self,
        values: dict[str, float],
        staleness: dict[str, int],
        dropped: Counter[str],
        *,
        trained: bool,
    ) -> StepMetrics:
        return StepMetrics(
            run=self.settings.run,
            step=self.state.step,
            version=self.state.version,
            values=values,
            staleness=staleness,
            dropped=dict(dropped),
            trained=trained,
        )

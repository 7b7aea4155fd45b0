"""The trainer service: rollouts in from the bus, weight versions out.

Acknowledgement rule: a rollout is acked only once a checkpoint covers it (trained in a committed
step, or dropped and persisted). The bus acks when a handler returns, so the handler settles a
rollout it has not yet covered by raising `RolloutNotSettled` (a `TransientError`): JetStream
redelivers it after `ack_recheck_s`, and the redelivery is acked once the rollout is settled.
After a kill -9 the unacked rollouts come back; the settled ones are acked without training, the
rest are assembled again. A restart also republishes the latest step's announcement if the crash
came between checkpoint and publish (`published` flag), and reloads the replicas from the latest
checkpoint's weights.

Every step is announced with a `WeightVersion`, because the controller's admission counts steps.
Only a step that trained makes a new version and reloads the replicas; one that trained nothing
announces the previous version again with its own step and `carries_previous` set.

Steps run on a worker thread so the consumer keeps assembling rollouts while the engine trains
(the asynchronous mode's overlap); sync vs async differ only in the staleness bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus, BusError, ConsumerSpec, Delivery, PermanentError, Subscription
from harnessrl.shared.contracts import RolloutComplete, Span, StepMetrics, WeightVersion
from harnessrl.shared.log import get_logger
from harnessrl.trainer.advantages import AssembledRollout
from harnessrl.trainer.assembly import RolloutPool
from harnessrl.trainer.errors import RolloutNotSettled
from harnessrl.trainer.metrics import MetricsSink
from harnessrl.trainer.prometheus import TrainerMetrics
from harnessrl.trainer.replica import wait_serving
from harnessrl.trainer.training import StepResult, Trainer
from harnessrl.trainer.weight_sync import SyncResult, WeightSyncer, probe_row

log = get_logger(__name__)


class TrainerService:
    """Consumes ROLLOUTS, trains in whole-group batches, syncs replicas, publishes versions."""

    def __init__(
        self, bus: Bus, trainer: Trainer, sync: WeightSyncer, sink: MetricsSink | None = None
    ) -> None:
        self.bus = bus
        self.trainer = trainer
        self.settings = trainer.settings
        self.sync = sync
        self.sink = sink or MetricsSink(self.settings.run)
        self.pool = RolloutPool(
            self.settings.pool, self.settings.limits, temperature=self.settings.engine.temperature
        )
        # Prometheus metrics (`app.serve` serves them); StepMetrics stay the per-step record.
        self.prometheus = TrainerMetrics(self.pool, trainer)
        # Rollouts whose spans failed to decode, with the tries so far (bounded: decode_attempts).
        self._decode_failures: dict[str, int] = {}
        self.steps_done = asyncio.Event()
        self.last_metrics: StepMetrics | None = None
        self._subscription: Subscription | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._step_task: asyncio.Future[None] | None = None
        self._started = asyncio.Event()
        self._wake = asyncio.Event()
        # Rollouts of the step being trained: out of the pool, not yet settled.
        self._in_step: set[str] = set()

    async def start(self) -> None:
        """Bring replicas and the WEIGHTS stream up to the latest checkpoint, then consume.

        Replicas still starting are waited for (`replica_wait_s`); the sync then judges them all.
        """
        if down := await wait_serving(self.settings.replicas, self.settings.replica_wait_s):
            log.warning("trainer.replicas_not_serving", replicas=down, waited_s=self.settings.replica_wait_s)
        await self._sync_replicas()
        state = self.trainer.state
        if state.step > 0 and not state.published:
            if await self._already_published(state.step):
                self.trainer.mark_published()
            else:
                await self._publish_version()
        if state.step > 0:
            await self._recover_metrics()
        spec = ConsumerSpec(
            stream=subjects.ROLLOUTS.name,
            filter_subject=subjects.rollout(self.settings.run),
            durable=subjects.trainer_consumer(self.settings.run),
            max_deliver=-1,
            ack_wait_s=self.settings.ack_wait_s,
            batch=128,
        )
        self._subscription = await self.bus.subscribe(spec, self._on_rollout)
        self._loop_task = asyncio.create_task(self._train_loop(), name="trainer-loop")
        self._started.set()
        log.info("trainer.started", run=self.settings.run, version=self.trainer.version)

    async def stop(self) -> None:
        """Stop consuming and training (a step in flight finishes first)."""
        if self._subscription is not None:
            await self._subscription.stop()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._step_task is not None:
            await asyncio.gather(self._step_task, return_exceptions=True)
        await self.sync.close()
        self.sink.close()

    async def wait(self) -> None:
        """Until the training loop ends (max_steps reached or a fatal error, which it raises).

        May be awaited before `start` (as `run_until_signalled` does): it waits for the loop first.
        """
        await self._started.wait()
        if self._loop_task is not None:
            await self._loop_task

    async def _on_rollout(self, delivery: Delivery) -> None:
        rollout = delivery.decode(RolloutComplete)
        key = rollout.episode
        if key in self.trainer.settled:
            return
        if key not in self._in_step and (not self.pool.knows(key) or self.pool.is_pending(key)):
            status = await self._offer(rollout)
            if status == "dropped":
                self.trainer.drop([key])
                return
            self._wake.set()
        raise RolloutNotSettled("rollout not yet covered by a checkpoint", delay=self.settings.ack_recheck_s)

    async def _offer(self, rollout: RolloutComplete) -> str:
        """Offer the rollout with its stored spans; a rollout that can't be decoded has bounded tries.

        Spans that fail to decode or to become rows (a token-delta error, a corrupt span) fail the
        same way every time: after `decode_attempts` tries the rollout is dead-lettered with the
        reason (`PermanentError`) and leaves its group as `undecodable`, so the group isn't held.
        """
        key = rollout.episode
        try:
            spans = await self._spans_of(rollout)
            status = self.pool.offer(rollout, spans, time.monotonic())
        except BusError:
            raise
        except Exception as exc:
            tries = self._decode_failures[key] = self._decode_failures.get(key, 0) + 1
            reason = f"spans of {key} can't be decoded ({type(exc).__name__}: {exc})"
            log.warning("rollout.undecodable", rollout=key, tries=tries, error=str(exc))
            if tries < self.settings.decode_attempts:
                raise RolloutNotSettled(reason, delay=self.settings.ack_recheck_s) from exc
            self._decode_failures.pop(key, None)
            self.pool.add_undecodable(rollout, time.monotonic())
            self._wake.set()
            raise PermanentError(f"{reason}; dead-lettered after {tries} tries") from exc
        self._decode_failures.pop(key, None)
        return status

    async def _spans_of(self, rollout: RolloutComplete) -> list[Span]:
        subject = subjects.span(rollout.run, rollout.episode)
        deliveries = await self.bus.replay(subjects.SPANS.name, subject)
        return [delivery.decode(Span) for delivery in deliveries]

    async def _train_loop(self) -> None:
        while not self._done():
            self.trainer.drop(self.pool.expire(time.monotonic()))
            ready = self.pool.ready_groups(time.monotonic())
            if len(ready) < self.settings.batch_groups:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                continue
            batch = self.pool.take(ready[: self.settings.batch_groups])
            # Shielded: a stop waits for the step in flight to be checkpointed *and* announced
            # (weights, metrics), so a restart never finds a step whose metrics were never sent.
            self._step_task = asyncio.ensure_future(self._step(batch))
            await asyncio.shield(self._step_task)

    async def _step(self, batch: list[AssembledRollout]) -> None:
        # An undecodable member has no report (it became no rows at all).
        found = {item.rollout_id: self.pool.reports.pop(item.rollout_id, None) for item in batch}
        reports = {key: report for key, report in found.items() if report is not None}
        self._in_step = {item.rollout_id for item in batch}
        try:
            with self.prometheus.step_duration.time():
                result = await asyncio.to_thread(self.trainer.step, batch, reports)
        finally:
            self._in_step = set()
        self.prometheus.observe_step(result)
        await self._after_step(result)

    def _done(self) -> bool:
        limit = self.settings.max_steps
        return bool(limit) and self.trainer.state.step >= limit

    async def _after_step(self, result: StepResult) -> None:
        values = dict(result.metrics.values)
        for reason, count in self.pool.dropped.items():
            values[f"dropped_total/{reason}"] = float(count)
        if result.trained:
            synced = await self._sync_replicas()
            values["sync/probe_gap"] = synced.gap
            values["sync/failed_replicas"] = float(len(synced.failed))
        if result.checkpoint is not None:
            await self._publish_version()
        metrics = StepMetrics(
            run=result.metrics.run,
            step=result.metrics.step,
            version=result.metrics.version,
            values=values,
            staleness=result.metrics.staleness,
            dropped=result.metrics.dropped,
            final=self._done(),
            trained=result.trained,
        )
        self.last_metrics = metrics
        self.sink.write(metrics)
        await self._send_metrics(metrics)
        self.steps_done.set()

    async def _send_metrics(self, metrics: StepMetrics) -> None:
        await self.bus.publish(
            subjects.metrics(self.settings.run, subjects.TRAINER_SOURCE),
            metrics,
            msg_id=f"{self.settings.run}:metrics:{metrics.step}:{metrics.version}:{metrics.at}",
        )

    async def _recover_metrics(self) -> None:
        """Announce the checkpointed step whose metrics never went out (a kill -9 right after it)."""
        state = self.trainer.state
        stored = await self.bus.replay(
            subjects.METRICS.name, subjects.metrics(self.settings.run, subjects.TRAINER_SOURCE)
        )
        if any(item.decode(StepMetrics).step == state.step for item in stored):
            return
        values = {"step/recovered": 1.0}  # the step's own values died with the process
        metrics = StepMetrics(
            run=state.run, step=state.step, version=state.version, values=values,
            final=self._done(), trained=not state.carries_previous,
        )  # fmt: skip
        await self._send_metrics(metrics)
        log.warning("metrics.recovered", run=state.run, step=state.step)

    async def _sync_replicas(self) -> SyncResult:
        version = self.trainer.version
        hf_dir = self.trainer.hf_dir()
        with self.prometheus.sync_duration.time():
            synced = await self.sync.sync(hf_dir, version, self._trainer_probe)
        self.prometheus.observe_sync(synced)
        return synced

    async def _trainer_probe(self, token_ids: Sequence[int]) -> list[float]:
        row = probe_row(token_ids)
        logprobs = await asyncio.to_thread(self.trainer.engine.row_logprobs, [row])
        return logprobs[0]

    async def _already_published(self, step: int) -> bool:
        """Whether WEIGHTS announces `step` (the crash came between publish and marking it)."""
        stored = await self.bus.replay(subjects.WEIGHTS.name, subjects.weights(self.settings.run))
        return any(item.decode(WeightVersion).step == step for item in stored)

    async def _publish_version(self) -> None:
        """Announce the current step: a new version, or the previous one carried over."""
        state = self.trainer.state
        message = WeightVersion(
            run=self.settings.run,
            version=state.version,
            step=state.step,
            checkpoint_uri=str(self.trainer.hf_dir().resolve()),
            digest=state.digest,
            carries_previous=state.carries_previous,
        )
        await self.bus.publish(subjects.weights(self.settings.run), message, msg_id=version_msg_id(message))
        self.trainer.mark_published()
        log.info(
            "weights.published", run=self.settings.run, version=state.version, step=state.step,
            carries_previous=message.carries_previous,
        )  # fmt: skip


def version_msg_id(message: WeightVersion) -> str:
    """`<run>:<version>` for new weights; a step carrying them over adds its step (JetStream dedupes ids)."""
    base = f"{message.run}:{message.version}"
    return f"{base}:step-{message.step}" if message.carries_previous else base

"""Per-step metrics: computed from the batch, logged, written to TensorBoard, published on the bus.

`StepMetrics` goes to `hrl.metrics.<run>.trainer` (stream METRICS) for dashboards; TensorBoard
(`tensorboard_dir`) and verl's tracking back-ends (W&B, MLflow: `trackers`) are optional sinks.

Sample-building counts (`BuildReport`: sampled tokens and why some train in no row, row splits,
mismatches) are summed over every rollout of the batch that has a report, trained or not: they
describe what the harness and the limits did to the data, which a skipped group (zero variance,
stale) doesn't change. `tokens/trained` alone counts what this step's update trained.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from harnessrl.shared.contracts import StepMetrics
from harnessrl.shared.log import get_logger
from harnessrl.trainer.advantages import AssembledRollout, GroupOutcome
from harnessrl.trainer.samples import BuildReport

log = get_logger(__name__)


def batch_metrics(
    rollouts: Sequence[AssembledRollout],
    outcome: GroupOutcome,
    reports: Mapping[str, BuildReport],
    *,
    version: int,
    pass_threshold: float,
) -> tuple[dict[str, float], dict[str, int]]:
    """Reward, pass rate, row and sample-building statistics; plus the staleness histogram."""
    rewards = [item.rollout.reward for item in rollouts]
    trained = [item.assembled for item in outcome.scored]
    rows = [len(item.rows) for item in trained]
    values: dict[str, float] = {
        "reward/mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "reward/pass_rate": (sum(r >= pass_threshold for r in rewards) / len(rewards) if rewards else 0.0),
        "rollouts/trained": float(len(trained)),
        "rollouts/rows_per_rollout": statistics.fmean(rows) if rows else 0.0,
        "rollouts/single_row_rate": sum(r == 1 for r in rows) / len(rows) if rows else 0.0,
        "groups/trained": float(outcome.groups_trained),
        "groups/zero_variance": float(outcome.groups_zero_variance),
        "groups/too_small": float(outcome.groups_too_small),
        "tokens/trained": float(sum(item.trained_tokens for item in trained)),
    }
    reported = [reports[item.rollout_id] for item in rollouts if item.rollout_id in reports]
    if reported:
        values.update(report_values(reported))
    staleness = Counter(str(version - item.min_version) for item in trained)
    return values, dict(staleness)


def report_values(reports: Sequence[BuildReport]) -> dict[str, float]:
    """The sample-building counts of `reports`, summed, under their step metric names.

    `tokens/sampled` = `tokens/trainable` (loss tokens in the rows) + `tokens/untrained`, which is
    the sum of the `tokens/<reason>` counts after it; `unmodeled_sampling/<reason>` splits
    `tokens/unmodeled_sampling` and `mismatch/<kind>` counts the calls that started a new row.
    """
    totals: Counter[str] = Counter()
    for report in reports:
        totals.update(
            {
                "tokens/sampled": report.sampled_tokens,
                "tokens/trainable": report.trained_tokens,
                "tokens/untrained": report.untrained_tokens,
                "tokens/skipped": report.skipped_tokens,
                "tokens/prompt_too_long": report.prompt_too_long_tokens,
                "tokens/truncated": report.truncated_tokens,
                "tokens/missing_logprob": report.missing_logprob_tokens,
                "tokens/dead_end": report.dead_end_tokens,
                "tokens/unmodeled_sampling": report.unmodeled_sampling_tokens,
                "rows/truncated": report.truncated_rows,
                "spans/skipped": report.skipped_spans,
                "prompts/too_long": report.prompt_too_long,
            }
        )
        totals.update({f"unmodeled_sampling/{reason}": n for reason, n in report.unmodeled_sampling.items()})
        totals.update({f"mismatch/{kind}": n for kind, n in report.mismatches.items()})
    return {name: float(count) for name, count in totals.items()}


class MetricsSink:
    """structlog always; TensorBoard and verl tracking when configured."""

    def __init__(self, run: str, tensorboard_dir: str = "", trackers: Sequence[str] = ()) -> None:
        self.run = run
        self._writer: Any = None
        self._tracking: Any = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=tensorboard_dir)
        if trackers:
            from verl.utils.tracking import Tracking

            self._tracking = Tracking(
                project_name="harnessrl", experiment_name=run, default_backend=list(trackers)
            )

    def write(self, metrics: StepMetrics) -> None:
        """Emit one step everywhere configured."""
        log.info(
            "step.completed",
            run=self.run,
            step=metrics.step,
            version=metrics.version,
            dropped=metrics.dropped,
            staleness=metrics.staleness,
            **{key.replace("/", "_"): round(value, 5) for key, value in metrics.values.items()},
        )
        if self._writer is not None:
            for key, value in metrics.values.items():
                self._writer.add_scalar(key, value, metrics.step)
            self._writer.flush()
        if self._tracking is not None:
            self._tracking.log(data=dict(metrics.values), step=metrics.step)

    def close(self) -> None:
        """Flush and close the writers."""
        if self._writer is not None:
            self._writer.close()

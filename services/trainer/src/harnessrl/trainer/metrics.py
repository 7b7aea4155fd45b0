"""Per-step metrics: computed from the batch, logged, written to TensorBoard, published on the bus.

`StepMetrics` goes to `hrl.metrics.<run>.trainer` (stream METRICS) for dashboards; TensorBoard
(`tensorboard_dir`) and verl's tracking back-ends (W&B, MLflow: `trackers`) are optional sinks.

Sample-building counts (`BuildReport`: sampled tokens and why some train in no row, row splits,
mismatches) are summed over every rollout of the batch that has a report, trained or not: they
describe what the harness and the limits did to the data, which a skipped group (zero variance,
stale) doesn't change. `tokens/trained` alone counts what this step's update trained.

Break classes per harness and model (`merge/<harness>/<model>/<class>`, from `LabelledReport`):
how many calls extended a row (`extended`) and how many started a new one, by mismatch kind
(`samples.MISMATCH_KINDS`); `merge/<harness>/<model>/break_rate` is the broken share of the calls
that followed another. A label's `/` is written `_` so the key splits back into its parts.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from harnessrl.shared.contracts import StepMetrics
from harnessrl.shared.log import get_logger
from harnessrl.trainer.advantages import AssembledRollout, GroupOutcome
from harnessrl.trainer.samples import MISMATCH_KINDS, BuildReport

log = get_logger(__name__)

UNKNOWN = "unknown"
MERGE_PREFIX = "merge/"
# What a call did to its rollout's rows: extended one, or broke off by a mismatch kind.
MERGE_OUTCOMES = ("extended", *MISMATCH_KINDS)


class LabelledReport(BuildReport, kw_only=True):
    """A rollout's `BuildReport` with who made its calls: the harness, the model, how many calls.

    `calls` counts the ok calls with tokens. The first call opens a row; of the others each break
    (`mismatches`) opened a new one, a prompt too long opened none, and the rest extended a row
    (a break whose prompt was then too long counts in both, so `extended` is a lower bound).
    """

    harness: str = UNKNOWN
    model: str = UNKNOWN
    calls: int = 0

    @property
    def extended(self) -> int:
        """Calls that extended a row."""
        followers = max(0, self.calls - 1)
        return max(0, followers - sum(self.mismatches.values()) - self.prompt_too_long)


def merge_key(harness: str, model: str, outcome: str) -> str:
    """The step-metric name of one break class (or `break_rate`) of a harness and model."""
    return f"{MERGE_PREFIX}{_label(harness)}/{_label(model)}/{outcome}"


def split_merge_key(name: str) -> tuple[str, str, str] | None:
    """(harness, model, outcome) of a `merge_key`, None for any other name."""
    parts = name.removeprefix(MERGE_PREFIX).split("/") if name.startswith(MERGE_PREFIX) else []
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


def _label(value: str) -> str:
    return value.replace("/", "_") or UNKNOWN


def merge_values(reports: Sequence[BuildReport]) -> dict[str, float]:
    """The break classes of the labelled `reports`, summed per harness and model, with each break rate."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for report in reports:
        if isinstance(report, LabelledReport):
            labels = (report.harness, report.model)
            counts[(*labels, "extended")] += report.extended
            counts.update({(*labels, kind): n for kind, n in report.mismatches.items()})
    values = {merge_key(*key): float(n) for key, n in counts.items()}
    for harness, model in {key[:2] for key in counts}:
        broken = sum(counts[(harness, model, kind)] for kind in MISMATCH_KINDS)
        followers = broken + counts[(harness, model, "extended")]
        values[merge_key(harness, model, "break_rate")] = broken / followers if followers else 0.0
    return values


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
        values.update(merge_values(reported))
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

"""Subjects, streams and KV buckets: the whole bus layout in one module.

Subject tokens may not contain `.`, `*`, `>` or whitespace; `token()` enforces that for every id we
put into a subject, so an id can never widen a subscription.
"""

from __future__ import annotations

import re

import msgspec

PREFIX = "hrl"
_TOKEN = re.compile(r"^[A-Za-z0-9_\-:=]+$")


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The configuration we own for one JetStream stream."""

    name: str
    subjects: list[str]
    storage: str = "file"
    max_age_s: float = 0.0
    duplicate_window_s: float = 120.0
    max_msg_size: int = 8 * 1024 * 1024


class BucketSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A JetStream key-value bucket."""

    name: str
    history: int = 1


def token(value: str) -> str:
    """Validate one subject token (a run, episode or event id)."""
    if not _TOKEN.match(value):
        raise ValueError(f"not a valid subject token: {value!r}")
    return value


def span(run: str, episode: str) -> str:
    """Subject of one span of an episode."""
    return f"{PREFIX}.span.{token(run)}.{token(episode)}"


def spans_of_run(run: str) -> str:
    """Filter for every span of a run."""
    return f"{PREFIX}.span.{token(run)}.*"


def episode_event(run: str, episode: str, kind: str) -> str:
    """Subject of one lifecycle event."""
    return f"{PREFIX}.episode.{token(run)}.{token(episode)}.{token(kind)}"


def episode_events_of_run(run: str, kind: str = "*") -> str:
    """Filter for a run's lifecycle events, optionally of one kind."""
    return f"{PREFIX}.episode.{token(run)}.*.{kind}"


def run_event(run: str, kind: str) -> str:
    """Subject of a run-level event (e.g. `stopped`)."""
    return f"{PREFIX}.run.{token(run)}.{token(kind)}"


def rollout(run: str) -> str:
    """Subject of rollout-complete messages of a run."""
    return f"{PREFIX}.rollout.{token(run)}"


def weights(run: str) -> str:
    """Subject of weight versions of a run."""
    return f"{PREFIX}.weights.{token(run)}"


def trainer_consumer(run: str) -> str:
    """Durable ROLLOUTS consumer of a run's trainer (its presence shows a trainer serves the run)."""
    return f"trainer-{token(run)}"


def episode_events_of_kind(kind: str) -> str:
    """Filter for one kind of lifecycle event of every run and episode (`hrl.episode.*.*.<kind>`)."""
    return f"{PREFIX}.episode.*.*.{token(kind)}"


def metrics_of_source(source: str) -> str:
    """Filter for one source's metrics in every scope (`hrl.metrics.*.<source>`)."""
    return f"{PREFIX}.metrics.*.{token(source)}"


# Sources of per-step `StepMetrics`: the trainer's steps, a run's held-out evaluations.
TRAINER_SOURCE = "trainer"
HELDOUT_SOURCE = "heldout"


def metrics(run: str, source: str) -> str:
    """Subject of per-step metrics a service publishes for dashboards."""
    return f"{PREFIX}.metrics.{token(run)}.{token(source)}"


def metrics_of_run(run: str) -> str:
    """Filter for every metrics source of a run (`hrl.metrics.<run>.*`)."""
    return f"{PREFIX}.metrics.{token(run)}.*"


# The scope token of service summaries: not a valid run name, so never a run's metrics subject.
SERVICE_SCOPE = "_service"


def service_metrics(service: str) -> str:
    """Where `service`'s processes publish their `ServiceMetrics` (`hrl.metrics._service.<service>`)."""
    return metrics(SERVICE_SCOPE, service)


def upstreams() -> str:
    """Subject where vLLM replicas register with the gateways."""
    return f"{PREFIX}.upstream"


def dead_letter(subject: str) -> str:
    """Where a message that can never be handled is copied, keeping its original subject."""
    return f"{PREFIX}.dlq.{subject}"


def control(service: str, verb: str) -> str:
    """Request-reply subject of a service's control API (e.g. controller episode open/close)."""
    return f"{PREFIX}.ctl.{token(service)}.{token(verb)}"


SPANS = StreamSpec(name="SPANS", subjects=[f"{PREFIX}.span.>"])
EPISODES = StreamSpec(name="EPISODES", subjects=[f"{PREFIX}.episode.>"])
RUNS = StreamSpec(name="RUNS", subjects=[f"{PREFIX}.run.>"])
ROLLOUTS = StreamSpec(name="ROLLOUTS", subjects=[f"{PREFIX}.rollout.>"])
WEIGHTS = StreamSpec(name="WEIGHTS", subjects=[f"{PREFIX}.weights.>"])
METRICS = StreamSpec(name="METRICS", subjects=[f"{PREFIX}.metrics.>"], max_age_s=7 * 86400.0)
UPSTREAMS = StreamSpec(name="UPSTREAMS", subjects=[f"{PREFIX}.upstream"])
DLQ = StreamSpec(name="DLQ", subjects=[f"{PREFIX}.dlq.>"])
ALL_STREAMS = (SPANS, EPISODES, RUNS, ROLLOUTS, WEIGHTS, METRICS, UPSTREAMS, DLQ)

EPISODE_STATE = BucketSpec(name="hrl-episodes")
# One key per controller group naming its active controller (the lease, `harnessrl.controller.lease`).
CONTROLLER_LEASE = BucketSpec(name="hrl-controller-lease")
ARTIFACTS_BUCKET = "hrl-artifacts"
# The reward workers' graded results, so a redelivered `agent_exited` is answered, not graded again.
REWARD_RESULTS = BucketSpec(name="hrl-rewards")


def artifact_object(run: str, episode: str, kind: str) -> str:
    """Name of an episode's artifact of `kind` in `ARTIFACTS_BUCKET` (gateway writes, others read)."""
    return f"{run}/{episode}/{kind}"

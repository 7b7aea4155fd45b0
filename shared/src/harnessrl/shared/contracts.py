"""Event contracts: every message that crosses the bus, defined once.

All messages are frozen, keyword-only msgspec Structs encoded as msgpack. Each carries a `schema`
version; a consumer that reads a version it does not know raises `ContractError` instead of guessing.
Episode events form one tagged union (`kind` field) so a single stream holds the whole lifecycle.
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

import msgspec

from harnessrl.shared.datasetspec import DatasetSpec

SCHEMA_VERSION = 1

ApiKind = Literal["chat", "completions", "responses", "messages"]
SpanStatus = Literal["ok", "aborted", "error"]
# How a token-in call's prompt was built (gateway `token_in`): `extended` spliced the parent span's
# exact prompt + sampled ids and rendered only the new turns; `fresh` is the episode's first call or
# has no assistant turn; `branched` has assistant turns no stored answer proves (the client edited,
# dropped or compacted them): spliced from the deepest proven parent if any, else the plain
# render, and the trainer masks what it can't match.
TokenInCase = Literal["extended", "fresh", "branched"]
FailureCause = Literal["infra", "agent", "timeout", "reward-error"]
RunMode = Literal["sync", "async"]
# Request fields the gateway sets on every call of a run, over the harness's own (e.g.
# `{"temperature": 1.0}`), so the policy samples as training assumes whatever the harness asks for.
Sampling = dict[str, bool | int | float | str]


class ContractError(ValueError):
    """A payload is not a valid message of the expected type or schema version."""


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every bus message: carries the schema version."""

    schema: int = SCHEMA_VERSION


def now() -> float:
    """Wall-clock time in seconds since the epoch, the timestamp format of every contract."""
    return time.time()


# --- spans -----------------------------------------------------------------------------------------


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token usage of one LLM call as reported upstream."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """One sampled choice: exactly the token ids vLLM sampled, with their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    text: str = ""


class Span(Message, frozen=True, kw_only=True):
    """One LLM call of one episode, captured token by token by the gateway.

    The prompt is delta-encoded against the episode's previous call (`parent_span`): the prompt is
    the parent's prompt + first completion truncated to `prefix_len` tokens, followed by
    `prompt_suffix_ids`. A first call has no parent and `prefix_len == 0`. `prompt_len` is the full
    prompt length, so a decoder can check its reconstruction.
    """

    span_id: str
    run: str
    episode: str
    seq: int
    api: ApiKind
    stream: bool = False
    status: SpanStatus = "ok"
    model: str = ""
    request: dict[str, Any] = msgspec.field(default_factory=dict)
    parent_span: str | None = None
    prefix_len: int = 0
    prompt_suffix_ids: list[int] = msgspec.field(default_factory=list)
    prompt_len: int = 0
    completions: list[Completion] = msgspec.field(default_factory=list)
    weight_version_start: int = 0
    weight_version_end: int = 0
    upstream: str = ""
    started_at: float = 0.0
    latency_s: float = 0.0
    ttft_s: float | None = None
    usage: Usage = msgspec.field(default_factory=Usage)
    error: str | None = None
    # Token-in mode only (None: the prompt is the plain render of the request, as vLLM made it).
    token_in: TokenInCase | None = None
    # Token-in mode: digest of the conversation this call's answer ends (request turns + answer),
    # so a later call that extends it finds this span as its parent on any gateway replica.
    history_digest: str = ""
    # The caller's User-Agent as sent (at most `CLIENT_MAX_CHARS`), e.g. "claude-cli/2.1.332
    # (external, sdk-cli)": what tells one harness's calls from another's in the trainer's metrics.
    client: str = ""


CLIENT_MAX_CHARS = 200


def harness_of(client: str) -> str:
    """The harness a User-Agent names: its first product token without the version ("" if none)."""
    return client.split(" ", 1)[0].split("/", 1)[0]


# --- episode lifecycle -----------------------------------------------------------------------------


class ArtifactRef(msgspec.Struct, frozen=True, kw_only=True):
    """What a harness produced: inline bytes when small, else a JetStream object-store reference."""

    kind: Literal["patch", "answer", "file"] = "patch"
    size: int = 0
    sha256: str = ""
    inline: bytes | None = None
    object_name: str | None = None


class EpisodeEventBase(Message, frozen=True, kw_only=True, tag_field="kind"):
    """Fields every lifecycle event shares."""

    run: str
    episode: str
    task: str
    group: str
    attempt: int = 0
    at: float = msgspec.field(default_factory=now)


class EpisodeScheduled(EpisodeEventBase, frozen=True, kw_only=True, tag="scheduled"):
    """The controller accepted the episode and will launch it."""

    launcher: str = "local"
    expected_version: int = 0
    sampling: Sampling = msgspec.field(default_factory=dict)
    # The run's `token_in` (None: the gateway's own `token_in` setting decides).
    token_in: bool | None = None


class EpisodeStarted(EpisodeEventBase, frozen=True, kw_only=True, tag="started"):
    """The harness process or Job is running."""

    where: str = ""


class AgentExited(EpisodeEventBase, frozen=True, kw_only=True, tag="agent_exited"):
    """The harness finished; `artifact` is what it left for grading."""

    exit_code: int | None = None
    artifact: ArtifactRef | None = None
    task_spec: TaskSpec | None = None


class EpisodeScored(EpisodeEventBase, frozen=True, kw_only=True, tag="scored"):
    """The reward service graded the artifact."""

    reward: float
    resolved: bool | None = None
    outcome: str = "graded"
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class EpisodeCompleted(EpisodeEventBase, frozen=True, kw_only=True, tag="completed"):
    """Terminal: the episode is graded and its rollout goes to the trainer."""

    reward: float
    span_count: int = 0
    last_seq: int = -1


class EpisodeFailed(EpisodeEventBase, frozen=True, kw_only=True, tag="failed"):
    """Terminal: the episode failed; infra failures may be retried as a new attempt."""

    cause: FailureCause
    reason: str = ""
    # The last lines of the harness's stderr (at most `DETAIL_CHARS`), when it failed on its own.
    detail: str = ""
    # Where the episode's logs are (a folder for local episodes, `namespace/job` in Kubernetes).
    logs: str = ""


class EpisodeRetried(EpisodeEventBase, frozen=True, kw_only=True, tag="retried"):
    """An infra failure is retried as `new_episode` (attempt + 1)."""

    new_episode: str


EpisodeEvent = (
    EpisodeScheduled
    | EpisodeStarted
    | AgentExited
    | EpisodeScored
    | EpisodeCompleted
    | EpisodeFailed
    | EpisodeRetried
)
DETAIL_CHARS = 2000

TERMINAL_KINDS = frozenset({"completed", "failed"})


def event_kind(event: EpisodeEventBase) -> str:
    """The lifecycle kind of an event (its msgpack tag: "scheduled", "completed", ...)."""
    return str(type(event).__struct_config__.tag)


# --- rollouts and weights --------------------------------------------------------------------------


class RolloutComplete(Message, frozen=True, kw_only=True):
    """A finished episode handed to the trainer: reward plus what it needs to find the spans."""

    run: str
    episode: str
    task: str
    group: str
    attempt: int = 0
    group_size: int = 1
    reward: float = 0.0
    span_count: int = 0
    last_seq: int = -1
    versions_seen: list[int] = msgspec.field(default_factory=list)
    # The policy version the controller had seen when it launched the episode. Replicas load a
    # version before it is published, so this is a lower bound on the version that sampled, even
    # when a gateway's own stamp (weight_version_start) still lags.
    admitted_version: int = 0
    failure: FailureCause | None = None
    details: dict[str, Any] = msgspec.field(default_factory=dict)
    at: float = msgspec.field(default_factory=now)


class WeightVersion(Message, frozen=True, kw_only=True):
    """A policy version the trainer produced; versions never decrease within a run.

    A step that trained nothing makes no new weights. It still announces itself (the controller's
    admission counts steps), with `carries_previous` set, the same `version` and checkpoint as the
    step before and its own `step`: readers that track weights see nothing new to load.
    """

    run: str
    version: int
    step: int
    checkpoint_uri: str = ""
    digest: str = ""
    carries_previous: bool = False
    created_at: float = msgspec.field(default_factory=now)


# The values of a held-out evaluation's `StepMetrics` (source `subjects.HELDOUT_SOURCE`): accuracy of
# the policy served at `version`, greedy and sampled.
HELDOUT_GREEDY = "heldout/greedy"
HELDOUT_SAMPLED = "heldout/sampled"


class StepMetrics(Message, frozen=True, kw_only=True):
    """One training step's metrics, published on `hrl.metrics.<run>.trainer` for dashboards.

    A held-out evaluation is published in the same shape on `hrl.metrics.<run>.heldout`.
    """

    run: str
    step: int
    version: int
    values: dict[str, float]
    staleness: dict[str, int] = msgspec.field(default_factory=dict)
    dropped: dict[str, int] = msgspec.field(default_factory=dict)
    # The trainer's last step (its `max_steps`): it trains this run no further.
    final: bool = False
    # False when the step updated nothing (every group skipped; `dropped` says why).
    trained: bool = True
    at: float = msgspec.field(default_factory=now)


class ServiceMetrics(Message, frozen=True, kw_only=True):
    """One service process's Prometheus samples at `at` (`subjects.service_metrics(service)`).

    Values are keyed as in the exposition format (`harnessrl_reward_gradings_total{outcome="graded"}`),
    histogram buckets left out (their `_sum` and `_count` stay).
    """

    service: str
    # The process (host, pid and a random part): summaries of one process share it.
    instance: str
    values: dict[str, float]
    # The run the process serves, if it serves one (the trainer); empty otherwise.
    run: str = ""
    at: float = msgspec.field(default_factory=now)


class RunStopped(Message, frozen=True, kw_only=True):
    """A run the controller stopped before its end, and why (published once per run).

    `cause` is the failure class the first episodes shared (`agent`, `infra`, ...); `reason` the
    sentence they shared; `detail` the tail of one of those episodes' stderr; `logs` where to look.
    """

    run: str
    cause: str
    reason: str
    episodes: int = 0
    detail: str = ""
    logs: str = ""
    at: float = msgspec.field(default_factory=now)


class UpstreamRegistration(Message, frozen=True, kw_only=True):
    """A vLLM replica announcing (or withdrawing) itself to the gateways."""

    url: str
    model: str = ""
    weight_version: int = 0
    active: bool = True


# --- run and task specs ----------------------------------------------------------------------------


class TaskSpec(Message, frozen=True, kw_only=True):
    """One task: a prompt with an answer, or a SWE-bench-shaped instance (`instance`)."""

    task_id: str
    kind: Literal["qa", "swe"] = "qa"
    prompt: str = ""
    answer: str | None = None
    grader: str = "exact"
    instance: dict[str, Any] | None = None
    heldout: bool = False


class LauncherSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How episodes are launched: a local process or a Kubernetes Job running `command`."""

    kind: Literal["local", "kubernetes"] = "local"
    command: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    image: str = ""
    namespace: str = "default"
    cpu: str = "1"
    memory: str = "1Gi"
    job_template: dict[str, Any] | None = None
    # Local launcher: modules a fork server imports once, so each Python harness starts in
    # milliseconds instead of re-importing its SDK (e.g. ["openai"]); empty starts a fresh process.
    preload: list[str] = msgspec.field(default_factory=list)


class RunSpec(Message, frozen=True, kw_only=True):
    """A training run as a user submits it."""

    run: str
    # A file or folder of task rows; `dataset` says how to read it (None: our own rows, flavour `tasks`).
    tasks: str
    dataset: DatasetSpec | None = None
    group_size: int = 8
    max_concurrent: int = 64
    staleness: int = 1
    mode: RunMode = "sync"
    episode_timeout_s: float = 600.0
    infra_retries: int = 2
    batch_tasks: int = 8
    max_steps: int = 10
    launcher: LauncherSpec = msgspec.field(default_factory=LauncherSpec)
    reward: str = "auto"
    model: str = ""
    sampling: Sampling = msgspec.field(default_factory=dict)
    # Token-in mode for the run's LLM calls (see `Span.token_in`); None: the gateway's default
    # (`HRL_GATEWAY_TOKEN_IN`). Off by default until measured better.
    token_in: bool | None = None
    # Stop the run when every episode of its first this-many groups failed the same way (0: never).
    fail_fast_groups: int = 1

    def __post_init__(self) -> None:
        """Reject values no run could use, naming the field."""
        for name in ("group_size", "max_concurrent", "batch_tasks"):
            if getattr(self, name) < 1:
                raise msgspec.ValidationError(f"Expected `{name}` >= 1")
        if self.staleness < 0 or self.fail_fast_groups < 0:
            raise msgspec.ValidationError("Expected `staleness` and `fail_fast_groups` >= 0")
        if not 0 < self.episode_timeout_s < float("inf"):  # NaN fails this too
            raise msgspec.ValidationError("Expected `episode_timeout_s` > 0 and finite")


# --- encoding --------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
M = TypeVar("M")


def encode(message: msgspec.Struct) -> bytes:
    """Encode a contract as msgpack."""
    return _encoder.encode(message)


def decode(data: bytes, kind: type[M]) -> M:
    """Decode msgpack into `kind`; garbage or an unknown schema version raises `ContractError`."""
    try:
        message = msgspec.msgpack.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ContractError(f"invalid {_name(kind)}: {exc}") from exc
    except RecursionError as exc:  # the decoder recurses per nesting level
        raise ContractError(f"invalid {_name(kind)}: nested too deeply") from exc
    schema = getattr(message, "schema", SCHEMA_VERSION)
    if schema != SCHEMA_VERSION:
        raise ContractError(f"{_name(kind)} has schema {schema}, this build reads {SCHEMA_VERSION}")
    return message


def _name(kind: object) -> str:
    return getattr(kind, "__name__", None) or str(kind)


def decode_event(data: bytes) -> EpisodeEvent:
    """Decode one EPISODES message (any lifecycle kind)."""
    return decode(data, EpisodeEvent)  # type: ignore[arg-type]

"""Who may publish and subscribe what on NATS: one user per service, derived from `subjects`.

The local stack writes these into nats-server's `authorization { users = [...] }` block and the Helm
chart renders the same definition, so a service can do on the bus exactly what its code does and
nothing else: only a reward worker publishes a reward (not the trainer, not the controller), a
reward worker cannot submit a run, nothing but the operator (`admin`) can submit a run, and only the
trainer registers vLLM upstreams.

Besides its own subjects each service gets the JetStream API subjects (`$JS.API.*`) for the streams,
consumers, KV buckets and object stores it uses, and its own inbox (`inbox(service)`), where its
requests' replies and its ordered consumers' deliveries arrive: one service cannot read another's
replies. A service that answers requests (the controller's control API) has `allow_responses`: it
may publish to the reply subject of a request it received, and nowhere else on `_INBOX`.

Episodes get no user: a harness talks to the gateway only.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable

import msgspec

from harnessrl.shared import control_api, subjects
from harnessrl.shared.contracts import (
    AgentExited,
    EpisodeCompleted,
    EpisodeEventBase,
    EpisodeFailed,
    EpisodeRetried,
    EpisodeScheduled,
    EpisodeScored,
    EpisodeStarted,
)
from harnessrl.shared.net import nats_servers
from harnessrl.shared.subjects import BucketSpec, StreamSpec

ADMIN = "admin"
GATEWAY = "gateway"
CONTROLLER = "controller"
REWARD = "reward"
TRAINER = "trainer"
SERVICES = (GATEWAY, CONTROLLER, REWARD, TRAINER)
USERS = (*SERVICES, ADMIN)

# Who publishes which lifecycle event: the controller runs episodes, a reward worker grades them.
CONTROLLER_EVENTS: tuple[type[EpisodeEventBase], ...] = (
    EpisodeScheduled,
    EpisodeStarted,
    AgentExited,
    EpisodeCompleted,
    EpisodeFailed,
    EpisodeRetried,
)
REWARD_EVENTS: tuple[type[EpisodeEventBase], ...] = (EpisodeScored, EpisodeFailed)

_API = "$JS.API"
_URL_SAFE = re.compile(r"^[A-Za-z0-9_\-.~]+$")
_INBOX = "_INBOX"


class ServicePermissions(msgspec.Struct, frozen=True, kw_only=True):
    """What one NATS user may publish and subscribe (nats-server `permissions`, allow lists only)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May answer requests it received (nats-server `allow_responses`): one reply each, to the
    # requester's inbox, without a publish grant on `_INBOX`.
    allow_responses: bool = False


def inbox(user: str) -> str:
    """The inbox prefix of a user (`_INBOX.<user>`): its replies and ordered-consumer deliveries."""
    return f"{_INBOX}.{subjects.token(user)}"


def _kv_stream(bucket: BucketSpec) -> str:
    return f"KV_{bucket.name}"


def _object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _stream_api(stream: str, *, create: bool) -> list[str]:
    """Look a stream up (and create it when missing): `ensure_streams`, `kv`, `object_store`.

    Creating cannot change a stream that exists (the server refuses a different config), so it is
    safe to grant to every service that brings the layout up; updating is the operator's.
    """
    grants = [f"{_API}.STREAM.INFO.{stream}"]
    return [*grants, f"{_API}.STREAM.CREATE.{stream}"] if create else grants


def _read(stream: str) -> list[str]:
    """Read a stream: get messages, create/inspect/fetch/delete consumers and acknowledge."""
    return [
        f"{_API}.STREAM.MSG.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}.>",
        f"{_API}.CONSUMER.CREATE.{stream}",
        f"{_API}.CONSUMER.CREATE.{stream}.>",
        f"{_API}.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"{_API}.CONSUMER.INFO.{stream}.*",
        f"{_API}.CONSUMER.DELETE.{stream}.*",
        f"{_API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _kv(bucket: BucketSpec) -> list[str]:
    """Read and write one KV bucket (created if missing)."""
    stream = _kv_stream(bucket)
    return [f"$KV.{bucket.name}.>", *_stream_api(stream, create=True), *_read(stream)]


def _objects(bucket: str, *, write: bool) -> list[str]:
    """Read (and write) one object store (created if missing)."""
    stream = _object_stream(bucket)
    # Reading an object looks its stream up by subject (nats-py), which lists stream names.
    grants = [*_stream_api(stream, create=True), *_read(stream), f"{_API}.STREAM.NAMES"]
    if write:  # chunks and metadata; overwriting an object purges its old chunks
        grants += [f"$O.{bucket}.>", f"{_API}.STREAM.PURGE.{stream}"]
    return grants


def _layout() -> list[str]:
    """Bring every stream up (`ensure_streams`): each service does it at start."""
    return [grant for spec in subjects.ALL_STREAMS for grant in _stream_api(spec.name, create=True)]


def _consume(*streams: StreamSpec) -> list[str]:
    """Read streams and dead-letter what can never be handled (`Bus.dead_letter`)."""
    grants: list[str] = []
    for spec in streams:
        grants += _read(spec.name)
        grants += [subjects.dead_letter(subject) for subject in spec.subjects]
    return grants


def _service(
    user: str,
    *,
    publish: Iterable[str],
    subscribe: Iterable[str] = (),
    allow_responses: bool = False,
) -> ServicePermissions:
    """Every service: the layout, its own service metrics, its own inbox."""
    published = [*publish, *_layout(), subjects.service_metrics(user)]
    subscribed = [*subscribe, f"{inbox(user)}.>"]
    return ServicePermissions(
        publish=_unique(published), subscribe=_unique(subscribed), allow_responses=allow_responses
    )


def _events(kinds: Iterable[type[EpisodeEventBase]]) -> list[str]:
    """The subjects of these lifecycle events, of every run and episode."""
    return [subjects.episode_events_of_kind(str(kind.__struct_config__.tag)) for kind in kinds]


def _unique(grants: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(grants))


def _gateway() -> ServicePermissions:
    """Spans (a conditional append per episode), artifact uploads; follows episodes, weights, upstreams."""
    return _service(
        GATEWAY,
        publish=[
            *subjects.SPANS.subjects,
            *_consume(subjects.SPANS, subjects.EPISODES, subjects.WEIGHTS, subjects.UPSTREAMS),
            *_objects(subjects.ARTIFACTS_BUCKET, write=True),
        ],
    )


def _controller() -> ServicePermissions:
    """Episode lifecycle, rollouts, run events; serves the control API; its records and lease."""
    return _service(
        CONTROLLER,
        publish=[
            *_events(CONTROLLER_EVENTS),
            *subjects.ROLLOUTS.subjects,
            *subjects.RUNS.subjects,
            *_consume(subjects.EPISODES, subjects.WEIGHTS, subjects.SPANS),
            *_kv(subjects.EPISODE_STATE),
            *_kv(subjects.CONTROLLER_LEASE),
            *_objects(subjects.ARTIFACTS_BUCKET, write=True),
            *(f"{_API}.STREAM.UPDATE.{spec.name}" for spec in subjects.ALL_STREAMS),
        ],
        subscribe=[control_api.subject(verb) for verb in control_api.VERBS],
        allow_responses=True,
    )


def _reward() -> ServicePermissions:
    """Grades `agent_exited`: publishes `scored` or `failed`; reads artifacts; remembers results."""
    return _service(
        REWARD,
        publish=[
            *_events(REWARD_EVENTS),
            *_consume(subjects.EPISODES),
            *_kv(subjects.REWARD_RESULTS),
            *_objects(subjects.ARTIFACTS_BUCKET, write=False),
        ],
    )


def _trainer() -> ServicePermissions:
    """Learns from rollouts and their spans; publishes weights, step metrics, vLLM upstreams."""
    return _service(
        TRAINER,
        publish=[
            *subjects.WEIGHTS.subjects,
            subjects.metrics_of_source(TRAINER),
            subjects.upstreams(),
            *_consume(subjects.ROLLOUTS, subjects.SPANS, subjects.METRICS, subjects.WEIGHTS),
        ],
    )


def _admin() -> ServicePermissions:
    """The operator (`harnessrl` CLI, the local stack): everything."""
    return ServicePermissions(publish=(">",), subscribe=(">",), allow_responses=True)


PERMISSIONS: dict[str, ServicePermissions] = {
    GATEWAY: _gateway(),
    CONTROLLER: _controller(),
    REWARD: _reward(),
    TRAINER: _trainer(),
    ADMIN: _admin(),
}


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    """A NATS user and its password."""

    user: str
    password: str

    def __repr__(self) -> str:
        return f"Credentials(user={self.user!r}, password='***')"


def with_credentials(url: str, credentials: Credentials) -> str:
    """A NATS URL list with `user:password@` on every server: the one way a service gets its login.

    Services take credentials in their `nats_url` setting only; `NatsBus` reads them from there.
    """
    user, password = credentials.user, credentials.password
    for part in (user, password):
        if not _URL_SAFE.match(part):  # nats-py sends a URL's login as written, unquoted
            raise ValueError(f"a NATS user or password must match {_URL_SAFE.pattern}")
    servers = []
    for server in nats_servers(url):
        parts = urllib.parse.urlsplit(server if "://" in server else f"nats://{server}")
        host = parts.netloc.rsplit("@", 1)[-1]
        servers.append(urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}")))
    return ",".join(servers)


def url_user(url: str) -> str | None:
    """The user named in a NATS URL list (its first server), or None without credentials."""
    server = nats_servers(url)[0]
    parts = urllib.parse.urlsplit(server if "://" in server else f"nats://{server}")
    return parts.username or None


def redacted(url: str) -> str:
    """A NATS URL list fit for a log line or an error: passwords replaced by `***`."""
    servers = []
    for server in nats_servers(url):
        parts = urllib.parse.urlsplit(server if "://" in server else f"nats://{server}")
        if parts.password is None and "@" not in parts.netloc:
            servers.append(server)
            continue
        host = parts.netloc.rsplit("@", 1)[-1]
        login = f"{parts.username}:***@" if parts.username else "***@"
        servers.append(urllib.parse.urlunsplit(parts._replace(netloc=f"{login}{host}")))
    return ",".join(servers)

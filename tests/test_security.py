"""The security boundaries, checked from the attacker's side, against the real parts.

- Episode keys: a key opens its own episode only, never another episode or run, never after the
  episode closed or the key expired (also once the gateway has it cached), and has one spelling
  (an altered key never verifies, so one key cannot fill the gateway's cache); the admin routes
  refuse episode keys.
- Run submissions: a hostile `job_template` or launcher is refused by the controller over its
  control API, naming the field.
- Harness environments: the local and the Kubernetes launcher give an episode no secret but its
  own key.
- NATS: each service's user is refused what `nats_permissions` does not grant it.
- Logs: a short real run (`harnessrl train`, NATS with logins) logs no key, secret or prompt at
  info level, and NATS refused none of its services anything.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats
import nats.errors
import pytest

from harnessrl.controller.launchers.kube_manifest import render_job, render_secret, secret_name
from harnessrl.controller.launchers.local import LocalLauncher
from harnessrl.controller.service import Controller
from harnessrl.controller.settings import ControllerSettings
from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus import BusError, NatsBus
from harnessrl.shared.contracts import EpisodeFailed, LauncherSpec
from harnessrl.shared.keys import EpisodeKeyError, sign_episode_key, verify_episode_key
from harnessrl.shared.nats_permissions import (
    ADMIN,
    CONTROLLER,
    GATEWAY,
    REWARD,
    TRAINER,
    USERS,
    Credentials,
    with_credentials,
)
from harnessrl.stack.demo.tasks import question, task_spec, write_tasks
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit import split_reward_harness
from harnessrl.testkit.canned_upstream import CannedUpstream
from harnessrl.testkit.exits import ExitRecorder, launch_request
from harnessrl.testkit.gateway import (
    TEST_ADMIN_TOKEN,
    TEST_KEY_SECRET,
    KeyedEpisode,
    serve_gateway,
    settings_for,
)

SECRET = TEST_KEY_SECRET.encode()
CLI = str(Path(sys.executable).parent / "harnessrl")
KEY_PATTERN = re.compile(r"hrl_[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")


# --- a nats-server with a login per service -------------------------------------------------------


class SecuredNats:
    """A nats-server that requires logins, with every user's credentials."""

    def __init__(self, server: NatsServer, logins: dict[str, Credentials]) -> None:
        self.server, self.logins = server, logins

    def url(self, user: str) -> str:
        return with_credentials(self.server.url, self.logins[user])

    async def bus(self, user: str) -> NatsBus:
        bus = NatsBus(self.url(user), name=f"test-{user}", publish_retry_s=10.0)
        await bus.connect()
        return bus


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredNats]:
    logins = {user: Credentials(user=user, password=secrets.token_urlsafe(24)) for user in USERS}
    server = NatsServer(tmp_path_factory.mktemp("secured-nats"), users=logins)
    server.start()
    try:
        yield SecuredNats(server, logins)
    finally:
        server.stop()


@pytest.fixture(scope="module")
async def admin(secured: SecuredNats) -> AsyncIterator[NatsBus]:
    bus = await secured.bus(ADMIN)
    await bus.ensure_streams()
    yield bus
    await bus.close()


# --- episode keys ---------------------------------------------------------------------------------


def altered_keys(key: str) -> Iterator[str]:
    """Every single-bit flip of every character, and the re-spellings base64 forgives."""
    for index, char in enumerate(key):
        for bit in range(8):
            flipped = chr(ord(char) ^ (1 << bit))
            yield key[:index] + flipped + key[index + 1 :]
    body, sig = key.removeprefix("hrl_").split(".")
    for part in ("=", "==", "===", "!", " ", "\n", "+", "/"):
        yield f"hrl_{body}{part}.{sig}"
        yield f"hrl_{body}.{sig}{part}"
    standard = [
        base64.b64encode(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4))).decode() for p in (body, sig)
    ]
    yield f"hrl_{standard[0]}.{standard[1]}"  # padded, `+/` alphabet
    yield f"hrl_{standard[0].rstrip('=')}.{standard[1].rstrip('=')}"
    yield key.upper()
    yield f" {key}"
    yield f"{key} "
    yield f"HRL_{key[4:]}"


def test_an_altered_key_never_verifies() -> None:
    key = sign_episode_key(SECRET, "r1", "ep-1", 600)
    assert verify_episode_key(SECRET, key).episode == "ep-1"
    tried = 0
    for altered in altered_keys(key):
        if altered == key:
            continue
        tried += 1
        with pytest.raises(EpisodeKeyError):
            verify_episode_key(SECRET, altered)
    assert tried > 8 * len(key)


def test_a_key_cannot_be_spliced_into_another_episode_or_run() -> None:
    mine = sign_episode_key(SECRET, "r1", "ep-1", 600)
    other_episode = sign_episode_key(SECRET, "r1", "ep-2", 600)
    other_run = sign_episode_key(SECRET, "r2", "ep-1", 600)
    signature = mine.split(".")[1]
    for other in (other_episode, other_run):
        with pytest.raises(EpisodeKeyError, match="signature"):
            verify_episode_key(SECRET, f"{other.split('.')[0]}.{signature}")
    with pytest.raises(EpisodeKeyError, match="another run"):
        verify_episode_key(SECRET, mine, run="r2")
    with pytest.raises(EpisodeKeyError, match="signature"):  # another deployment's secret
        verify_episode_key(b"another-deployment", mine)


@pytest.fixture(scope="module")
async def canned() -> AsyncIterator[CannedUpstream]:
    upstream = CannedUpstream()
    await upstream.start()
    yield upstream
    await upstream.stop()


@pytest.fixture(scope="module")
async def gateway(secured: SecuredNats, canned: CannedUpstream, admin: NatsBus) -> AsyncIterator[Any]:
    """A real gateway connected as the `gateway` user."""
    bus = await secured.bus(GATEWAY)
    try:
        async with serve_gateway(settings_for([canned.url]), bus) as running:
            yield running
    finally:
        await bus.close()


async def call(url: str, key: str, *, header: str = "authorization") -> tuple[int, dict[str, Any]]:
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    value = f"Bearer {key}" if header == "authorization" else key
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers={header: value}) as response,
    ):
        return response.status, await response.json(content_type=None)


async def test_altered_keys_are_refused_and_never_cached(gateway: Any) -> None:
    episode = KeyedEpisode(f"r-{uuid.uuid4().hex[:6]}")
    assert (await call(gateway.url, episode.key))[0] == 200
    cache = gateway.app.proxy.keys._verified
    before = len(cache)
    statuses = set()
    for altered in list(altered_keys(episode.key))[::7]:  # a sample: each costs an HTTP round trip
        if altered.strip() == episode.key or not altered.isascii() or not altered.isprintable():
            continue  # HTTP strips the header's whitespace and carries no control characters
        status, body = await call(gateway.url, altered)
        statuses.add(status)
        assert body["error"]["type"] == "authentication_error", body
    assert statuses == {401}
    assert len(cache) == before  # one key, one cache entry: variants do not fill the cache


async def test_a_key_opens_only_its_own_episode(gateway: Any, admin: NatsBus) -> None:
    run = f"r-{uuid.uuid4().hex[:6]}"
    mine, other = KeyedEpisode(run), KeyedEpisode(run)
    assert (await call(gateway.url, mine.key))[0] == 200
    assert len(await mine.spans(admin)) == 1
    assert await other.spans(admin) == []  # nothing lands on another episode
    assert await admin.replay(subjects.SPANS.name, subjects.spans_of_run(f"{run}x")) == []


async def test_a_closed_episode_refuses_its_key_even_when_cached(gateway: Any, admin: NatsBus) -> None:
    episode = KeyedEpisode(f"r-{uuid.uuid4().hex[:6]}")
    assert (await call(gateway.url, episode.key))[0] == 200  # key and episode now cached
    failed = EpisodeFailed(run=episode.run, episode=episode.episode, task="t", group="g", cause="infra")
    await admin.publish(
        subjects.episode_event(episode.run, episode.episode, "failed"),
        failed,
        msg_id=f"{episode.episode}:failed",
    )
    for _ in range(100):
        status, body = await call(gateway.url, episode.key)
        if status == 403:
            break
        await asyncio.sleep(0.05)
    assert status == 403 and body["error"]["type"] == "permission_error", body


async def test_an_expired_key_is_refused_even_when_cached(gateway: Any) -> None:
    run, episode = f"r-{uuid.uuid4().hex[:6]}", "ep-expiring"
    key = sign_episode_key(SECRET, run, episode, 1.5)
    assert (await call(gateway.url, key))[0] == 200
    assert key in gateway.app.proxy.keys._verified  # cached
    await asyncio.sleep(1.6)
    status, body = await call(gateway.url, key)
    assert status == 401 and "expired" in body["error"]["message"], body
    assert key not in gateway.app.proxy.keys._verified


async def test_admin_routes_refuse_episode_keys(gateway: Any) -> None:
    key = KeyedEpisode().key
    routes = [("POST", "/admin/pause"), ("POST", "/admin/resume"), ("GET", "/admin/status")]
    routes.append(("POST", "/admin/upstreams"))
    async with aiohttp.ClientSession() as session:
        for method, path in routes:
            for headers in ({"authorization": f"Bearer {key}"}, {"x-api-key": key}, {}):
                async with session.request(method, gateway.url + path, headers=headers, json={}) as response:
                    assert response.status == 401, (method, path, headers)
        admin = {"authorization": f"Bearer {TEST_ADMIN_TOKEN}"}
        async with session.get(gateway.url + "/admin/status", headers=admin) as response:
            assert response.status == 200  # the routes work, for the admin token


# --- run submissions ------------------------------------------------------------------------------

ALLOWED_IMAGE = "registry.local/harness/mini:1"
RUNS = [f"hostile-{i}" for i in range(20)]


def kube_launcher(**template: Any) -> dict[str, Any]:
    return {
        "kind": "kubernetes",
        "command": ["mini", "-y"],
        "image": ALLOWED_IMAGE,
        "job_template": {"spec": {"template": template}},
    }


def pod(**fields: Any) -> dict[str, Any]:
    return {"spec": fields}


HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"kind": "local", "command": ["sh", "-c", "env"]}, 'launcher.kind = "local"'),
    ({**kube_launcher(), "image": "evil.example/miner:1"}, "launcher.image"),
    (kube_launcher(**pod(hostNetwork=True)), "spec.template.spec.hostNetwork"),
    (kube_launcher(**pod(hostPID=True)), "spec.template.spec.hostPID"),
    (kube_launcher(**pod(hostIPC=True)), "spec.template.spec.hostIPC"),
    (kube_launcher(**pod(serviceAccountName="controller")), "spec.template.spec.serviceAccountName"),
    (kube_launcher(**pod(automountServiceAccountToken=True)), "automountServiceAccountToken"),
    (kube_launcher(**pod(containers=[{"envFrom": [{"secretRef": {"name": "hrl-signing"}}]}])), "envFrom"),
    (
        kube_launcher(
            **pod(
                containers=[
                    {"env": [{"name": "S", "valueFrom": {"secretKeyRef": {"name": "x", "key": "k"}}}]}
                ]
            )
        ),
        "containers[0].env",
    ),
    (kube_launcher(**pod(containers=[{"securityContext": {"privileged": True}}])), "securityContext"),
    (
        kube_launcher(**pod(containers=[{"securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}])),
        "securityContext",
    ),
    (
        kube_launcher(**pod(volumes=[{"name": "host", "hostPath": {"path": "/"}}])),
        "spec.template.spec.volumes",
    ),
    (kube_launcher(**pod(containers=[{}, {"name": "sidecar", "image": ALLOWED_IMAGE}])), "containers[1]"),
    (kube_launcher(**pod(containers=[{"image": "evil.example/miner:1"}])), "containers[0].image"),
    (kube_launcher(**pod(initContainers=[{"name": "x", "image": ALLOWED_IMAGE}])), "initContainers"),
    (kube_launcher(**pod(nodeName="control-plane")), "nodeName"),
    (kube_launcher(metadata={"labels": {"harnessrl.io/role": "gateway"}}), "harnessrl.io/role"),
    (
        {**kube_launcher(), "job_template": {"metadata": {"labels": {"harnessrl.io/run": "other"}}}},
        "harnessrl.io/run",
    ),
    ({**kube_launcher(), "job_template": {"spec": {"backoffLimit": 10}}}, "job_template.spec.backoffLimit"),
]


@pytest.fixture(scope="module")
async def controller(
    secured: SecuredNats, admin: NatsBus, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Controller]:
    """A real controller in cluster mode, on the bus as the `controller` user."""
    bus = await secured.bus(CONTROLLER)
    settings = ControllerSettings(
        key_secret="controller-secret",
        state_dir=str(tmp_path_factory.mktemp("controller")),
        in_cluster=True,
        allowed_images=["registry.local/harness/*"],
        runs=RUNS,
    )
    controller = Controller(bus, settings)
    await controller.start()
    try:
        yield controller
    finally:
        await controller.stop()
        await bus.close()


@pytest.mark.parametrize(("index", "hostile"), list(enumerate(HOSTILE)), ids=[why for _, why in HOSTILE])
async def test_a_hostile_launcher_is_refused_at_submit(
    index: int, hostile: tuple[dict[str, Any], str], controller: Controller, admin: NatsBus, tmp_path: Path
) -> None:
    launcher, field = hostile
    tasks = write_tasks(tmp_path / "tasks.jsonl", [task_spec(3, 4)])
    spec = {"run": RUNS[index], "tasks": str(tasks), "launcher": launcher}
    request = control_api.encode(control_api.SubmitRequest(spec=spec))
    reply = json.loads(await admin.request(control_api.subject("submit"), request, timeout=20))
    assert reply["ok"] is False, reply
    assert field in reply["error"], reply["error"]
    assert controller.refused[RUNS[index]] == 1
    assert RUNS[index] not in controller.runs


# --- what a harness's environment holds -----------------------------------------------------------

DUMP_ENV = "import json, os\njson.dump(dict(os.environ), open('env.json', 'w'))\n"


@pytest.mark.parametrize("preload", [[], ["json"]], ids=["spawned", "fork-server"])
async def test_a_local_harness_gets_no_secret_but_its_own_key(
    preload: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller_secrets = {
        "HRL_CONTROLLER_KEY_SECRET": "signing-secret-" + secrets.token_hex(8),
        "HRL_CONTROLLER_NATS_URL": f"nats://controller:{secrets.token_hex(8)}@127.0.0.1:4222",
        "HRL_GATEWAY_ADMIN_TOKEN": "admin-" + secrets.token_hex(8),
        "NATS_PASSWORD": secrets.token_hex(8),
    }
    for name, value in controller_secrets.items():
        monkeypatch.setenv(name, value)
    key = sign_episode_key(SECRET, "r1", "ep-env", 600)
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP_ENV)
    request = msgspec.structs.replace(
        launch_request("ep-env", [sys.executable, str(script)]),
        secret_env={"HARNESSRL_EPISODE_KEY": key, "OPENAI_API_KEY": key},
    )
    launcher = LocalLauncher("r1", tmp_path, preload=preload)
    exits = ExitRecorder()
    await launcher.start(exits)
    try:
        await launcher.launch(request)
        status = await exits.wait("ep-env", timeout=60)
    finally:
        await launcher.close()
    assert status.exit_code == 0, status
    env = json.loads((launcher.episode_dir("ep-env") / "work" / "env.json").read_text())
    assert not [name for name in env if name.startswith(("HRL_", "NATS_"))]
    leaked = [name for name, value in env.items() for s in controller_secrets.values() if s in value]
    assert leaked == []
    assert {name for name, value in env.items() if key in value} == {
        "HARNESSRL_EPISODE_KEY",
        "OPENAI_API_KEY",
    }


def test_a_kubernetes_episode_gets_no_secret_but_its_own_key() -> None:
    key = sign_episode_key(SECRET, "r1", "ep-kube", 600)
    request = msgspec.structs.replace(
        launch_request("ep-kube", ["mini"]), secret_env={"HARNESSRL_EPISODE_KEY": key}
    )
    spec = LauncherSpec(kind="kubernetes", command=["mini"], image=ALLOWED_IMAGE)
    job = render_job(request, spec, ttl_s=60, allowed_images=["registry.local/harness/*"])
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["automountServiceAccountToken"] is False and "serviceAccountName" not in pod_spec
    for container in (*pod_spec.get("initContainers", []), *pod_spec["containers"]):
        assert "envFrom" not in container
    env = pod_spec["containers"][0]["env"]
    references = [item["valueFrom"]["secretKeyRef"] for item in env if "valueFrom" in item]
    assert references == [{"name": secret_name("r1", "ep-kube"), "key": "HARNESSRL_EPISODE_KEY"}]
    assert key not in json.dumps(job)  # the key is in the episode's Secret only
    assert render_secret(request, "default")["stringData"] == {"HARNESSRL_EPISODE_KEY": key}
    volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
    assert all(set(volume) == {"name", "emptyDir"} for volume in volumes.values())


# --- NATS: each service refused what it may not do ------------------------------------------------


def _attacks() -> list[tuple[str, str, str]]:
    run, episode = "attack", "ep-1"
    kv_episodes = f"$KV.{subjects.EPISODE_STATE.name}.record"
    return [
        (TRAINER, "publish", subjects.episode_event(run, episode, "scored")),
        (TRAINER, "publish", subjects.episode_event(run, episode, "failed")),
        (GATEWAY, "publish", subjects.episode_event(run, episode, "scored")),
        (CONTROLLER, "publish", subjects.episode_event(run, episode, "scored")),
        (REWARD, "publish", subjects.episode_event(run, episode, "completed")),
        (REWARD, "publish", subjects.episode_event(run, episode, "scheduled")),
        (REWARD, "publish", control_api.subject("submit")),
        (GATEWAY, "publish", control_api.subject("submit")),
        (TRAINER, "publish", control_api.subject("submit")),
        (CONTROLLER, "publish", control_api.subject("submit")),
        (GATEWAY, "publish", control_api.subject("close")),
        (GATEWAY, "publish", subjects.upstreams()),
        (REWARD, "publish", subjects.upstreams()),
        (CONTROLLER, "publish", subjects.upstreams()),
        (REWARD, "publish", subjects.weights(run)),
        (GATEWAY, "publish", subjects.weights(run)),
        (CONTROLLER, "publish", subjects.weights(run)),
        (GATEWAY, "publish", subjects.rollout(run)),
        (TRAINER, "publish", subjects.rollout(run)),
        (REWARD, "publish", subjects.rollout(run)),
        (REWARD, "publish", subjects.span(run, episode)),
        (TRAINER, "publish", subjects.span(run, episode)),
        (CONTROLLER, "publish", subjects.span(run, episode)),
        (TRAINER, "publish", subjects.run_event(run, "stopped")),
        (REWARD, "publish", subjects.metrics(run, "trainer")),
        (GATEWAY, "publish", subjects.service_metrics("controller")),
        (REWARD, "publish", kv_episodes),
        (TRAINER, "publish", kv_episodes),
        (GATEWAY, "publish", f"$KV.{subjects.CONTROLLER_LEASE.name}.default"),
        (TRAINER, "publish", f"$JS.API.DIRECT.GET.KV_{subjects.EPISODE_STATE.name}"),
        (GATEWAY, "publish", f"$JS.API.STREAM.DELETE.{subjects.SPANS.name}"),
        (REWARD, "publish", f"$JS.API.STREAM.PURGE.{subjects.EPISODES.name}"),
        (TRAINER, "publish", f"$JS.API.STREAM.UPDATE.{subjects.EPISODES.name}"),
        (GATEWAY, "publish", f"$JS.API.CONSUMER.DELETE.{subjects.ROLLOUTS.name}.trainer-r1"),
        (REWARD, "publish", f"$O.{subjects.ARTIFACTS_BUCKET}.M.forged"),
        (GATEWAY, "subscribe", control_api.subject("submit")),
        (REWARD, "subscribe", control_api.subject("open")),
        (REWARD, "subscribe", "_INBOX.controller.>"),
        (TRAINER, "subscribe", "_INBOX.>"),
        (GATEWAY, "subscribe", ">"),
        (TRAINER, "subscribe", subjects.spans_of_run(run)),
    ]


ATTACKS = _attacks()


async def refusal(secured: SecuredNats, user: str, action: str, subject: str) -> str:
    """What the server says when `user` tries `action` on `subject` (empty: it did not refuse)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        servers=[secured.url(user)], error_cb=on_error, allow_reconnect=False, inbox_prefix=f"_INBOX.{user}"
    )
    try:
        if action == "publish":
            await nc.publish(subject, b"forged")
        else:
            await nc.subscribe(subject)
        await nc.flush(timeout=2)
        for _ in range(40):
            if errors:
                break
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return " ".join(errors)


@pytest.mark.parametrize(("user", "action", "subject"), ATTACKS, ids=[f"{u}-{a}-{s}" for u, a, s in ATTACKS])
async def test_nats_refuses_what_a_service_may_not_do(
    user: str, action: str, subject: str, secured: SecuredNats
) -> None:
    said = await refusal(secured, user, action, subject)
    kind = "Publish" if action == "publish" else "Subscription"
    assert f"permissions violation for {kind.lower()}" in said.lower(), said
    assert subject.lower() in said.lower()  # nats-py reports the refusal lower-cased


async def test_nothing_a_refused_service_published_was_stored(secured: SecuredNats, admin: NatsBus) -> None:
    run = f"attack-{uuid.uuid4().hex[:6]}"
    for user in (GATEWAY, CONTROLLER, TRAINER):  # only the reward worker grades
        assert await refusal(secured, user, "publish", subjects.episode_event(run, f"ep-{user}", "scored"))
    for user in (GATEWAY, REWARD, TRAINER):  # only the controller completes rollouts
        assert await refusal(secured, user, "publish", subjects.rollout(run))
    stored = await admin.replay(subjects.EPISODES.name, subjects.episode_events_of_run(run, "scored"))
    assert stored == []
    assert await admin.replay(subjects.ROLLOUTS.name, subjects.rollout(run)) == []


async def test_nats_refuses_a_missing_or_wrong_login(secured: SecuredNats) -> None:
    for url in (
        secured.server.url,
        with_credentials(secured.server.url, Credentials(user=TRAINER, password="guess")),
    ):
        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(
                servers=[url], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2
            )
    bus = NatsBus(secured.server.url, connect_timeout_s=3)
    with pytest.raises(BusError):
        await bus.connect()


async def test_a_reward_worker_cannot_submit_a_run_through_the_bus_client(secured: SecuredNats) -> None:
    bus = await secured.bus(REWARD)
    try:
        request = control_api.encode(control_api.StatusRequest())
        with pytest.raises(BusError):
            await bus.request(control_api.subject("submit"), request, timeout=2)
    finally:
        await bus.close()


# --- a short real run: what its logs hold ---------------------------------------------------------

ENV_DUMP_HARNESS = """
import json, os, runpy, sys
from pathlib import Path
Path({dump!r}, os.environ["HARNESSRL_EPISODE"] + ".json").write_text(json.dumps(dict(os.environ)))
sys.argv = [{harness!r}]
runpy.run_path({harness!r}, run_name="__main__")
"""


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    """One training step of the real stack (`harnessrl train`); harnesses dump their environment."""
    root = tmp_path_factory.mktemp("real-run")
    dump = root / "envs"
    dump.mkdir()
    harness = root / "harness.py"
    harness.write_text(ENV_DUMP_HARNESS.format(dump=str(dump), harness=split_reward_harness.COMMAND[1]))
    tasks = [task_spec(a, 21) for a in range(10, 14)]
    write_tasks(root / "tasks.jsonl", tasks)
    spec = root / "secure.toml"
    spec.write_text(
        'run = "secure"\ntasks = "tasks.jsonl"\ngroup_size = 2\nbatch_tasks = 2\nmax_steps = 1\n'
        'mode = "sync"\nstaleness = 0\n[launcher]\n'
        f'command = {json.dumps([sys.executable, str(harness)])}\npreload = ["openai"]\n'
    )
    home = root / "home"
    argv = [CLI, "train", str(spec), "--model", str(tiny_model), "--home", str(home)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    envs = [json.loads(path.read_text()) for path in dump.glob("*.json")]
    return {
        "home": home,
        "envs": envs,
        "prompts": [t.prompt for t in tasks],
        "out": done.stdout + done.stderr,
    }


def test_the_real_run_used_logins_and_nats_refused_no_service(real_run: dict[str, Any]) -> None:
    home = real_run["home"]
    conf = (home / "nats" / "auth.conf").read_text()
    assert all(f'"user": "{user}"' in conf for user in USERS)
    log = (home / "logs" / "nats-server.log").read_text()
    assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line][:5]


def test_the_real_run_gave_each_harness_only_its_own_key(real_run: dict[str, Any]) -> None:
    home = real_run["home"]
    service_secrets = [path.read_text().strip() for path in home.glob("*.secret")]
    assert len(service_secrets) >= 2 + len(USERS)  # key secret, admin token, a password per user
    assert real_run["envs"], "no harness ran"
    for env in real_run["envs"]:
        key = env["HARNESSRL_EPISODE_KEY"]
        claims = verify_episode_key((home / "episode-key.secret").read_text().strip().encode(), key)
        assert claims.episode == env["HARNESSRL_EPISODE"]
        assert not [name for name in env if name.startswith(("HRL_", "NATS_"))]
        assert [name for name, value in env.items() for s in service_secrets if s in value] == []


def test_logs_hold_no_key_secret_or_prompt(real_run: dict[str, Any]) -> None:
    home = real_run["home"]
    logs = {path.name: path.read_text(errors="replace") for path in (home / "logs").glob("*.log")}
    assert {"gateway.log", "controller.log", "reward.log", "trainer.log"} <= set(logs), sorted(logs)
    logs["train command"] = real_run["out"]
    keys = {env["HARNESSRL_EPISODE_KEY"] for env in real_run["envs"]}
    service_secrets = {path.read_text().strip() for path in home.glob("*.secret")}
    found = []
    for name, text in logs.items():
        found += [(name, "key") for key in keys if key in text]
        found += [(name, "key-shaped") for _ in KEY_PATTERN.finditer(text)]
        found += [(name, "secret") for secret in service_secrets if secret in text]
        found += [(name, f"prompt {prompt!r}") for prompt in real_run["prompts"] if prompt in text]
    assert found == []
    assert question(10, 21) in real_run["prompts"]  # the prompts looked for are the real ones

"""NATS with a login per service: each service can do everything its code does, and no password
shows in an error or a log line.

The refusals (what each service may not do) are checked from the attacker's side in
tests/test_security.py; here the other half: the permissions are complete for the real bus client.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from harnessrl.shared import control_api, subjects
from harnessrl.shared.bus import BusError, ConsumerSpec, Delivery, NatsBus
from harnessrl.shared.contracts import UpstreamRegistration, WeightVersion
from harnessrl.shared.nats_permissions import (
    ADMIN,
    CONTROLLER,
    GATEWAY,
    REWARD,
    TRAINER,
    USERS,
    Credentials,
    redacted,
    with_credentials,
)
from harnessrl.shared.net import free_port
from harnessrl.stack.local import LocalStack
from harnessrl.stack.natsserver import NatsCluster, NatsServer, NatsServerError, auth_config

LOGINS = {user: Credentials(user=user, password=secrets.token_urlsafe(16)) for user in USERS}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    nats = NatsServer(tmp_path_factory.mktemp("nats-auth"), users=LOGINS)
    nats.start()
    yield nats
    nats.stop()


@pytest.fixture
async def buses(server: NatsServer) -> AsyncIterator[dict[str, NatsBus]]:
    connected = {}
    for user in USERS:
        bus = NatsBus(with_credentials(server.url, LOGINS[user]), name=user, publish_retry_s=5.0)
        await bus.connect()
        connected[user] = bus
    yield connected
    for bus in connected.values():
        await bus.close()


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


async def test_each_service_does_what_its_code_does(buses: dict[str, NatsBus], server: NatsServer) -> None:
    for user in (CONTROLLER, GATEWAY, REWARD, TRAINER):  # every service brings the layout up at start
        await buses[user].ensure_streams()
    controller, gateway, reward, trainer = (buses[u] for u in (CONTROLLER, GATEWAY, REWARD, TRAINER))
    run = f"auth-{secrets.token_hex(3)}"

    records = await controller.kv(subjects.EPISODE_STATE)
    await records.put("run-a", b"1")
    assert (await records.get("run-a")) is not None and await records.keys() == ["run-a"]
    lease = await controller.kv(subjects.CONTROLLER_LEASE)
    assert await lease.create("group", b"me") > 0

    async def status(_: bytes) -> bytes:
        return control_api.reply(runs={})

    await controller.serve(control_api.subject("status"), status)
    assert b'"ok": true' in await buses[ADMIN].request(control_api.subject("status"), b"{}")

    await gateway.put_object(subjects.ARTIFACTS_BUCKET, f"{run}/ep/patch", b"diff")
    await gateway.put_object(subjects.ARTIFACTS_BUCKET, f"{run}/ep/patch", b"diff2")  # overwrite
    assert await reward.get_object(subjects.ARTIFACTS_BUCKET, f"{run}/ep/patch") == b"diff2"
    assert await controller.get_object(subjects.ARTIFACTS_BUCKET, f"{run}/ep/patch") == b"diff2"
    results = await reward.kv(subjects.REWARD_RESULTS)
    await results.put("ep-1", b"scored")

    weights: list[Delivery] = []
    upstreams: list[Delivery] = []

    async def on_weights(delivery: Delivery) -> None:
        weights.append(delivery)

    async def on_upstream(delivery: Delivery) -> None:
        upstreams.append(delivery)

    follow = ConsumerSpec(stream=subjects.WEIGHTS.name, filter_subject=subjects.weights(run))
    await gateway.subscribe(follow, on_weights)
    await controller.subscribe(follow, on_weights)
    await gateway.subscribe(
        ConsumerSpec(stream=subjects.UPSTREAMS.name, filter_subject=subjects.upstreams()), on_upstream
    )
    version = WeightVersion(run=run, version=1, step=1)
    await trainer.publish(subjects.weights(run), version, msg_id=f"{run}:w1")
    await trainer.publish(
        subjects.upstreams(), UpstreamRegistration(url="http://127.0.0.1:1", active=False), msg_id=f"{run}:u"
    )
    await until(lambda: len(weights) == 2 and len(upstreams) == 1)
    assert len(await trainer.replay(subjects.WEIGHTS.name, subjects.weights(run))) == 1
    assert len(await gateway.replay(subjects.WEIGHTS.name, subjects.weights(run))) == 1
    rollouts = ConsumerSpec(
        stream=subjects.ROLLOUTS.name,
        filter_subject=subjects.rollout(run),
        durable=subjects.trainer_consumer(run),
    )

    async def ignore(_: Delivery) -> None:
        return None

    await trainer.subscribe(rollouts, ignore)
    exited = ConsumerSpec(
        stream=subjects.EPISODES.name,
        filter_subject=subjects.episode_events_of_run(run, "agent_exited"),
        durable=f"reward-{run}",
    )
    await reward.subscribe(exited, ignore)
    assert await gateway.backlogs() is not None and await trainer.backlogs() is not None
    log = server.log_file.read_text()
    assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line]


def test_a_user_without_permissions_gets_no_login() -> None:
    with pytest.raises(NatsServerError, match="no NATS permissions"):
        auth_config({"stranger": Credentials(user="stranger", password="pw")})
    with pytest.raises(NatsServerError, match="credentials of"):
        auth_config({TRAINER: Credentials(user=ADMIN, password="pw")})
    config = auth_config(LOGINS)
    assert all(f'"password": "{login.password}"' in config for login in LOGINS.values())
    assert '"allow_responses": true' in config  # the controller answers its control API


async def test_no_password_in_errors_logs_or_reprs(caplog: pytest.LogCaptureFixture) -> None:
    login = Credentials(user=GATEWAY, password="s3cret-" + secrets.token_hex(6))
    url = with_credentials(f"nats://127.0.0.1:{free_port()},nats://127.0.0.1:{free_port()}", login)
    assert login.password in url and login.password not in redacted(url) and login.password not in repr(login)
    bus = NatsBus(url, connect_timeout_s=1.0)
    assert login.password not in bus.url and bus.inbox_prefix == "_INBOX.gateway"
    with pytest.raises(BusError) as failed:
        await bus.connect()
    assert "gateway:***@" in str(failed.value) and login.password not in str(failed.value)
    assert login.password not in caplog.text
    with pytest.raises(ValueError, match="must match"):
        with_credentials(url, Credentials(user=GATEWAY, password="p@ss:word"))


async def test_a_cluster_takes_the_same_logins(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path, 3, users=LOGINS)
    cluster.start()
    try:
        bus = NatsBus(with_credentials(cluster.url, LOGINS[CONTROLLER]), replicas=cluster.replicas)
        await bus.connect()
        try:
            await bus.ensure_streams([subjects.RUNS])
        finally:
            await bus.close()
        with pytest.raises(BusError):
            await NatsBus(cluster.url, connect_timeout_s=2.0).connect()
    finally:
        cluster.stop()


def test_the_local_stack_logs_each_service_in_as_itself(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path / "home")
    stack.start_nats()
    try:
        assert stack.nats_url == with_credentials(stack.nats.url, stack.nats_credentials[ADMIN])  # type: ignore[union-attr]
        for user in (GATEWAY, CONTROLLER, REWARD, TRAINER):
            assert stack.nats_url_of(user).startswith(f"nats://{user}:")
        again = LocalStack(tmp_path / "home")  # passwords are kept in the state folder
        assert again.nats_credentials == stack.nats_credentials
        assert (tmp_path / "home" / "nats-admin.secret").stat().st_mode & 0o077 == 0
    finally:
        stack.stop()
    plain = LocalStack(tmp_path / "plain", nats_auth=False)
    plain.start_nats()
    try:
        assert "@" not in plain.nats_url
    finally:
        plain.stop()
    external = LocalStack(tmp_path / "ext", nats_url="nats://someone:pw@10.0.0.1:4222")
    assert external.nats_url_of(TRAINER) == "nats://someone:pw@10.0.0.1:4222"  # brings its own logins

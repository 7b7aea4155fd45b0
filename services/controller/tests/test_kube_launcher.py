"""The Kubernetes launcher against the fake API server, through the official client over HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest

from harnessrl.controller.launchers.base import ExitStatus
from harnessrl.controller.launchers.kube import KubeLauncher, KubeUnreachableError, api_client
from harnessrl.controller.launchers.kube_manifest import job_name, secret_name
from harnessrl.shared.contracts import LauncherSpec
from harnessrl.testkit.exits import ExitRecorder, launch_request
from harnessrl.testkit.fake_kube import FakeKubeServer

SPEC = LauncherSpec(kind="kubernetes", command=["python", "harness.py"], image="harness:1")


async def drive(server: FakeKubeServer, episode: str, action: str, **query: str) -> None:
    url = f"{server.url}/fake/v1/jobs/default/{job_name('r1', episode)}/{action}"
    async with aiohttp.ClientSession() as session, session.post(url, params=query) as response:
        assert response.status == 200, await response.text()


@pytest.fixture
async def launcher(fake_kube: FakeKubeServer) -> AsyncIterator[tuple[KubeLauncher, ExitRecorder]]:
    seen = ExitRecorder()
    kube = KubeLauncher("r1", SPEC, api_client(fake_kube.url), watch_timeout_s=2)
    await kube.start(seen)
    yield kube, seen
    await kube.close()


async def test_launch_creates_job_and_keyed_secret_once(
    fake_kube: FakeKubeServer, launcher: tuple[KubeLauncher, ExitRecorder]
) -> None:
    kube, _ = launcher
    where = await kube.launch(launch_request("e1", ["python", "harness.py"]))
    assert await kube.launch(launch_request("e1", ["python", "harness.py"])) == where
    store = fake_kube.api.store
    name = job_name("r1", "e1")
    assert store.creates[f"jobs/{name}"] == 1 and store.conflicts[f"jobs/{name}"] == 1
    job = store.get("jobs", "default", name)
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert all("hrl_secret-key" not in json.dumps(item) for item in env)
    keyed = next(item for item in env if item["name"] == "HARNESSRL_EPISODE_KEY")
    assert keyed["valueFrom"]["secretKeyRef"]["name"] == secret_name("r1", "e1")
    secret = store.get("secrets", "default", secret_name("r1", "e1"))
    assert base64.b64decode(secret["data"]["HARNESSRL_EPISODE_KEY"]) == b"hrl_secret-key"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert (await kube.relist()) == {"e1": None}


@pytest.mark.parametrize(
    ("action", "query", "expected"),
    [
        ("complete", {}, ExitStatus(outcome="exited", exit_code=0)),
        (
            "fail",
            {"reason": "BackoffLimitExceeded", "exitCode": "3"},
            ExitStatus(outcome="exited", exit_code=3),
        ),
        (
            "fail",
            {"reason": "DeadlineExceeded"},
            ExitStatus(outcome="timeout", reason="activeDeadlineSeconds reached"),
        ),
    ],
)
async def test_watch_reports_how_jobs_end(
    fake_kube: FakeKubeServer,
    launcher: tuple[KubeLauncher, ExitRecorder],
    action: str,
    query: dict[str, str],
    expected: ExitStatus,
) -> None:
    kube, seen = launcher
    await kube.launch(launch_request("e2", ["true"]))
    await drive(fake_kube, "e2", action, **query)
    # Where the episode's logs are: its Job, `<namespace>/<job name>`.
    expected = msgspec.structs.replace(expected, logs=f"default/{job_name('r1', 'e2')}")
    assert await seen.wait("e2") == expected
    assert (await kube.relist())["e2"] == expected


@pytest.mark.parametrize(
    ("action", "reason"), [("evict", "disrupted"), ("oom", "OOMKilled"), ("imagepull", "ErrImagePull")]
)
async def test_disruptions_are_infra_failures(
    fake_kube: FakeKubeServer, launcher: tuple[KubeLauncher, ExitRecorder], action: str, reason: str
) -> None:
    kube, seen = launcher
    await kube.launch(launch_request("e3", ["true"]))
    await drive(fake_kube, "e3", action)
    status = await seen.wait("e3")
    assert status.outcome == "infra" and reason in status.reason
    if action == "imagepull":  # the stuck Job is deleted so it stops holding resources
        assert not fake_kube.api.store.select("jobs", "default", "harnessrl.io/episode=e3")


async def test_watch_relists_after_410_gone(fake_kube: FakeKubeServer) -> None:
    seen = ExitRecorder()
    kube = KubeLauncher("r1", SPEC, api_client(fake_kube.url), watch_timeout_s=1)
    await kube.start(seen)
    await kube.launch(launch_request("e4", ["true"]))
    await drive(fake_kube, "e4", "complete")
    assert (await seen.wait("e4")).exit_code == 0
    store = fake_kube.api.store
    relists = kube._watches[0].relists
    # A change the Job watch never sees, then compaction: its resourceVersion is now too old.
    store.create("secrets", "default", {"metadata": {"name": "unrelated"}})
    store.compact()
    async with asyncio.timeout(15):
        while kube._watches[0].relists == relists:
            await asyncio.sleep(0.1)
    await kube.launch(launch_request("e6", ["true"]))
    await drive(fake_kube, "e6", "complete")
    assert (await seen.wait("e6")).exit_code == 0  # the watch still works after the relist
    await kube.close()


async def test_deleted_job_is_infra(
    fake_kube: FakeKubeServer, launcher: tuple[KubeLauncher, ExitRecorder]
) -> None:
    kube, seen = launcher
    await kube.launch(launch_request("e5", ["true"]))
    fake_kube.api.store.delete("jobs", "default", job_name("r1", "e5"))
    status = await seen.wait("e5")
    assert status.outcome == "infra" and "deleted" in status.reason


async def test_unreachable_api_server_is_a_clear_error() -> None:
    kube = KubeLauncher("r1", SPEC, api_client("http://127.0.0.1:9"))
    with pytest.raises(
        KubeUnreachableError, match=r"cannot reach the Kubernetes API at http://127\.0\.0\.1:9"
    ):
        await kube.start(ExitRecorder())

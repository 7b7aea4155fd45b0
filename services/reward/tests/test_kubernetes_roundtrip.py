"""KubernetesGrader against the test kit's fake API server, with the official client.

A task stands in for the Job controller and the kubelet: it sets the Job's pod log (what the
pod runner prints, see test_kubernetes_grading) and completes the Job; the grader reads that
log back and deletes what it created.
"""

import asyncio
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.kube import KubernetesGrader, config_map, grading_job, parse_pod_output
from harnessrl.reward.swe.patchfile import parse_patch
from harnessrl.testkit.fake_kube import FakeKubeServer

LOG = (
    ">>>>> Strategy: git-apply\n>>>>> Start Test Output\nPASSED tests/test_a.py::test_x\n"
    ">>>>> End Test Output\n>>>>> JUnit: \n>>>>> Test Exit Code: 0\n"
)


async def _play_the_job_controller(api: str, log: str) -> None:
    """Each new grading Job: its pod's log set, then the Job completed (what a kubelet would do)."""
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(f"{api}/apis/batch/v1/namespaces/grading/jobs") as answer:
                jobs = (await answer.json())["items"]
            for job in (j for j in jobs if not j.get("status", {}).get("conditions")):
                name = job["metadata"]["name"]
                await asyncio.sleep(0.3)  # the pod runs a while before its log is complete
                query = {"labelSelector": f"job-name={name}"}
                async with http.get(f"{api}/api/v1/namespaces/grading/pods", params=query) as answer:
                    (pod,) = (await answer.json())["items"]
                await http.post(f"{api}/fake/v1/pods/grading/{pod['metadata']['name']}/log", data=log)
                await http.post(f"{api}/fake/v1/jobs/grading/{name}/complete")
            await asyncio.sleep(0.05)


async def test_job_round_trip_with_the_official_client(calc_row: dict[str, Any]) -> None:
    server = FakeKubeServer()
    url = await server.start()
    kubelet = asyncio.create_task(_play_the_job_controller(url, LOG))
    try:
        config = client.Configuration()
        config.host = url
        grader = KubernetesGrader("grading", client.ApiClient(config))
        store = server.api.store
        instance = SweInstance.from_row({**calc_row, "image": "registry.local/tinyswe/calc:0.1"})
        test_patch = parse_patch(instance.test_patch.encode())
        objects = [
            config_map("grade-x", "grading", instance, parse_patch(instance.patch.encode()), test_patch),
            grading_job("grade-x", "grading", instance),
        ]
        # An earlier grading's Job, finished, in the same namespace: the grader waits for its own.
        earlier = grading_job("grade-earlier", "grading", instance)
        batch = client.BatchV1Api(grader.api_client)
        await asyncio.to_thread(batch.create_namespaced_job, "grading", earlier)
        while not store.get("jobs", "grading", "grade-earlier").get("status", {}).get("succeeded"):
            await asyncio.sleep(0.05)
        log = await grader.run("grade-x", objects, timeout_s=10)
        assert parse_pod_output(log).exit_code == 0
        assert sorted(key.split("/")[0] for key in store.creates) == [
            "configmaps",
            "jobs",
            "jobs",
            "pods",
            "pods",
        ]
        # Both objects are gone afterwards (the Job's pod with it).
        assert store.select("configmaps", "grading", "") == []
        assert [job["metadata"]["name"] for job in store.select("jobs", "grading", "")] == ["grade-earlier"]
    finally:
        kubelet.cancel()
        await server.stop()


async def test_a_field_selector_the_server_cannot_select_is_refused() -> None:
    server = FakeKubeServer()
    url = await server.start()
    try:
        config = client.Configuration()
        config.host = url
        batch = client.BatchV1Api(client.ApiClient(config))
        with pytest.raises(client.ApiException) as refused:
            await asyncio.to_thread(
                batch.list_namespaced_job, "grading", field_selector="status.phase=Running"
            )
        assert refused.value.status == 400 and "field label not supported" in str(refused.value.body)
    finally:
        await server.stop()

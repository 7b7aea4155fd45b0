"""KubernetesGrader against a minimal test-only API server, with the official client.

The fake stores what the client creates, reports the Job finished on the watch, and serves the
pod log the real pod runner produced on a local checkout (see test_kubernetes_grading).
"""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client

from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.kube import KubernetesGrader, config_map, grading_job, parse_pod_output
from harnessrl.reward.swe.patchfile import parse_patch


class FakeApi(ThreadingHTTPServer):
    def __init__(self, log: str) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.log = log
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []


class Handler(BaseHTTPRequestHandler):
    server: FakeApi

    def log_message(self, *args: Any) -> None:
        return

    def _send(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(200 if self.command != "POST" else 201)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.created.append(body)
        self._send(json.dumps(body).encode())

    def do_DELETE(self) -> None:
        self.server.deleted.append(self.path.split("?")[0])
        self._send(b'{"kind":"Status","apiVersion":"v1","status":"Success"}')

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path.endswith("/jobs"):  # the watch: one event, the Job has succeeded
            job = {**self.server.created[1], "status": {"succeeded": 1}}
            self._send(json.dumps({"type": "MODIFIED", "object": job}).encode() + b"\n")
        elif path.endswith("/pods"):
            pod = {"metadata": {"name": "grade-pod-1", "namespace": "grading"}}
            self._send(json.dumps({"kind": "PodList", "apiVersion": "v1", "items": [pod]}).encode())
        elif path.endswith("/log"):
            self._send(self.server.log.encode(), "text/plain")
        else:
            self.send_error(404)


LOG = (
    ">>>>> Strategy: git-apply\n>>>>> Start Test Output\nPASSED tests/test_a.py::test_x\n"
    ">>>>> End Test Output\n>>>>> JUnit: \n>>>>> Test Exit Code: 0\n"
)


@pytest.fixture
def fake_api() -> Iterator[FakeApi]:
    server = FakeApi(LOG)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


async def test_job_round_trip_with_the_official_client(fake_api: FakeApi, calc_row: dict[str, Any]) -> None:
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{fake_api.server_address[1]}"
    grader = KubernetesGrader("grading", client.ApiClient(config))
    instance = SweInstance.from_row({**calc_row, "image": "registry.local/tinyswe/calc:0.1"})
    test_patch = parse_patch(instance.test_patch.encode())
    objects = [
        config_map("grade-x", "grading", instance, parse_patch(instance.patch.encode()), test_patch),
        grading_job("grade-x", "grading", instance),
    ]
    log = await grader.run("grade-x", objects, timeout_s=10)
    assert parse_pod_output(log).exit_code == 0
    assert [o["kind"] for o in fake_api.created] == ["ConfigMap", "Job"]
    assert sorted(fake_api.deleted) == [
        "/api/v1/namespaces/grading/configmaps/grade-x",
        "/apis/batch/v1/namespaces/grading/jobs/grade-x",
    ]

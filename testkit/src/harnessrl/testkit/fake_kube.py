"""A small fake Kubernetes API server for tests: batch/v1 Jobs; core/v1 Pods, Secrets, ConfigMaps.

The controller talks to it only through the official `kubernetes` client over HTTP. It implements
create/get/list/patch/delete/watch with uid, resourceVersion, label selectors, field selectors on
`metadata.name`/`metadata.namespace` (others refused with 400), watch streams that end
at `timeoutSeconds`, and 409/404/410 answers. Test hooks under `/fake/v1/` drive a Job to complete,
fail (DeadlineExceeded, BackoffLimitExceeded), lose its pod to eviction, get OOM-killed or stall on an
image pull; `/fake/v1/pods/<ns>/<name>/log` sets the text a pod's log read answers (what a job
runner saw its container print); `/fake/v1/config` can make new Jobs complete by themselves
(benchmarks), `/fake/v1/compact` forgets history so old watches get 410 Gone, and `/fake/v1/stats`
counts creates and conflicts.

Run it with `python -m harnessrl.testkit.fake_kube --port P`, or in-process with
`FakeKubeServer`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from aiohttp import web

from harnessrl.testkit import kube_jobs
from harnessrl.testkit.kube_store import ApiStatusError, ObjectStore, Watcher, check_fields
from harnessrl.testkit.local_app import LocalApp

_GROUPS = {"jobs": "/apis/batch/v1", "pods": "/api/v1", "secrets": "/api/v1", "configmaps": "/api/v1"}
_KINDS = {
    "jobs": ("Job", "batch/v1"),
    "pods": ("Pod", "v1"),
    "secrets": ("Secret", "v1"),
    "configmaps": ("ConfigMap", "v1"),
}
_HOOKS = {
    "complete": lambda store, job, q: kube_jobs.complete(store, job),
    "fail": lambda store, job, q: kube_jobs.fail(
        store, job, q.get("reason", "BackoffLimitExceeded"), int(q.get("exitCode", "1"))
    ),
    "evict": lambda store, job, q: kube_jobs.evict(store, job),
    "oom": lambda store, job, q: kube_jobs.oom(store, job),
    "imagepull": lambda store, job, q: kube_jobs.image_pull_error(store, job),
}


class FakeKube:
    """The API's request handlers over one `ObjectStore`."""

    def __init__(self) -> None:
        self.store = ObjectStore()
        self.auto: str | None = None
        self.auto_delay_s = 0.0
        self.logs: dict[tuple[str, str], str] = {}

    def app(self) -> web.Application:
        """The aiohttp application with every route."""
        app = web.Application(middlewares=[_status_errors], client_max_size=16 * 1024 * 1024)
        for plural, prefix in _GROUPS.items():
            base = f"{prefix}/namespaces/{{ns}}/{plural}"
            app.router.add_route("*", base, self._collection)
            app.router.add_route("*", base + "/{name}", self._item)
            app.router.add_route("*", base + "/{name}/status", self._item)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}/log", self._read_log)
        app.router.add_post("/fake/v1/pods/{ns}/{name}/log", self._write_log)
        app.router.add_post("/fake/v1/jobs/{ns}/{name}/{action}", self._hook)
        app.router.add_post("/fake/v1/config", self._config)
        app.router.add_post("/fake/v1/compact", self._compact)
        app.router.add_get("/fake/v1/stats", self._stats)
        return app

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        plural, ns = _plural_of(request), request.match_info["ns"]
        if request.method == "POST":
            obj = json.loads(await request.read())
            return web.json_response(self._create(plural, ns, obj), status=201)
        if request.method != "GET":
            raise ApiStatusError(405, "MethodNotAllowed", f"{request.method} not allowed")
        selector = request.query.get("labelSelector", "")
        fields = request.query.get("fieldSelector", "")
        check_fields(fields)
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, plural, ns, selector, fields)
        kind, version = _KINDS[plural]
        return web.json_response(
            {
                "kind": f"{kind}List",
                "apiVersion": version,
                "metadata": {"resourceVersion": str(self.store.rv)},
                "items": self.store.select(plural, ns, selector, fields),
            }
        )

    def _create(self, plural: str, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
        kind, version = _KINDS[plural]
        obj.setdefault("kind", kind)
        obj.setdefault("apiVersion", version)
        if plural == "secrets":
            kube_jobs.admit_secret(obj)
        if plural == "jobs" and not obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers"):
            raise ApiStatusError(422, "Invalid", "Job.spec.template.spec.containers: Required value")
        created = self.store.create(plural, ns, obj)
        if plural == "jobs":
            kube_jobs.start_pod(self.store, created)
            if self.auto:
                name = created["metadata"]["name"]
                asyncio.get_running_loop().call_later(self.auto_delay_s, self._auto_end, ns, name)
        return created

    def _auto_end(self, ns: str, name: str) -> None:
        job = self.store.objects.get(("jobs", ns, name))
        if job is not None and not job.get("status", {}).get("conditions"):
            _HOOKS[self.auto or "complete"](self.store, job, {})

    async def _item(self, request: web.Request) -> web.Response:
        plural, ns, name = _plural_of(request), request.match_info["ns"], request.match_info["name"]
        if request.method == "GET":
            return web.json_response(self.store.get(plural, ns, name))
        if request.method == "DELETE":
            obj = self.store.delete(plural, ns, name)
            if plural == "jobs":
                for pod in kube_jobs.pods_of(self.store, obj):
                    self.store.delete("pods", ns, pod["metadata"]["name"])
            return web.json_response(obj)
        if request.method == "PATCH":
            obj = self.store.get(plural, ns, name)
            _apply_patch(obj, json.loads(await request.read()))
            return web.json_response(self.store.modified(plural, obj))
        raise ApiStatusError(405, "MethodNotAllowed", f"{request.method} not allowed")

    async def _watch(
        self, request: web.Request, plural: str, ns: str, selector: str, fields: str
    ) -> web.StreamResponse:
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        rv_text = request.query.get("resourceVersion", "")
        watcher = Watcher(plural, ns, selector, fields)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            if rv_text in ("", "0"):
                backlog = [("ADDED", obj) for obj in self.store.select(plural, ns, selector, fields)]
            else:
                backlog = [(e.type, e.obj) for e in self.store.since(watcher, int(rv_text))]
        except ApiStatusError as exc:
            await response.write(_line({"type": "ERROR", "object": exc.status()}))
            return response
        self.store.watchers.add(watcher)
        try:
            for kind, obj in backlog:
                await response.write(_line({"type": kind, "object": obj}))
            await self._stream(response, watcher, time.monotonic() + timeout)
        except ConnectionError:
            return response  # the client went away (a killed controller)
        finally:
            self.store.watchers.discard(watcher)
        return response

    @staticmethod
    async def _stream(response: web.StreamResponse, watcher: Watcher, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = await asyncio.wait_for(watcher.queue.get(), timeout=left)
            except TimeoutError:
                return
            if event.type == "CLOSE":
                return
            await response.write(_line({"type": event.type, "object": event.obj}))

    async def _hook(self, request: web.Request) -> web.Response:
        ns, name, action = (request.match_info[k] for k in ("ns", "name", "action"))
        if action not in _HOOKS:
            raise ApiStatusError(404, "NotFound", f"no hook {action!r}")
        job = self.store.get("jobs", ns, name)
        _HOOKS[action](self.store, job, dict(request.query))
        return web.json_response(job)

    async def _read_log(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        self.store.get("pods", ns, name)  # 404 for a pod that doesn't exist
        return web.Response(text=self.logs.get((ns, name), ""), content_type="text/plain")

    async def _write_log(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        self.store.get("pods", ns, name)
        self.logs[(ns, name)] = (await request.read()).decode(errors="replace")
        return web.json_response({"bytes": len(self.logs[(ns, name)])})

    async def _config(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        self.auto = body.get("auto")
        self.auto_delay_s = float(body.get("auto_delay_s", 0.0))
        return web.json_response({"auto": self.auto, "auto_delay_s": self.auto_delay_s})

    async def _compact(self, _request: web.Request) -> web.Response:
        self.store.compact()
        return web.json_response({"compacted_rv": self.store.compacted_rv})

    async def _stats(self, _request: web.Request) -> web.Response:
        store = self.store
        return web.json_response(
            {
                "creates": dict(store.creates),
                "conflicts": dict(store.conflicts),
                "jobs": len(store.select("jobs", "default", "")),
                "rv": store.rv,
            }
        )


def _plural_of(request: web.Request) -> str:
    parts = request.path.split("/")
    index = parts.index("namespaces") + 2
    return parts[index]


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def _apply_patch(obj: dict[str, Any], patch: Any) -> None:
    """A JSON merge patch (a mapping) or a JSON patch of add/replace/remove operations (a list)."""
    if isinstance(patch, dict):
        _merge(obj, patch)
        return
    for op in patch:
        *path, leaf = [p for p in op["path"].split("/") if p]
        target = obj
        for part in path:
            target = target.setdefault(part, {})
        if op["op"] == "remove":
            target.pop(leaf, None)
        else:
            target[leaf] = op["value"]


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


@web.middleware
async def _status_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
    except ApiStatusError as exc:
        return web.json_response(exc.status(), status=exc.code)
    except (ValueError, KeyError) as exc:
        error = ApiStatusError(400, "BadRequest", f"malformed request: {exc}")
        return web.json_response(error.status(), status=400)
    return response


class FakeKubeServer:
    """The fake API server on a local port, started and stopped inside an asyncio loop."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.api = FakeKube()
        self._server = LocalApp(self.api.app(), host, port)
        self.url = ""

    async def start(self) -> str:
        """Listen; returns the base URL."""
        self.url = await self._server.start()
        return self.url

    async def stop(self) -> None:
        """Close every connection."""
        self.api.store.end_watches()
        await self._server.stop()


async def _serve(port: int) -> None:
    server = FakeKubeServer(port=port)
    await server.start()
    await asyncio.Event().wait()


def main() -> None:
    """`python -m harnessrl.testkit.fake_kube --port P`."""
    parser = argparse.ArgumentParser(description="fake Kubernetes API server for tests")
    parser.add_argument("--port", type=int, default=8001)
    asyncio.run(_serve(parser.parse_args().port))


if __name__ == "__main__":
    main()

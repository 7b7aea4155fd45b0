"""A stand-in for the gateway's artifact route, for controller tests without a gateway.

`PUT /harnessrl/v1/artifact` with the episode key as Bearer token and `X-Artifact-Kind` stores the
body in the artifacts bucket as `<run>/<episode>/<kind>` and answers `{"object","size","sha256"}`,
the contract the gateway implements.
"""

from __future__ import annotations

import hashlib

from aiohttp import web

from harnessrl.shared import subjects
from harnessrl.shared.bus import Bus
from harnessrl.shared.keys import EpisodeKeyError, verify_episode_key
from harnessrl.testkit.local_app import LocalApp

MAX_ARTIFACT_BYTES = 16 * 1024 * 1024


class ArtifactSink:
    """A tiny HTTP server that accepts episode artifacts into the object store."""

    def __init__(self, bus: Bus, secret: bytes) -> None:
        self._bus, self._secret = bus, secret
        self._server: LocalApp | None = None
        self.url = ""
        self.received: list[str] = []

    async def start(self) -> str:
        """Listen on a free local port; returns the base URL."""
        app = web.Application(client_max_size=MAX_ARTIFACT_BYTES)
        app.router.add_put("/harnessrl/v1/artifact", self._put)
        self._server = LocalApp(app)
        self.url = await self._server.start()
        return self.url

    async def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            await self._server.stop()

    async def _put(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        try:
            claims = verify_episode_key(self._secret, token)
        except EpisodeKeyError as exc:
            return web.json_response({"error": str(exc)}, status=401)
        kind = request.headers.get("X-Artifact-Kind", "answer")
        if kind not in ("patch", "answer"):
            return web.json_response({"error": "X-Artifact-Kind must be patch or answer"}, status=400)
        data = await request.read()
        name = subjects.artifact_object(claims.run, claims.episode, kind)
        await self._bus.put_object(subjects.ARTIFACTS_BUCKET, name, data)
        self.received.append(name)
        digest = hashlib.sha256(data).hexdigest()
        return web.json_response({"object": name, "size": len(data), "sha256": digest})

"""The benchmark's floor: the gateway's stack with none of the gateway in it.

uvicorn (uvloop, httptools) receives the call, aiohttp forwards it to the upstream, nats-py
publishes the upstream's answer to JetStream and awaits the ack, and the answer goes back. No
auth, parsing, capture, spans or metrics: what any Python proxy on these libraries pays on this
machine. `make bench-gateway` measures it beside the gateway, so the gateway's own cost reads as
the difference. Run: `python -m harnessrl.benchmarks.gateway_floor` with `HRL_GATEWAY_PORT`,
`HRL_GATEWAY_NATS_URL` and `HRL_GATEWAY_UPSTREAMS` (a JSON list; the first is used).
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import aiohttp
import nats
import uvicorn

from harnessrl.gateway.asgi import JSON_HEADERS, Receive, Scope, Send, read_body, respond

STREAM, SUBJECT = "BENCHFLOOR", "benchfloor.answers"  # its own stream: SPANS counts the gateway's
_ids = itertools.count()
_JSON = {"content-type": "application/json"}


class Floor:
    """The bare forward-publish-answer loop as an ASGI app."""

    def __init__(self, upstream: str, nats_url: str) -> None:
        self.upstream = upstream + "/v1/chat/completions"
        self.nats_url = nats_url
        self.session: Any = None  # set at start-up (lifespan)
        self.js: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Lifespan: connect; HTTP: forward, publish, answer."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["path"] == "/readyz":
            await respond(send, 200, b"{}")
            return
        body = await read_body(scope, receive, 1 << 20)
        async with self.session.post(self.upstream, data=body, headers=_JSON) as response:
            answer = await response.read()
        await self.js.publish(SUBJECT, answer, headers={"Nats-Msg-Id": f"f{next(_ids)}"})
        await respond(send, 200, answer, JSON_HEADERS)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.js = (await nats.connect(self.nats_url)).jetstream()
        await self.js.add_stream(name=STREAM, subjects=[SUBJECT])
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await self.session.close()
        await send({"type": "lifespan.shutdown.complete"})


def main() -> None:
    """Serve the floor on `HRL_GATEWAY_PORT`."""
    floor = Floor(json.loads(os.environ["HRL_GATEWAY_UPSTREAMS"])[0], os.environ["HRL_GATEWAY_NATS_URL"])
    uvicorn.run(
        floor, host="127.0.0.1", port=int(os.environ["HRL_GATEWAY_PORT"]), loop="uvloop", http="httptools",
        access_log=False, proxy_headers=False, log_level="warning", lifespan="on",
    )  # fmt: skip


if __name__ == "__main__":
    main()

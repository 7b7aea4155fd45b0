"""`PUT /harnessrl/v1/artifact`: a harness hands in its patch or answer with its episode key.

The bytes go to the JetStream object store (`ARTIFACTS_BUCKET`) under `<run>/<episode>/<kind>`;
the controller's episode wrapper then references them in `AgentExited`. No span: nothing is sampled.
"""

from __future__ import annotations

import hashlib

import msgspec

from harnessrl.gateway.asgi import Receive, Scope, Send, header, read_body, respond
from harnessrl.gateway.errors import BadRequest, Unavailable
from harnessrl.gateway.service import Gateway
from harnessrl.shared.keys import EpisodeClaims
from harnessrl.shared.subjects import ARTIFACTS_BUCKET, artifact_object

PATH = "/harnessrl/v1/artifact"
KINDS = frozenset({"patch", "answer", "file"})

_encoder = msgspec.json.Encoder()


async def upload(gateway: Gateway, claims: EpisodeClaims, scope: Scope, receive: Receive, send: Send) -> int:
    """Store the raw body; answer its object name, size and sha256."""
    kind = (header(scope, b"x-artifact-kind") or b"patch").decode(errors="replace").strip()
    if kind not in KINDS:
        raise BadRequest(f"X-Artifact-Kind must be one of {', '.join(sorted(KINDS))}")
    data = await read_body(scope, receive, gateway.settings.max_artifact_bytes)
    name = artifact_object(claims.run, claims.episode, kind)
    try:
        await gateway.bus.put_object(ARTIFACTS_BUCKET, name, data)
    except Exception as exc:
        raise Unavailable("the artifact store is unavailable", retry_after=2.0) from exc
    digest = hashlib.sha256(data).hexdigest()
    await respond(send, 200, _encoder.encode({"object": name, "size": len(data), "sha256": digest}))
    return 200

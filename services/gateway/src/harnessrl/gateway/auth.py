"""Episode keys on the hot path: where a key comes from, and a cache of verified ones.

A harness sends its key on every call; verifying it (base64, msgpack, HMAC) each time is pure
overhead, so verified claims are cached by key. Expiry is still checked on every use.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from harnessrl.gateway.asgi import Scope, header
from harnessrl.gateway.errors import Unauthorized
from harnessrl.shared.keys import EpisodeClaims, EpisodeKeyError, verify_episode_key


class KeyVerifier:
    """Verifies episode keys with one shared secret; remembers up to `cache_size` good keys."""

    def __init__(self, secret: bytes, cache_size: int = 8192) -> None:
        self.secret = secret
        self.cache_size = cache_size
        self._verified: OrderedDict[str, EpisodeClaims] = OrderedDict()

    def verify(self, key: str) -> EpisodeClaims:
        """The key's claims; `Unauthorized` when missing, malformed, tampered or expired."""
        if not key:
            raise Unauthorized("missing episode key")
        claims = self._verified.get(key)
        if claims is None:
            try:
                claims = verify_episode_key(self.secret, key)
            except EpisodeKeyError as exc:
                raise Unauthorized(str(exc)) from exc
            self._verified[key] = claims
            if len(self._verified) > self.cache_size:
                self._verified.popitem(last=False)
        elif claims.expires_at <= time.time():
            del self._verified[key]
            raise Unauthorized("episode key expired")
        return claims


def presented_key(scope: Scope, path_key: str | None) -> str:
    """The key from the path, else `Authorization: Bearer`, else `x-api-key`."""
    if path_key:
        return path_key
    value = header(scope, b"authorization")
    if value is not None:
        scheme, _, token = value.decode(errors="replace").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return (header(scope, b"x-api-key") or b"").decode(errors="replace")

"""Per-episode API keys: signed, short-lived, scoped to one run and one episode.

A key is `hrl_<base64url(payload)>.<base64url(hmac)>` where the payload is msgpack of
(run, episode, expiry). The harness gets only its own key; the signing secret never leaves the
controller and gateway.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import msgspec

PREFIX = "hrl_"


class EpisodeKeyError(ValueError):
    """Base of key verification failures (kept distinct from the builtin KeyError)."""


class InvalidKeyError(EpisodeKeyError):
    """Malformed or tampered key."""


class ExpiredKeyError(EpisodeKeyError):
    """The key's expiry has passed."""


class WrongRunError(EpisodeKeyError):
    """The key belongs to another run."""


class EpisodeClaims(msgspec.Struct, frozen=True, array_like=True):
    """What a key proves: which episode of which run, until when."""

    run: str
    episode: str
    expires_at: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def sign_episode_key(secret: bytes, run: str, episode: str, ttl_s: float) -> str:
    """Issue a key for one episode, valid for `ttl_s` seconds."""
    payload = msgspec.msgpack.encode(EpisodeClaims(run, episode, time.time() + ttl_s))
    return f"{PREFIX}{_b64(payload)}.{_b64(_mac(secret, payload))}"


def verify_episode_key(
    secret: bytes, key: str, *, run: str | None = None, now: float | None = None
) -> EpisodeClaims:
    """Check signature, expiry and (optionally) run; raise a `EpisodeKeyError` subclass on failure."""
    if not key.startswith(PREFIX) or key.count(".") != 1:
        raise InvalidKeyError("malformed episode key")
    body, sig = key[len(PREFIX) :].split(".")
    try:
        payload, mac = _unb64(body), _unb64(sig)
    except (ValueError, TypeError) as exc:
        raise InvalidKeyError("malformed episode key") from exc
    # One key has one spelling: base64 decoding forgives padding, stray characters and the unused
    # bits of the last character, so without this an altered key would verify (and fill caches).
    if _b64(payload) != body or _b64(mac) != sig:
        raise InvalidKeyError("episode key is not in canonical form")
    if not hmac.compare_digest(mac, _mac(secret, payload)):
        raise InvalidKeyError("episode key signature does not match")
    try:
        claims = msgspec.msgpack.decode(payload, type=EpisodeClaims)
    except msgspec.MsgspecError as exc:
        raise InvalidKeyError("malformed episode key payload") from exc
    if claims.expires_at <= (time.time() if now is None else now):
        raise ExpiredKeyError("episode key expired")
    if run is not None and claims.run != run:
        raise WrongRunError("episode key belongs to another run")
    return claims

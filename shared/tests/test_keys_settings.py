"""Episode keys (signing, tampering, expiry, wrong run) and settings loading errors."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from harnessrl.shared.keys import (
    ExpiredKeyError,
    InvalidKeyError,
    WrongRunError,
    sign_episode_key,
    verify_episode_key,
)
from harnessrl.shared.settings import SettingsError, load_settings

SECRET = b"s3cret-for-tests"


def test_key_round_trip() -> None:
    key = sign_episode_key(SECRET, "run-1", "ep-7", ttl_s=60)
    claims = verify_episode_key(SECRET, key, run="run-1")
    assert (claims.run, claims.episode) == ("run-1", "ep-7")


def test_tampered_key_is_rejected() -> None:
    key = sign_episode_key(SECRET, "run-1", "ep-7", ttl_s=60)
    other = sign_episode_key(SECRET, "run-1", "ep-8", ttl_s=60)
    spliced = key.split(".")[0] + "." + other.split(".")[1]
    for bad in (
        spliced,
        key[:-2] + ("AA" if not key.endswith("AA") else "BB"),
        key + "x",
        "hrl_",
        "sk-1234",
        "",
    ):
        with pytest.raises(InvalidKeyError):
            verify_episode_key(SECRET, bad)


def test_key_signed_with_another_secret_is_rejected() -> None:
    key = sign_episode_key(b"other", "run-1", "ep-7", ttl_s=60)
    with pytest.raises(InvalidKeyError):
        verify_episode_key(SECRET, key)


def test_expired_key_is_rejected() -> None:
    key = sign_episode_key(SECRET, "run-1", "ep-7", ttl_s=60)
    claims = verify_episode_key(SECRET, key)
    with pytest.raises(ExpiredKeyError):
        verify_episode_key(SECRET, key, now=claims.expires_at + 1)


def test_key_of_another_run_is_rejected() -> None:
    key = sign_episode_key(SECRET, "run-1", "ep-7", ttl_s=60)
    with pytest.raises(WrongRunError):
        verify_episode_key(SECRET, key, run="run-2")


class Example(msgspec.Struct, frozen=True, kw_only=True):
    port: int = 8000
    name: str = "gw"
    ratio: float = 0.5
    upstreams: list[str] = msgspec.field(default_factory=list)


def test_settings_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text('[gateway]\nport = 9000\nname = "from-toml"\n')
    env = {"HRL_GW_PORT": "9100", "HRL_GW_UPSTREAMS": '["http://a", "http://b"]'}
    got = load_settings(Example, prefix="HRL_GW_", section="gateway", toml_path=toml, env=env, ratio=0.9)
    assert got == Example(port=9100, name="from-toml", ratio=0.9, upstreams=["http://a", "http://b"])


def test_settings_error_names_the_field() -> None:
    with pytest.raises(SettingsError, match="port"):
        load_settings(Example, prefix="HRL_GW_", env={"HRL_GW_PORT": "not-a-number"})


def test_unknown_setting_is_an_error(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text("[gateway]\nprot = 1\n")
    with pytest.raises(SettingsError, match="prot"):
        load_settings(Example, prefix="HRL_GW_", section="gateway", toml_path=toml, env={})


def test_unreadable_settings_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 1")
    with pytest.raises(SettingsError, match=r"bad\.toml"):
        load_settings(Example, prefix="HRL_GW_", toml_path=bad, env={})

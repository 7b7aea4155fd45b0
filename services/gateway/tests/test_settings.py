"""Settings are validated on load: a bad value fails with `SettingsError` naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.gateway.settings import GatewaySettings, read_settings
from harnessrl.shared.settings import SettingsError


def test_toml_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[gateway]\nkey_secret = "s"\nport = 9001\nhost = "10.0.0.1"\n')
    monkeypatch.setenv("HRL_GATEWAY_PORT", "9002")
    settings = read_settings(config, host=None, upstreams=["http://vllm:8000"])
    assert (settings.port, settings.host, settings.upstreams) == (9002, "10.0.0.1", ["http://vllm:8000"])


def test_the_key_secret_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HRL_GATEWAY_KEY_SECRET", raising=False)
    with pytest.raises(SettingsError, match="HRL_GATEWAY_KEY_SECRET is required"):
        read_settings()


@pytest.mark.parametrize(
    ("name", "value"),
    [("port", 70000), ("shutdown_grace_s", -1), ("max_body_bytes", 0), ("unhealthy_after_failures", 0)],
)
def test_invalid_values_name_the_setting(name: str, value: int) -> None:
    with pytest.raises(SettingsError, match=name):
        read_settings(key_secret="s", **{name: value})
    with pytest.raises(SettingsError, match=name):
        GatewaySettings(key_secret="s", **{name: value})

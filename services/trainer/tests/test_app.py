"""The process entry point: flags over settings, and invalid settings refused with a clear message."""

import re

import pytest

from harnessrl.shared.settings import SettingsError
from harnessrl.trainer import app
from harnessrl.trainer.settings import SampleLimits, TrainerSettings, read_settings


def test_invalid_settings_exit_2_with_one_line_naming_the_field(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("HRL_TRAINER_BATCH_GROUPS", raising=False)
    code = app.main(["--run", "r", "--model-dir", "m", "--batch-groups", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("harnessrl trainer: ") and "batch_groups" in err and err.count("\n") == 1


def test_flags_override_toml_and_environment(tmp_path, monkeypatch: pytest.MonkeyPatch):
    config = tmp_path / "trainer.toml"
    config.write_text('[trainer]\nrun = "from-toml"\nmodel_dir = "m"\nstaleness = 3\n')
    monkeypatch.setenv("HRL_TRAINER_STALENESS", "4")
    settings = read_settings(config, run="from-flag")
    assert (settings.run, settings.model_dir, settings.staleness) == ("from-flag", "m", 4)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"staleness": -1}, "staleness"),
        ({"weight_transfer": "nccl"}, "nccl_master_address"),
        ({"limits": {"max_prompt_len": 64, "max_seq_len": 64}}, "limits.max_seq_len"),
        ({"engine": {"lr": 0}}, "engine.lr"),
    ],
)
def test_validation_names_the_field(values, field):
    with pytest.raises(SettingsError, match=re.escape(field)):
        read_settings(run="r", model_dir="m", **values)


def test_sub_settings_validate_when_built_directly():
    with pytest.raises(SettingsError, match=r"limits\.max_seq_len"):
        SampleLimits(max_prompt_len=10, max_seq_len=5)
    assert TrainerSettings(run="r", model_dir="m").limits == SampleLimits()


def test_rows_longer_than_a_micro_batch_are_refused_at_start_naming_both(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HRL_TRAINER_ENGINE", '{"max_tokens_per_micro_batch": 32768}')
    code = app.main(["--run", "r", "--model-dir", "m"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "limits.max_seq_len: 65536 must not exceed engine.max_tokens_per_micro_batch (32768)" in err


def test_defaults_fit_coding_agents():
    settings = TrainerSettings(run="r", model_dir="m")
    assert settings.limits.max_seq_len >= 65536 > 32768 and settings.limits.max_prompt_len >= 32768
    assert settings.engine.temperature is None  # the run's own sampling temperature

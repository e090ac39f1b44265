"""Settings come from flags, then environment variables, then defaults, and are checked at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from capability.config import CapabilitySettings
from classify_common.settings import SettingsError
from orchestrator.config import OrchestratorSettings


def test_defaults_are_the_documented_ports() -> None:
    assert CapabilitySettings.from_args([], environ={}).port == 50052
    assert OrchestratorSettings.from_args([], environ={}).port == 50051
    assert OrchestratorSettings.from_args([], environ={}).routes_file == Path("routes.yaml")


def test_environment_overrides_default_and_flag_overrides_environment() -> None:
    environ = {"CAPABILITY_PORT": "6000", "CAPABILITY_DEVICE": "cpu"}
    assert CapabilitySettings.from_args([], environ=environ).port == 6000
    from_flag = CapabilitySettings.from_args(["--port", "7000"], environ=environ)
    assert from_flag.port == 7000
    assert from_flag.device == "cpu"


def test_out_of_range_port_names_flag_and_variable() -> None:
    with pytest.raises(SettingsError, match=r"--port / ORCHESTRATOR_PORT: port 70000"):
        OrchestratorSettings.from_args([], environ={"ORCHESTRATOR_PORT": "70000"})


def test_unknown_device_is_refused() -> None:
    with pytest.raises(SettingsError, match="--device / CAPABILITY_DEVICE: 'tpu'"):
        CapabilitySettings.from_args(["--device", "tpu"], environ={})


def test_grace_period_is_bounded() -> None:
    with pytest.raises(SettingsError, match="--grace-seconds / CAPABILITY_GRACE_SECONDS"):
        CapabilitySettings(grace_seconds=301)


def test_missing_model_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="--model-dir / CAPABILITY_MODEL_DIR"):
        CapabilitySettings(model_dir=tmp_path / "absent")

"""Each setting is declared once; its flag, variable, bounds check and docs row follow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from capability.config import CapabilitySettings
from classify_common.server_settings import ServerSettings
from classify_common.settings import Settings, SettingsError, setting
from classify_common.settings_doc import MarkersMissing, replace_table, settings_table
from orchestrator.config import OrchestratorSettings
from tools.settings_doc import doc_path, regenerate


@dataclass(frozen=True)
class Throwaway(Settings):
    """A layer with one setting, declared in one place only."""

    ENV_PREFIX: ClassVar[str] = "TOY_"

    gadgets: int = setting(3, "gadgets per widget", int, low=1, high=9, unit="w")


def test_a_setting_declared_once_is_a_flag_a_variable_a_bounds_check_and_a_docs_row() -> None:
    assert Throwaway.from_args([], environ={}).gadgets == 3
    from_env = Throwaway.from_args([], environ={"TOY_GADGETS": "4"})
    assert from_env.gadgets == 4
    from_flag = Throwaway.from_args(["--gadgets", "5"], environ={"TOY_GADGETS": "4"})
    assert from_flag.gadgets == 5
    with pytest.raises(
        SettingsError,
        match=r"^--gadgets / TOY_GADGETS: 10 is outside 1\.\.9$",
    ):
        Throwaway.from_args([], environ={"TOY_GADGETS": "10"})
    row = "| `--gadgets` | `TOY_GADGETS` | `3` | 1..9 w | gadgets per widget |"
    assert row in settings_table(Throwaway, "throwaway").splitlines()


def test_a_bad_environment_value_names_the_flag_and_the_variable() -> None:
    with pytest.raises(SettingsError, match=r"^--gadgets / TOY_GADGETS: 'many'"):
        Throwaway.from_args([], environ={"TOY_GADGETS": "many"})


def test_both_layers_take_the_shared_server_settings_under_their_own_prefix() -> None:
    shared = [each.name for each in ServerSettings.declared()]
    for layer, prefix in (
        (CapabilitySettings, "CAPABILITY_"),
        (OrchestratorSettings, "ORCHESTRATOR_"),
    ):
        envs = {each.name: each.env for each in layer.declared()}
        assert {name: envs[name] for name in shared} == {
            name: prefix + name.upper() for name in shared
        }


def test_the_configuration_tables_are_the_declared_settings() -> None:
    path = doc_path()
    text = path.read_text(encoding="utf-8")
    assert regenerate(text) == text, f"{path} is out of date: run python -m tools.settings_doc"


def test_a_table_without_its_markers_is_refused() -> None:
    with pytest.raises(MarkersMissing, match="<!-- settings: capability -->"):
        replace_table("# Configuration\n", "capability", "| table |\n")

"""Model names follow one rule, the contract's, wherever they are checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf.message import Message

from ai.classify.v1 import classify_service_pb2, model_service_pb2
from buf.validate import validate_pb2
from capability.config import CapabilitySettings
from capability.lifecycle import ModelRoot
from classify_common.errors import ModelNotFound
from classify_common.model_names import MODEL_NAME_MAX_CHARS, MODEL_NAME_PATTERN, is_model_name
from classify_common.settings import SettingsError
from orchestrator.routing import RoutesFileError, load_routes

LONGEST = "m" * MODEL_NAME_MAX_CHARS
TOO_LONG = "m" * (MODEL_NAME_MAX_CHARS + 1)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (classify_service_pb2.ClassifyRequest, "model"),
        (model_service_pb2.GetModelRequest, "name"),
        (model_service_pb2.ReloadModelRequest, "name"),
    ],
)
def test_the_rule_is_the_contracts(message: type[Message], field: str) -> None:
    options = message.DESCRIPTOR.fields_by_name[field].GetOptions()
    rule = options.Extensions[validate_pb2.field].string
    assert (rule.pattern, rule.max_len) == (MODEL_NAME_PATTERN, MODEL_NAME_MAX_CHARS)


@pytest.mark.parametrize("name", ["topic-minilm", "a", "v1.2_x", LONGEST])
def test_names_the_contract_accepts_are_model_names(name: str) -> None:
    assert is_model_name(name)


@pytest.mark.parametrize("name", ["", "Topic", "-topic", "topic-", "a b", TOO_LONG, None])
def test_names_the_contract_refuses_are_not_model_names(name: str | None) -> None:
    assert not is_model_name(name)


def test_a_routes_file_naming_a_model_past_the_rule_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(
        "version: 1\n"
        f"backends:\n  minilm:\n    model: {TOO_LONG}\n"
        '    targets: ["127.0.0.1:50052"]\n    timeout: 250ms\n'
        "routes:\n  - name: default\n    backend: minilm\n"
    )
    with pytest.raises(RoutesFileError, match=r"backends\.minilm\.model: 'm+' is not a model name"):
        load_routes(path)


def test_a_model_folder_past_the_rule_is_not_served(tmp_path: Path) -> None:
    for name in ("topic", TOO_LONG):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "manifest.json").write_text("{}")
    root = ModelRoot(tmp_path)
    assert root.model_names() == ["topic"]
    with pytest.raises(ModelNotFound, match="is not a model name"):
        root.version_dir(TOO_LONG, "1")


def test_a_served_or_default_model_past_the_rule_is_refused_by_flag_and_variable() -> None:
    with pytest.raises(
        SettingsError, match=r"^--models / CAPABILITY_MODELS: 'Topic' is not a model"
    ):
        CapabilitySettings.from_args(["--models", "topic-static, Topic"], environ={})
    with pytest.raises(
        SettingsError, match=r"^--default-model / CAPABILITY_DEFAULT_MODEL: 'm+' is not a model"
    ):
        CapabilitySettings.from_args([], environ={"CAPABILITY_DEFAULT_MODEL": TOO_LONG})


def test_a_model_config_entry_past_the_rule_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text("Topic-Static:\n  max_batch_size: 64\n")
    located = rf"^--model-config / CAPABILITY_MODEL_CONFIG: {re.escape(str(config))}:1: "
    with pytest.raises(SettingsError, match=located + "Topic-Static: not a model name"):
        CapabilitySettings(model_config=config).with_model_config()

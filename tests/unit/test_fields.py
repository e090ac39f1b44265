"""One reader for the mappings of the YAML documents: types, bounds, defaults, paths."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from capability.config import CapabilitySettings
from classify_common.fields import FieldRefused, Fields, read_yaml
from orchestrator.routing.table import load_routes
from orchestrator.security import load_api_keys

DEFAULT_BURST = 10


def test_an_absent_key_gets_the_named_default_and_a_present_one_its_value() -> None:
    spec = Fields({"rate": 2.5}, "tenants.acme")
    assert spec.number("rate") == 2.5
    assert spec.integer("burst", DEFAULT_BURST) == DEFAULT_BURST


def test_a_missing_required_key_is_named_with_its_mapping() -> None:
    with pytest.raises(FieldRefused, match=r"^tenants\.acme: missing required key 'rate'$"):
        Fields({}, "tenants.acme").number("rate")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, r"^models\.a\.size: True is not an integer$"),
        ("3", r"^models\.a\.size: '3' is not an integer$"),
        (0, r"^models\.a\.size: 0 is outside 1\.\.9$"),
    ],
)
def test_an_integer_is_never_a_bool_or_a_string_and_stays_in_bounds(
    value: object, message: str
) -> None:
    with pytest.raises(FieldRefused, match=message):
        Fields({"size": value}, "models.a").integer("size", low=1, high=9)


def test_a_key_no_reader_asked_for_is_refused_by_its_path() -> None:
    spec = Fields({"size": 1, "colour": "red"}, "models.a")
    spec.integer("size")
    with pytest.raises(FieldRefused, match=r"^models\.a\.colour: unknown key \(allowed: size\)$"):
        spec.refuse_unknown()
    with pytest.raises(FieldRefused, match=r"^models\.a\.colour: unknown key \(allowed: a, b\)$"):
        Fields({"colour": "red"}, "models.a", allowed=("a", "b"))


def test_a_word_outside_its_choices_is_refused() -> None:
    with pytest.raises(FieldRefused, match=r"^role: 'root' is not one of \('user', 'admin'\)$"):
        Fields({"role": "root"}).choice("role", ("user", "admin"))


def test_nested_mappings_and_lists_name_their_own_paths() -> None:
    top = Fields({"tenants": None, "keys": {"a": 1}})
    assert list(top.mapping("tenants")) == []
    with pytest.raises(FieldRefused, match=r"^keys: expected a list, got dict$"):
        top.items("keys")
    with pytest.raises(FieldRefused, match=r"^routes\[0\]: expected a mapping, got str$"):
        Fields("default", "routes[0]")


def test_an_optional_value_is_none_when_absent_or_null_and_checked_when_present() -> None:
    spec = Fields({"limit": None, "ratio": "high"})
    assert spec.optional_integer("limit") is None
    assert spec.optional_integer("burst") is None
    with pytest.raises(FieldRefused, match=r"^ratio: 'high' is not a number$"):
        spec.optional_number("ratio")


@pytest.mark.parametrize(
    ("written", "read", "message"),
    [
        ("1.5e1", "number", "'1.5e1' is not a number: YAML reads it as a string (YAML 1.1 "
         "takes an exponent only after a dot and with a sign), so write 15 or 1.5e+1"),
        ("1e-3", "number", "'1e-3' is not a number: YAML reads it as a string (YAML 1.1 "
         "takes an exponent only after a dot and with a sign), so write 0.001 or 1.0e-3"),
        ("1e3", "integer", "'1e3' is not an integer: YAML reads it as a string (YAML 1.1 "
         "takes an exponent only after a dot and with a sign), so write 1000"),
        ("12e", "number", "'12e' is not a number"),
    ],
)  # fmt: skip
def test_a_number_yaml_read_as_a_string_is_refused_saying_what_to_write(
    written: str, read: str, message: str
) -> None:
    """PyYAML reads YAML 1.1, where `1.5e1` and `1e3` are strings: the refusal said
    "'1.5e1' is not a number" of what reads as one. The form it suggests is read as
    the number meant."""
    value = yaml.safe_load(f"rate: {written}")["rate"]
    with pytest.raises(FieldRefused) as refused:
        getattr(Fields({"rate": value}, "tenants.acme"), read)("rate")
    assert str(refused.value) == f"tenants.acme.rate: {message}"
    suggested = message.rpartition(" or ")[2]
    if read == "number" and " or " in message:
        assert yaml.safe_load(f"rate: {suggested}")["rate"] == float(written)


def test_a_value_refused_while_reading_a_file_is_named_by_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text("tenants:\n  acme:\n    burst: many\n")

    def read(document: object) -> int:
        return Fields(document).mapping("tenants").mapping("acme").integer("burst")

    located = rf"^{re.escape(str(path))}:3: tenants\.acme\.burst: 'many' is not an integer$"
    with pytest.raises(FieldRefused, match=located):
        read_yaml(path, read)


# A YAML int past a float's range: float() of it raised OverflowError.
PAST_FLOAT = "1" + "0" * 400


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), r"^tenants\.acme\.rate: nan is not a finite number$"),
        (float("inf"), r"^tenants\.acme\.rate: inf is not a finite number$"),
        (-float("inf"), r"^tenants\.acme\.rate: -inf is not a finite number$"),
        (int(PAST_FLOAT), r"^tenants\.acme\.rate: a whole number of 401 digits is too large$"),
    ],
    ids=["nan", "inf", "minus-inf", "past-float"],
)
def test_a_number_that_is_not_finite_is_refused_by_its_path(value: float, message: str) -> None:
    """Unbounded too: NaN passed every bound, comparing false with everything."""
    with pytest.raises(FieldRefused, match=message):
        Fields({"rate": value}, "tenants.acme").number("rate")


def _keys_file(path: Path) -> None:
    path.write_text(f"tenants:\n  acme: {{rate_per_second: {PAST_FLOAT}, burst: 3}}\n")
    load_api_keys(path)


def _routes_file(path: Path) -> None:
    path.write_text(
        "version: 1\nbackends:\n  a: {model: topic-minilm, targets: ['127.0.0.1:1']}\n"
        f"routes:\n  - name: d\n    backend: a\nretry_budget: {{ratio: {PAST_FLOAT}}}\n"
    )
    load_routes(path)


def _model_config(path: Path) -> None:
    path.write_text(f"topic-minilm:\n  max_wait_ms: {PAST_FLOAT}\n")
    CapabilitySettings.from_args(["--model-config", str(path)], environ={})


@pytest.mark.parametrize(
    ("load", "where"),
    [
        (_keys_file, ":2:"),
        (_routes_file, ":7:"),
        (_model_config, ":2:"),
    ],
    ids=["keys", "routes", "model-config"],
)
def test_a_whole_number_past_a_floats_range_is_refused_naming_file_and_line(
    tmp_path: Path, load: Callable[[Path], None], where: str
) -> None:
    """It was an OverflowError: a traceback at start, and a reload that failed. No
    integer a setting needs is written in over 100 characters: refused as it is read."""
    path = tmp_path / "document.yaml"
    written = r"(\d+:)? a whole number written in 401 characters"
    with pytest.raises(ValueError, match=re.escape(f"{path}{where}") + written):
        load(path)

"""The SDK's OTEL_* variables are read as the specification says, and flags win."""

from __future__ import annotations

import re

import pytest

from classify_common.otel_environment import (
    TraceSampling,
    UnsupportedOtlpProtocol,
    check_otlp_protocol,
    check_plaintext_endpoint,
    export_endpoint_is_set,
    export_limits,
    exporter_timeout_seconds,
    trace_sampling,
)
from classify_common.settings import SettingsError
from classify_common.span_export import ExportLimits
from classify_common.tracing import process_resource


@pytest.mark.parametrize(
    ("sampler", "expected"),
    [
        ("always_on", TraceSampling(1.0, parent_based=False)),
        ("always_off", TraceSampling(0.0, parent_based=False)),
        ("traceidratio", TraceSampling(0.25, parent_based=False)),
        ("parentbased_always_on", TraceSampling(1.0, parent_based=True)),
        ("parentbased_always_off", TraceSampling(0.0, parent_based=True)),
        ("parentbased_traceidratio", TraceSampling(0.25, parent_based=True)),
    ],
)
def test_each_sampler_name_is_a_ratio_and_a_parent_rule(
    sampler: str, expected: TraceSampling
) -> None:
    environ = {"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    assert trace_sampling(environ, None) == expected


def test_without_variables_sampling_is_parent_based_keeping_all() -> None:
    assert trace_sampling({}, None) == TraceSampling(1.0, parent_based=True)


def test_the_sample_ratio_flag_wins_over_the_sampler_variables() -> None:
    environ = {"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "1"}
    assert trace_sampling(environ, 0.0) == TraceSampling(0.0, parent_based=True)


def test_an_unknown_sampler_is_refused_by_name() -> None:
    with pytest.raises(SettingsError, match="OTEL_TRACES_SAMPLER: 'jaeger_remote'"):
        trace_sampling({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, None)


def test_a_sampler_argument_outside_0_to_1_is_refused() -> None:
    environ = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}
    with pytest.raises(
        SettingsError, match=re.escape("OTEL_TRACES_SAMPLER_ARG: 2.0 is outside 0..1")
    ):
        trace_sampling(environ, None)


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]
)
def test_an_http_protocol_is_refused_naming_the_variable(variable: str) -> None:
    with pytest.raises(UnsupportedOtlpProtocol, match=f"{variable}: 'http/protobuf'"):
        check_otlp_protocol({variable: "http/protobuf"})
    check_otlp_protocol({variable: "grpc"})


def test_the_traces_protocol_variable_wins_over_the_general_one() -> None:
    check_otlp_protocol(
        {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    )


def test_either_endpoint_variable_turns_export_on() -> None:
    assert not export_endpoint_is_set({})
    assert export_endpoint_is_set({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert export_endpoint_is_set({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"})


def test_batch_variables_set_the_export_limits() -> None:
    environ = {
        "OTEL_BSP_MAX_QUEUE_SIZE": "100",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_BSP_EXPORT_TIMEOUT": "2000",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10",
    }
    assert export_limits(environ) == ExportLimits(
        queue_size=100, delay_millis=50, timeout_millis=2000, batch_size=10
    )
    assert export_limits({}) == ExportLimits()


def test_the_exporters_timeout_variables_are_milliseconds_as_the_specification_says() -> None:
    # Left to the Python exporter, 10000 (10 s) was read as 10,000 seconds.
    assert exporter_timeout_seconds({"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"}) == 10.0
    both = {"OTEL_EXPORTER_OTLP_TIMEOUT": "10000", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "250"}
    assert exporter_timeout_seconds(both) == 0.25
    assert exporter_timeout_seconds({}) is None
    for text in ("ten", "0", "-5", "inf"):
        with pytest.raises(SettingsError, match=r"OTEL_EXPORTER_OTLP_TIMEOUT: .* milliseconds"):
            exporter_timeout_seconds({"OTEL_EXPORTER_OTLP_TIMEOUT": text})


def test_a_batch_larger_than_the_queue_is_refused() -> None:
    environ = {"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20"}
    with pytest.raises(SettingsError, match=r"OTEL_BSP_\*: batch size 20 is outside 1\.\.10"):
        export_limits(environ)


def test_service_name_variable_wins_over_the_servers_own_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert process_resource("orchestrator").attributes["service.name"] == "orchestrator"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=edge,deployment.environment=dev")
    from_attributes = process_resource("orchestrator")
    assert from_attributes.attributes["service.name"] == "edge"
    assert from_attributes.attributes["deployment.environment"] == "dev"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "front")
    assert process_resource("orchestrator").attributes["service.name"] == "front"


@pytest.mark.parametrize(
    "variables",
    [
        {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/ca.pem"},
        {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": "/etc/ca.pem"},
        {"OTEL_EXPORTER_OTLP_INSECURE": "false"},
    ],
)
def test_the_plaintext_endpoint_flag_beside_tls_variables_is_refused(
    variables: dict[str, str],
) -> None:
    (name,) = variables
    with pytest.raises(
        SettingsError, match=f"--otlp-endpoint sends spans in plaintext, but {name}"
    ):
        check_plaintext_endpoint(variables, "collector:4317")
    check_plaintext_endpoint(variables, None)  # the variables alone decide: fine
    check_plaintext_endpoint({"OTEL_EXPORTER_OTLP_INSECURE": "true"}, "collector:4317")

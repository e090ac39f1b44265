"""A call's server span when no spans are exported: only its IDs, continuing the caller's trace."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from classify_common import tracing
from classify_common.tracing import start_server_span

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
ATTRIBUTES = {"rpc.system": "grpc", "rpc.method": "/ai.classify.v1.ClassifyService/Classify"}


@pytest.fixture
def unexported(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process exports no spans (the tests' session exports to memory)."""
    monkeypatch.setattr(tracing, "_exporting", False)


def traceparent(flags: str) -> tuple[str, str]:
    return ("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-{flags}")


@pytest.mark.usefixtures("unexported")
@pytest.mark.parametrize("flags", ["01", "00"])
def test_unexported_span_continues_the_callers_trace_and_sampling_decision(flags: str) -> None:
    span = start_server_span(
        "Classify", [traceparent(flags), ("tracestate", "vendor=value")], ATTRIBUTES
    )

    context = span.get_span_context()
    assert not span.is_recording()
    assert format(context.trace_id, "032x") == CALLER_TRACE
    assert context.span_id not in (0, int(CALLER_SPAN, 16))
    assert not context.is_remote
    assert context.trace_flags.sampled is (flags == "01")
    assert context.trace_state.get("vendor") == "value"


@pytest.mark.usefixtures("unexported")
@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_unexported_span_without_a_caller_starts_a_trace_sampled_at_the_configured_ratio(
    monkeypatch: pytest.MonkeyPatch, ratio: float
) -> None:
    monkeypatch.setattr(tracing, "_new_traces", TraceIdRatioBased(ratio))

    first = start_server_span("Classify", [("user-agent", "test")], ATTRIBUTES).get_span_context()
    second = start_server_span("Classify", None, ATTRIBUTES).get_span_context()

    assert first.is_valid
    assert second.is_valid
    assert first.trace_id != second.trace_id
    assert first.trace_flags.sampled is second.trace_flags.sampled is (ratio == 1.0)


@pytest.mark.usefixtures("unexported")
def test_unexported_span_ignores_a_malformed_traceparent() -> None:
    span = start_server_span("Classify", [("traceparent", "00-zz-yy-01")], ATTRIBUTES)
    context = span.get_span_context()
    assert context.is_valid
    assert format(context.trace_id, "032x") != CALLER_TRACE


def test_exported_span_records_under_the_caller() -> None:
    span = start_server_span("Classify", [traceparent("01")], ATTRIBUTES)
    try:
        assert span.is_recording()
        assert format(span.get_span_context().trace_id, "032x") == CALLER_TRACE
    finally:
        span.end()

"""A call's server span when no spans are exported: only its IDs, continuing the caller's
trace; and the W3C headers read and written as opentelemetry's propagators do."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import baggage, propagate
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import TextMapPropagator, default_getter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    TraceFlags,
    TraceState,
    get_current_span,
    set_span_in_context,
    use_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from classify_common import tracing
from classify_common.tracing import (
    extract_context,
    inject_context,
    parse_traceparent,
    start_server_span,
)

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
ATTRIBUTES = {"rpc.system.name": "grpc", "rpc.method": "ai.classify.v1.ClassifyService/Classify"}


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


HEADERS = [
    f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
    f"00-{CALLER_TRACE}-{CALLER_SPAN}-00",
    f" \t00-{CALLER_TRACE}-{CALLER_SPAN}-03 ",
    f"00-{CALLER_TRACE}-{CALLER_SPAN}-01-extra",
    f"01-{CALLER_TRACE}-{CALLER_SPAN}-01-future-fields",
    f"ff-{CALLER_TRACE}-{CALLER_SPAN}-01",
    f"00-{'0' * 32}-{CALLER_SPAN}-01",
    f"00-{CALLER_TRACE}-{'0' * 16}-01",
    f"00-{CALLER_TRACE.upper()}-{CALLER_SPAN}-01",
    f"00-{CALLER_TRACE}-{CALLER_SPAN}-01\n",
    f"00-{CALLER_TRACE}-{CALLER_SPAN}-01" + " " * 600,
    "00-zz-yy-01",
    "",
]


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("state", [None, "vendor=value,other=1", "not a tracestate"])
def test_traceparent_is_read_as_the_w3c_propagator_reads_it(header: str, state: str | None) -> None:
    carrier = (
        {"traceparent": header} if state is None else {"traceparent": header, "tracestate": state}
    )
    expected = get_current_span(TraceContextTextMapPropagator().extract(carrier))
    assert parse_traceparent(header, state) == expected.get_span_context()


@pytest.mark.parametrize("state", ["", "vendor=value"])
def test_injected_metadata_is_what_the_w3c_propagators_write(state: str) -> None:
    context = SpanContext(
        int(CALLER_TRACE, 16),
        int(CALLER_SPAN, 16),
        False,
        TraceFlags(TraceFlags.SAMPLED),
        TraceState.from_header([state]) if state else None,
    )
    with use_span(NonRecordingSpan(context)):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        assert inject_context() == list(carrier.items())


def test_injected_metadata_carries_baggage_too() -> None:
    span = NonRecordingSpan(parse_traceparent(f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
    token = otel_context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with use_span(span):
            entries = dict(inject_context())
    finally:
        otel_context.detach(token)
    assert entries["baggage"] == "tenant=acme"
    assert entries["traceparent"] == f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


class OtherHeader(TextMapPropagator):
    """A propagator that reads the trace from a header of its own."""

    def extract(
        self, carrier: Any, context: Context | None = None, getter: Any = default_getter
    ) -> Context:
        (value,) = getter.get(carrier, "x-other-trace") or ("",)
        return set_span_in_context(NonRecordingSpan(parse_traceparent(value)), context)

    def inject(self, carrier: Any, context: Context | None = None, setter: Any = None) -> None:
        pass

    @property
    def fields(self) -> set[str]:
        return {"x-other-trace"}


@pytest.mark.usefixtures("unexported")
def test_unexported_span_continues_a_trace_the_configured_propagator_reads() -> None:
    configured = propagate.get_global_textmap()
    propagate.set_global_textmap(OtherHeader())
    try:
        span = start_server_span(
            "Classify", [("x-other-trace", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")], ATTRIBUTES
        )
    finally:
        propagate.set_global_textmap(configured)
    assert format(span.get_span_context().trace_id, "032x") == CALLER_TRACE


@pytest.mark.parametrize("header", [*HEADERS, None])
@pytest.mark.parametrize(
    "others",
    [
        (),
        (("tracestate", "vendor=value"),),
        (("baggage", "tenant=acme"), ("tracestate", "vendor=value")),
        (("x-request-id", "r-1"), ("grpc-trace-bin", b"\x00\x01")),
    ],
)
def test_extracted_context_is_what_the_configured_propagators_extract(
    header: str | None, others: tuple[tuple[str, str | bytes], ...]
) -> None:
    metadata = (*([] if header is None else [("traceparent", header)]), *others)
    carrier = {key: value for key, value in metadata if isinstance(value, str)}
    expected = propagate.extract(carrier)

    extracted = extract_context(metadata)

    context = get_current_span(extracted).get_span_context()
    assert context == get_current_span(expected).get_span_context()
    assert baggage.get_all(extracted) == baggage.get_all(expected)
    assert extracted.keys() == expected.keys()

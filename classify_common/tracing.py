"""OpenTelemetry wiring shared by both servers: one trace per request across the wire.

W3C `traceparent` is read from incoming gRPC metadata and written to outgoing
metadata, so the orchestrator's span and the capability server's span belong
to one trace. Spans are exported over OTLP gRPC (Jaeger's port 4317, say)
when an endpoint is configured: batched on a background thread through a
bounded queue, so a slow or unreachable collector costs the request path
nothing; spans beyond the queue, or in a batch the collector did not take,
are dropped and counted (`classify_trace_spans_dropped_total`). Without an
endpoint (or test processor), nothing reads a span, so none is recorded: a call's
server span is then a non-recording span that only carries real IDs (the
caller's trace, or a new one), which responses, trailers, logs and the next hop
report. Its sampled flag is the decision the sampler would have made, so a
downstream process that does export samples the same traces.

Sampling is parent-based with a ratio for new traces (or as OTEL_TRACES_SAMPLER
says), but the server's faults and time-outs are always kept (a refused call is
no fault: classify_common.nodes.marks_error): spans of unsampled traces are
still recorded and held per trace until the process's part of the trace ends;
a fault or a `timeout` mark exports everything held for that trace, and the
rest is discarded.
"""

from __future__ import annotations

import logging
import os
import random
import re
from collections.abc import Mapping, Sequence

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import AlwaysRecordSampler, ParentBased, TraceIdRatioBased
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    TraceFlags,
    TraceState,
)
from opentelemetry.util.types import AttributeValue

from classify_common import otel_environment
from classify_common.span_export import SERVER_FAULT_NAMES, KeepingBatchExport

log = logging.getLogger(__name__)

TRACER_NAME = "classify"


def configure_tracing(
    service: str,
    otlp_endpoint: str | None = None,
    sample_ratio: float | None = None,
    processor: SpanProcessor | None = None,
    environ: Mapping[str, str] = os.environ,
) -> TracerProvider:
    """Install the process's tracer provider (once; later calls get the first).

    `sample_ratio` applies to traces that start here; a trace arriving with a
    sampling decision keeps it (parent-based), so one request is sampled, or
    not, across both layers; errors and time-outs are exported either way.
    `processor` receives spans besides (or instead of) the OTLP exporter.
    Without either, only the server spans are made (their IDs are the trace
    IDs that answers report); lifecycle nodes are then timed but not spanned.

    The SDK's environment variables apply where an argument is None (see
    otel_environment): the OTLP endpoint, headers and TLS, the sampler, the batch
    settings; OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the service
    instead of `service`. Raises SettingsError for a variable it cannot use.
    """
    global _exporting, _new_traces, _follows_caller
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    otel_environment.check_otlp_protocol(environ)
    otel_environment.check_plaintext_endpoint(environ, otlp_endpoint)
    sampling = otel_environment.trace_sampling(environ, sample_ratio)
    limits = otel_environment.export_limits(environ)
    new_traces = TraceIdRatioBased(sampling.ratio)
    provider = TracerProvider(
        resource=process_resource(service),
        # Unsampled spans are recorded too (not exported), so an error or time-out
        # in an unsampled trace can still be kept.
        sampler=AlwaysRecordSampler(
            ParentBased(new_traces) if sampling.parent_based else new_traces
        ),
    )
    exporting = bool(otlp_endpoint) or otel_environment.export_endpoint_is_set(environ)
    if exporting:
        # NOTE: endpoint and insecure left None make the exporter read the variables
        # (an http:// endpoint is plaintext); headers are always read from them.
        # The exporter's own timeout variable, when set, wins over the batch's.
        timeout = otel_environment.exporter_timeout_seconds(environ) or limits.timeout_seconds
        exporter = OTLPSpanExporter(
            endpoint=otlp_endpoint or None,
            insecure=True if otlp_endpoint else None,
            timeout=timeout,
        )
        provider.add_span_processor(KeepingBatchExport(exporter, limits=limits))
    if processor is not None:
        provider.add_span_processor(processor)
    _exporting = exporting or processor is not None
    _new_traces = new_traces
    _follows_caller = sampling.parent_based
    trace.set_tracer_provider(provider)
    return provider


def process_resource(service: str) -> Resource:
    """The process's resource: `service` as service.name unless OTEL_SERVICE_NAME or
    OTEL_RESOURCE_ATTRIBUTES names one.

    NOTE: Resource.create reads both variables from os.environ itself, so this does too.
    """
    named = os.environ.get(otel_environment.SERVICE_NAME_VARIABLE, "").strip() or any(
        item.partition("=")[0].strip() == "service.name"
        for item in os.environ.get(otel_environment.RESOURCE_ATTRIBUTES_VARIABLE, "").split(",")
    )
    return Resource.create({} if named else {"service.name": service})


_exporting = False
# Decides whether a trace that starts here is sampled (see configure_tracing), and
# whether a caller's decision wins over it (parent-based).
_new_traces = TraceIdRatioBased(1.0)
_follows_caller = True


def spans_are_exported() -> bool:
    """Whether this process's spans go anywhere (see configure_tracing)."""
    return _exporting


def exemplar_for(
    trace_id: str, span: trace.Span, code: str, *, timed_out: bool = False
) -> dict[str, str] | None:
    """The exemplar labels that link a latency to its trace, or None where the trace
    will not be found: spans go nowhere, or its trace was not sampled and the call
    (ended with `code`, a status code's name) was neither a server fault nor timed out
    (`timed_out`: answered PROCESSING, or with its result kept), whose held spans are
    exported all the same (classify_common.span_export). A dashboard's exemplar must
    open a trace."""
    if not trace_id or not _exporting:
        return None
    if span.get_span_context().trace_flags.sampled or code in SERVER_FAULT_NAMES or timed_out:
        return {"trace_id": trace_id}
    return None


# A proxy until a provider is installed, then the provider's tracer; made once,
# because trace.get_tracer builds a new object on every call.
_tracer = trace.get_tracer(TRACER_NAME)


def get_tracer() -> trace.Tracer:
    return _tracer


def start_server_span(
    name: str,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    attributes: Mapping[str, AttributeValue],
) -> trace.Span:
    """The server span of one call, continuing the trace in the caller's `traceparent`.

    NOTE: a recording span is made only while spans are exported: the SDK's costs
    about 10 µs to start and end, once per call, and nothing would read it. Else
    the span is non-recording and only carries its IDs (see the module docstring).
    """
    if _exporting:
        parent = extract_context(metadata)
        return _tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    caller = _caller_span_context(metadata or ())
    if caller.is_valid:
        trace_id, state = caller.trace_id, caller.trace_state
    else:
        trace_id, state = _random_id(128), None
    if caller.is_valid and _follows_caller:
        sampled = caller.trace_flags.sampled
    else:
        sampled = trace_id & _new_traces.TRACE_ID_LIMIT < _new_traces.bound
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return NonRecordingSpan(SpanContext(trace_id, _random_id(64), False, flags, state))


def _caller_span_context(metadata: Sequence[tuple[str, str | bytes]]) -> SpanContext:
    """The span context the caller's metadata carries (invalid when none)."""
    w3c = _w3c_headers(metadata)
    if w3c is None:
        return trace.get_current_span(extract_context(metadata)).get_span_context()
    return w3c


def _w3c_headers(metadata: Sequence[tuple[str, str | bytes]]) -> SpanContext | None:
    """The span context in the metadata's W3C headers, read directly; None when the
    configured propagator would read more than that (another format, or baggage)."""
    if not _propagates_w3c_only():
        return None
    traceparent = tracestate = None
    for key, value in metadata:
        if key == TRACEPARENT_HEADER:
            traceparent = value
        elif key == TRACESTATE_HEADER:
            tracestate = value
        elif key == BAGGAGE_HEADER:
            return None
    if not isinstance(traceparent, str):
        return trace.INVALID_SPAN_CONTEXT
    return parse_traceparent(traceparent, tracestate if isinstance(tracestate, str) else None)


TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
BAGGAGE_HEADER = "baggage"
# W3C Trace Context, as opentelemetry's TraceContextTextMapPropagator reads it.
_TRACEPARENT = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)
_TRACEPARENT_MAX_CHARS = 512
_TRACESTATE_MAX_CHARS = 8192
_W3C_FIELDS = frozenset({TRACEPARENT_HEADER, TRACESTATE_HEADER, BAGGAGE_HEADER})


def parse_traceparent(traceparent: str, tracestate: str | None = None) -> SpanContext:
    """The remote span context a `traceparent` (and `tracestate`) header names, read as
    opentelemetry's W3C propagator reads it; INVALID_SPAN_CONTEXT when it names none.

    NOTE: several times cheaper than `propagate.extract`, which builds a carrier and
    a Context, and runs every configured propagator, once per call.
    """
    if len(traceparent) > _TRACEPARENT_MAX_CHARS:
        return trace.INVALID_SPAN_CONTEXT
    match = _TRACEPARENT.search(traceparent)
    if match is None:
        return trace.INVALID_SPAN_CONTEXT
    version, trace_id, span_id, flags, rest = match.groups()
    if trace_id == "0" * 32 or span_id == "0" * 16 or version == "ff" or (version == "00" and rest):
        return trace.INVALID_SPAN_CONTEXT
    state = None
    if tracestate is not None and len(tracestate) <= _TRACESTATE_MAX_CHARS:
        state = TraceState.from_header([tracestate])
    return SpanContext(int(trace_id, 16), int(span_id, 16), True, TraceFlags(int(flags, 16)), state)


# The global propagator last checked, and whether it reads and writes only the W3C
# headers (the default: tracecontext and baggage), so parse_traceparent reads as it does.
_checked_propagator: tuple[object, bool] = (None, False)


def _propagates_w3c_only() -> bool:
    global _checked_propagator
    propagator = propagate.get_global_textmap()
    checked, w3c_only = _checked_propagator
    if propagator is not checked:
        fields = propagator.fields
        w3c_only = TRACEPARENT_HEADER in fields and fields <= _W3C_FIELDS
        _checked_propagator = (propagator, w3c_only)
    return w3c_only


def _random_id(bits: int) -> int:
    """A trace (128 bits) or span (64 bits) ID as the SDK makes them: random, never 0."""
    while True:
        value = random.getrandbits(bits)
        if value:
            return value


def extract_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> Context:
    """The context the configured propagator reads from `metadata`: what
    `propagate.extract` returns, read directly when only W3C headers matter."""
    w3c = _w3c_headers(metadata or ())
    if w3c is not None:
        if not w3c.is_valid:
            return Context()
        return trace.set_span_in_context(NonRecordingSpan(w3c), Context())
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    return propagate.extract(carrier)


def inject_context() -> list[tuple[str, str]]:
    """Metadata entries (`traceparent`, …) that carry the current span to the next hop."""
    context = otel_context.get_current()
    if not _propagates_w3c_only() or baggage.get_all(context):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return list(carrier.items())
    # What the W3C propagators write for a span and no baggage, without their carrier.
    span_context = trace.get_current_span(context).get_span_context()
    if span_context == trace.INVALID_SPAN_CONTEXT:
        return []
    entries = [
        (
            TRACEPARENT_HEADER,
            f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}"
            f"-{span_context.trace_flags:02x}",
        )
    ]
    if span_context.trace_state:
        entries.append((TRACESTATE_HEADER, span_context.trace_state.to_header()))
    return entries


def format_trace_id(span: trace.Span) -> str:
    span_context = span.get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else ""

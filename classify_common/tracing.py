"""OpenTelemetry wiring shared by both servers: one trace per request across the wire.

W3C `traceparent` is read from incoming gRPC metadata and written to outgoing
metadata, so the orchestrator's span and the capability server's span belong
to one trace. Exporting spans (OTLP) is configured by the servers; with no
exporter, spans still get real IDs, which responses and trailers report.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

TRACER_NAME = "classify"


def configure_tracing(service: str) -> None:
    """Install an SDK tracer provider once per process; later calls keep the first."""
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    trace.set_tracer_provider(TracerProvider(resource=Resource.create({"service.name": service})))


def get_tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    return propagate.extract(carrier)


def inject_context() -> list[tuple[str, str]]:
    """Metadata entries (`traceparent`, …) that carry the current span to the next hop."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def format_trace_id(span: trace.Span) -> str:
    span_context = span.get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else ""

"""OpenTelemetry wiring shared by both servers: one trace per request across the wire.

W3C `traceparent` is read from incoming gRPC metadata and written to outgoing
metadata, so the orchestrator's span and the capability server's span belong
to one trace. Spans are exported over OTLP gRPC (Jaeger's port 4317, say)
when an endpoint is configured: batched on a background thread through a
bounded queue, so a slow or unreachable collector costs the request path
nothing; spans beyond the queue are dropped. Without an endpoint, spans still
get real IDs, which responses and trailers report.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

TRACER_NAME = "classify"


# Spans waiting for export before new ones are dropped; how often and how long
# the exporter thread sends them.
EXPORT_QUEUE_SIZE = 4096
EXPORT_DELAY_MILLIS = 1000
EXPORT_TIMEOUT_SECONDS = 5.0


def configure_tracing(
    service: str, otlp_endpoint: str | None = None, sample_ratio: float = 1.0
) -> TracerProvider:
    """Install the process's tracer provider (once; later calls get the first).

    `sample_ratio` applies to traces that start here; a trace arriving with a
    sampling decision keeps it (parent-based), so one request is sampled, or
    not, across both layers.
    """
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    if otlp_endpoint:
        exporter = OTLPSpanExporter(
            endpoint=otlp_endpoint, insecure=True, timeout=EXPORT_TIMEOUT_SECONDS
        )
        provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=EXPORT_QUEUE_SIZE,
                schedule_delay_millis=EXPORT_DELAY_MILLIS,
                export_timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000,
            )
        )
    trace.set_tracer_provider(provider)
    return provider


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

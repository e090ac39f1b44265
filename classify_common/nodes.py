"""The request lifecycle: 17 named nodes, one span each, defined once.

A request's trace is the same shape every time, so an operator reads a slow
one at a glance. Each node is a child span of the request's server span in the
process that runs it; `upstream_call` is the client span the capability
server's spans hang under, which joins both processes into one trace. Nodes
6-15 repeat per attempt (a retry or a fallback is a new attempt); the others
occur once per request. Every node's duration also lands in the
`classify_node_duration_seconds{lifecycle_node}` histogram, sampled or not.

Spans of work that is shared or measured elsewhere (a batch on the device
thread, CUDA-event timings) are emitted after the fact with their real start
and end times, parented to the request's server span.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from classify_common.errors import ServiceError, grpc_code_for
from classify_common.tracing import get_tracer, spans_are_exported

# Set on every span of a request whose time budget ran out before its answer.
TIMEOUT_ATTRIBUTE = "timeout"


@dataclass(frozen=True)
class Node:
    number: int
    name: str
    service: str  # the process that records it: orchestrator or capability
    measures: str
    attributes: tuple[str, ...]


NODES: tuple[Node, ...] = (
    Node(1, "grpc_receive", "orchestrator", "parsing the request message and its metadata",
         ("net.peer.address", "rpc.method", "user_agent.original", "classify.request_bytes")),
    Node(2, "auth_validate", "orchestrator", "checking the API key",
         ("classify.tenant", "classify.outcome")),
    Node(3, "rate_limit_check", "orchestrator", "taking a token from the tenant's bucket",
         ("classify.tenant", "classify.tokens_left")),
    Node(4, "input_validate", "orchestrator", "protovalidate rules on the request",
         ("classify.violations",)),
    Node(5, "route_match", "orchestrator", "choosing the route in routes.yaml",
         ("classify.route", "classify.rules_version")),
    Node(6, "backend_select", "orchestrator", "picking a replica of the attempt's backend",
         ("classify.backend", "classify.replica", "classify.model", "classify.model_version")),
    Node(7, "upstream_call", "orchestrator", "the call to the capability server, wire included",
         ("classify.attempt", "classify.backend", "classify.retry_reason",
          "classify.fallback_reason", "rpc.grpc.status_code")),
    Node(8, "capability_receive", "capability",
         "parsing, internal-token check and validation on the capability server",
         ("net.peer.address", "classify.request_bytes", "classify.violations")),
    Node(9, "tokenize", "capability", "turning the text into token IDs",
         ("classify.tokens", "classify.truncated")),
    Node(10, "queue_admit", "capability", "admission to the worker's bounded queue",
         ("classify.worker", "classify.queue_depth", "classify.predicted_wait_ms",
          "classify.outcome")),
    Node(11, "gpu_queue_wait", "capability",
         "waiting in the queue until the request's batch starts on the device",
         ("classify.worker",)),
    Node(12, "batch_assemble", "capability",
         "padding the batch into tensors; linked to the batch's shared span",
         ("classify.batch_size", "classify.bucket", "classify.padding_ratio")),
    Node(13, "h2d_copy", "capability", "copying the inputs to the device", ("classify.clock",)),
    Node(14, "cuda_launch", "capability", "the forward, encoder and head, on the device",
         ("classify.clock", "classify.model", "classify.model_version")),
    Node(15, "postprocess", "capability", "copying the scores back to the host",
         ("classify.clock",)),
    Node(16, "output_serialize", "orchestrator", "serialising the response message",
         ("classify.response_bytes",)),
    Node(17, "response_send", "orchestrator",
         "handing the answer to gRPC until the call completes", ("rpc.grpc.status_code",)),
)  # fmt: skip
NODE_NAMES: tuple[str, ...] = tuple(node.name for node in NODES)
# The span every request of a batch links to (from its batch_assemble node).
BATCH_SPAN_NAME = "batch"


@dataclass(eq=False)
class RequestTrace:
    """What one request's nodes share in one process: the server span they hang
    under, the node histogram, and the fields and timings of its log line."""

    server_span: trace.Span
    # Records one node's seconds in the process's node histogram.
    observe_node: Callable[[str, float], None] | None = None
    timed_out: bool = False
    # Seconds per node, summed over attempts: the log line's time breakdown.
    seconds: dict[str, float] = field(default_factory=dict)
    # Extra fields for the request's log line (route, model, attempts, ...).
    log_fields: dict[str, object] = field(default_factory=dict)
    # False for an internal batch call: its items are the requests, each with a trace
    # of its own that counts its nodes, so the call's own nodes stay out of the
    # histogram (they still time the call's log line).
    observes_own_nodes: bool = True

    def __post_init__(self) -> None:
        # Node spans cost tens of microseconds each: they are made only when
        # someone receives them. Timings, histograms and log fields always are.
        self.makes_spans = spans_are_exported() and self.server_span.is_recording()
        # Built once: every node of the request is a child of the server span.
        self.parent_context = trace.set_span_in_context(self.server_span)

    def record(self, node: str, seconds: float) -> None:
        self.seconds[node] = self.seconds.get(node, 0.0) + seconds
        if self.observe_node is not None and self.observes_own_nodes:
            self.observe_node(node, seconds)

    def mark_timed_out(self) -> None:
        self.timed_out = True
        self.server_span.set_attribute(TIMEOUT_ATTRIBUTE, True)


_current: ContextVar[RequestTrace | None] = ContextVar("classify_request_trace", default=None)


def bind_trace(request_trace: RequestTrace) -> None:
    _current.set(request_trace)


def current_trace() -> RequestTrace | None:
    return _current.get()


def mark_error(span: trace.Span, error: BaseException) -> None:
    """Error status on `span`, with the gRPC code a ServiceError maps to."""
    span.set_status(Status(StatusCode.ERROR, str(error)))
    if isinstance(error, ServiceError):
        span.set_attribute("rpc.grpc.status_code", grpc_code_for(error).value[0])
        span.set_attribute("classify.error_reason", error.reason)


def node(
    name: str,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    current: bool = False,
) -> AbstractContextManager[trace.Span]:
    """Run the body as lifecycle node `name`: a child span of the server span, timed
    and recorded. `current`: make it the current span for the body (so an outgoing
    call carries it). A ServiceError leaving the body marks the span with error
    status and its code. Outside a request, or when no spans are made, the body gets
    a non-recording span whose calls do nothing.
    """
    request_trace = _current.get()
    if request_trace is None or not request_trace.makes_spans:
        return _TimedNode(request_trace, name)
    return _spanned_node(request_trace, name, attributes, kind, current)


class _TimedNode:
    """A node without a span: only its time is recorded. A plain class, because a
    generator-based context manager costs several times more, on every node of
    every request."""

    __slots__ = ("_name", "_request_trace", "_started")

    def __init__(self, request_trace: RequestTrace | None, name: str) -> None:
        self._request_trace = request_trace
        self._name = name
        self._started = 0.0

    def __enter__(self) -> trace.Span:
        self._started = time.perf_counter()
        return trace.INVALID_SPAN

    def __exit__(self, *exc_info: object) -> None:
        if self._request_trace is not None:
            self._request_trace.record(self._name, time.perf_counter() - self._started)


@contextmanager
def _spanned_node(
    request_trace: RequestTrace,
    name: str,
    attributes: Mapping[str, AttributeValue] | None,
    kind: SpanKind,
    current: bool,
) -> Iterator[trace.Span]:
    span = get_tracer().start_span(
        name, context=request_trace.parent_context, kind=kind, attributes=attributes
    )
    started = time.perf_counter()
    try:
        if current:
            with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                yield span
        else:
            yield span
    except BaseException as error:
        mark_error(span, error)
        raise
    finally:
        request_trace.record(name, time.perf_counter() - started)
        if request_trace.timed_out:
            span.set_attribute(TIMEOUT_ATTRIBUTE, True)
        span.end()


def emit_node(
    request_trace: RequestTrace,
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, AttributeValue] | None = None,
    links: Sequence[Link] = (),
    error: BaseException | None = None,
) -> None:
    """Record node `name` after the fact, with its measured start and end (epoch ns)."""
    request_trace.record(name, max(end_ns - start_ns, 0) / 1e9)
    if not request_trace.makes_spans:
        return
    span = get_tracer().start_span(
        name,
        context=request_trace.parent_context,
        attributes=attributes,
        links=links,
        start_time=start_ns,
    )
    if error is not None:
        mark_error(span, error)
    if request_trace.timed_out:
        span.set_attribute(TIMEOUT_ATTRIBUTE, True)
    span.end(end_time=max(end_ns, start_ns))

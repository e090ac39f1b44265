"""The request lifecycle: 17 named nodes, one span each, defined once.

A request's trace is the same shape every time, so an operator reads a slow
one at a glance. Each node is a child span of the request's server span in the
process that runs it. Under each `upstream_call` node is the attempt's client
span, named after the method it calls as OpenTelemetry's RPC conventions name
client spans; the capability server's spans hang under it, which joins both
processes into one trace. Nodes
6-15 repeat per attempt (a retry or a fallback is a new attempt); the others
occur once per request. Every node's duration also lands in the
`classify_node_duration_seconds{lifecycle_node}` histogram, sampled or not.

Spans of work that is shared or measured elsewhere (a batch on the device
thread, CUDA-event timings) are emitted after the fact with their real start
and end times, parented to the request's server span.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

# Re-exported (`as`): emit sites import every key from here.
from opentelemetry.semconv._incubating.attributes.rpc_attributes import (
    RPC_METHOD as RPC_METHOD,
)
from opentelemetry.semconv._incubating.attributes.rpc_attributes import (
    RPC_RESPONSE_STATUS_CODE as RPC_RESPONSE_STATUS_CODE,
)
from opentelemetry.semconv._incubating.attributes.rpc_attributes import (
    RPC_SYSTEM_NAME as RPC_SYSTEM_NAME,
)
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE as ERROR_TYPE
from opentelemetry.semconv.attributes.network_attributes import (
    NETWORK_PEER_ADDRESS as NETWORK_PEER_ADDRESS,
)
from opentelemetry.semconv.attributes.network_attributes import (
    NETWORK_PEER_PORT as NETWORK_PEER_PORT,
)
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS as SERVER_ADDRESS
from opentelemetry.semconv.attributes.server_attributes import SERVER_PORT as SERVER_PORT
from opentelemetry.semconv.attributes.user_agent_attributes import (
    USER_AGENT_ORIGINAL as USER_AGENT_ORIGINAL,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from classify_common.errors import (
    SERVER_FAULT_CODES,
    DeadlineExpired,
    ServiceError,
    grpc_code_for,
)
from classify_common.tracing import get_tracer, spans_are_exported

# Span attribute keys: OpenTelemetry's semantic conventions (RPC, server, network,
# error), taken from the pinned opentelemetry-semantic-conventions so that a rename
# there shows up here (tests/unit/test_semantic_conventions.py refuses deprecated
# keys), then the project's own under `classify.`. Each node's row in NODES lists the
# keys it emits (tests/unit/test_node_attributes.py checks). Values: `rpc.method` is
# the full method name without the leading slash, `rpc.response.status_code` the
# status code's name ("OK", "UNAVAILABLE"), `error.type` that name or, for a bug,
# the exception's class.
RPC_SYSTEM_GRPC = "grpc"
# The contract's calls as client spans and `rpc.method` name them.
CLASSIFY_METHOD_NAME = "ai.classify.v1.ClassifyService/Classify"
CLASSIFY_BATCH_METHOD_NAME = "ai.classify.v1.ClassifyService/ClassifyBatch"
CLASSIFY_REQUEST_ID = "classify.request_id"
CLASSIFY_REQUEST_BYTES = "classify.request_bytes"
CLASSIFY_RESPONSE_BYTES = "classify.response_bytes"
CLASSIFY_BATCH_INDEX = "classify.batch_index"  # an item's place in its ClassifyBatch
CLASSIFY_TENANT = "classify.tenant"
CLASSIFY_OUTCOME = "classify.outcome"
CLASSIFY_TOKENS_LEFT = "classify.tokens_left"
CLASSIFY_VIOLATIONS = "classify.violations"
CLASSIFY_VIOLATION_FIELDS = "classify.violation_fields"
CLASSIFY_ROUTE = "classify.route"
CLASSIFY_RULES_VERSION = "classify.rules_version"
CLASSIFY_BACKEND = "classify.backend"
CLASSIFY_REPLICA = "classify.replica"
CLASSIFY_MODEL = "classify.model"
CLASSIFY_MODEL_VERSION = "classify.model_version"
CLASSIFY_ATTEMPT = "classify.attempt"
CLASSIFY_RETRY_REASON = "classify.retry_reason"
CLASSIFY_FALLBACK_REASON = "classify.fallback_reason"
# On an `upstream_call` node: whether the attempt went on the wire. False: it was
# refused (its classify.error_reason says why) or ran out of time before it was sent,
# and has no client span: the capability never saw it.
CLASSIFY_SENT = "classify.sent"
# On an `upstream_call` node: milliseconds the request waited in its replica's
# coalescer (orchestrator.upstream.coalescer) before its call left, or before it was
# answered there unsent.
CLASSIFY_GATHER_MS = "classify.gather_ms"
CLASSIFY_TOKENS = "classify.tokens"
CLASSIFY_TRUNCATED = "classify.truncated"
CLASSIFY_WORKER = "classify.worker"
CLASSIFY_QUEUE_DEPTH = "classify.queue_depth"
CLASSIFY_PREDICTED_WAIT_MS = "classify.predicted_wait_ms"
CLASSIFY_BATCH_SIZE = "classify.batch_size"
CLASSIFY_BUCKET = "classify.bucket"
CLASSIFY_PADDING_RATIO = "classify.padding_ratio"
CLASSIFY_CLOCK = "classify.clock"
CLASSIFY_ERROR_REASON = "classify.error_reason"
# "hit": answered from the capability's result cache; the device nodes that follow
# are skipped (CLASSIFY_SKIPPED).
CLASSIFY_CACHE = "classify.cache"
# On a node the request did not run, why: SKIPPED_CACHE_HIT (a cache hit's device
# nodes, zero-length spans so its trace keeps all 17 nodes).
CLASSIFY_SKIPPED = "classify.skipped"
SKIPPED_CACHE_HIT = "cache_hit"
# Set on every span of a request whose time budget ran out before its answer.
TIMEOUT_ATTRIBUTE = "timeout"
# The message a request's task is cancelled with when its answer is due before it has
# one: a ClassifyBatch item its call's deadline cut off (orchestrator.batch_items). It
# is answered DEADLINE_EXCEEDED, and its spans and latency say so (cancelled_code); a
# cancel without it is a caller that went away, CANCELLED.
ANSWER_DUE = "classify: answer due"
# The message a call's task is cancelled with when the server's grace runs out
# (classify_common.interceptor.RequestLifecycleInterceptor.cut_off_calls): it is
# answered UNAVAILABLE (SERVER_DRAINING).
CUT_OFF = "classify: the server's grace is over"
# What mark_error records for a cancel with ANSWER_DUE; never raised.
_ANSWER_DUE_ERROR = DeadlineExpired("the answer was due before this request had one")
# Any node may carry these besides its own: a failed node's status code and error
# reason (mark_error), and the timeout mark.
ANY_NODE_ATTRIBUTES = (
    RPC_RESPONSE_STATUS_CODE,
    ERROR_TYPE,
    CLASSIFY_ERROR_REASON,
    TIMEOUT_ATTRIBUTE,
)
# What the client span of a call to a capability server carries (one per attempt,
# under its `upstream_call` node, named after the method it was sent with).
UPSTREAM_CLIENT_ATTRIBUTES = (
    RPC_SYSTEM_NAME,
    RPC_METHOD,
    SERVER_ADDRESS,
    SERVER_PORT,
    RPC_RESPONSE_STATUS_CODE,
)

# The lifecycle nodes' names, in request order.
GRPC_RECEIVE = "grpc_receive"
AUTH_VALIDATE = "auth_validate"
RATE_LIMIT_CHECK = "rate_limit_check"
INPUT_VALIDATE = "input_validate"
ROUTE_MATCH = "route_match"
BACKEND_SELECT = "backend_select"
UPSTREAM_CALL = "upstream_call"
CAPABILITY_RECEIVE = "capability_receive"
TOKENIZE = "tokenize"
QUEUE_ADMIT = "queue_admit"
GPU_QUEUE_WAIT = "gpu_queue_wait"
BATCH_ASSEMBLE = "batch_assemble"
H2D_COPY = "h2d_copy"
CUDA_LAUNCH = "cuda_launch"
POSTPROCESS = "postprocess"
OUTPUT_SERIALIZE = "output_serialize"
RESPONSE_SEND = "response_send"


@dataclass(frozen=True)
class Node:
    number: int
    name: str
    service: str  # the process that records it: orchestrator or capability
    measures: str
    attributes: tuple[str, ...]


NODES: tuple[Node, ...] = (
    Node(1, GRPC_RECEIVE, "orchestrator", "parsing the request message and its metadata",
         (NETWORK_PEER_ADDRESS, NETWORK_PEER_PORT, RPC_METHOD, USER_AGENT_ORIGINAL,
          CLASSIFY_REQUEST_BYTES, CLASSIFY_OUTCOME)),
    Node(2, AUTH_VALIDATE, "orchestrator", "checking the API key",
         (CLASSIFY_TENANT, CLASSIFY_OUTCOME)),
    Node(3, RATE_LIMIT_CHECK, "orchestrator", "taking a token from the tenant's bucket",
         (CLASSIFY_TENANT, CLASSIFY_TOKENS_LEFT)),
    Node(4, INPUT_VALIDATE, "orchestrator", "protovalidate rules on the request",
         (CLASSIFY_VIOLATIONS, CLASSIFY_VIOLATION_FIELDS)),
    Node(5, ROUTE_MATCH, "orchestrator", "choosing the route in routes.yaml",
         (CLASSIFY_ROUTE, CLASSIFY_RULES_VERSION)),
    Node(6, BACKEND_SELECT, "orchestrator", "picking a replica of the attempt's backend",
         (CLASSIFY_BACKEND, CLASSIFY_REPLICA, CLASSIFY_MODEL, CLASSIFY_MODEL_VERSION)),
    # Its child is the attempt's client span (UPSTREAM_CLIENT_ATTRIBUTES), from when
    # the call left for the replica: an attempt refused before it has none.
    Node(7, UPSTREAM_CALL, "orchestrator", "the call to the capability server, wire included",
         (CLASSIFY_ATTEMPT, CLASSIFY_BACKEND, CLASSIFY_RETRY_REASON,
          CLASSIFY_FALLBACK_REASON, CLASSIFY_SENT, CLASSIFY_GATHER_MS)),
    # An item of a ClassifyBatch has its own: its index, no peer, size or user agent.
    Node(8, CAPABILITY_RECEIVE, "capability",
         "parsing, internal-token check and validation on the capability server",
         (NETWORK_PEER_ADDRESS, NETWORK_PEER_PORT, RPC_METHOD, USER_AGENT_ORIGINAL,
          CLASSIFY_REQUEST_BYTES, CLASSIFY_BATCH_INDEX, CLASSIFY_VIOLATIONS,
          CLASSIFY_VIOLATION_FIELDS, CLASSIFY_OUTCOME)),
    Node(9, TOKENIZE, "capability", "turning the text into token IDs",
         (CLASSIFY_TOKENS, CLASSIFY_TRUNCATED)),
    Node(10, QUEUE_ADMIT, "capability", "admission to the worker's bounded queue",
         (CLASSIFY_WORKER, CLASSIFY_QUEUE_DEPTH, CLASSIFY_PREDICTED_WAIT_MS,
          CLASSIFY_OUTCOME, CLASSIFY_CACHE)),
    Node(11, GPU_QUEUE_WAIT, "capability",
         "waiting in the queue until the request's batch starts on the device",
         (CLASSIFY_WORKER, CLASSIFY_SKIPPED)),
    Node(12, BATCH_ASSEMBLE, "capability",
         "padding the batch into tensors; linked to the batch's shared span",
         (CLASSIFY_BATCH_SIZE, CLASSIFY_BUCKET, CLASSIFY_PADDING_RATIO, CLASSIFY_SKIPPED)),
    Node(13, H2D_COPY, "capability", "copying the inputs to the device",
         (CLASSIFY_CLOCK, CLASSIFY_SKIPPED)),
    Node(14, CUDA_LAUNCH, "capability", "the forward, encoder and head, on the device",
         (CLASSIFY_CLOCK, CLASSIFY_MODEL, CLASSIFY_MODEL_VERSION, CLASSIFY_SKIPPED)),
    Node(15, POSTPROCESS, "capability", "copying the scores back to the host",
         (CLASSIFY_CLOCK, CLASSIFY_SKIPPED)),
    Node(16, OUTPUT_SERIALIZE, "orchestrator", "serialising the response message",
         (CLASSIFY_RESPONSE_BYTES,)),
    Node(17, RESPONSE_SEND, "orchestrator",
         "handing the answer to gRPC until the call completes", (RPC_RESPONSE_STATUS_CODE,)),
)  # fmt: skip
NODE_NAMES: tuple[str, ...] = tuple(node.name for node in NODES)
# The nodes of a request's time on the device, in order: what a cache hit skips.
DEVICE_NODE_NAMES: tuple[str, ...] = (
    GPU_QUEUE_WAIT,
    BATCH_ASSEMBLE,
    H2D_COPY,
    CUDA_LAUNCH,
    POSTPROCESS,
)
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
    # Whether the request's outcome is counted (classify_requests_total) elsewhere than
    # where its call ends: a ClassifyBatch call's items count one each, and a call
    # answered PROCESSING counts when its work ends (classify_common.metrics).
    outcome_counted_elsewhere: bool = False
    # When the request's handler began (time.perf_counter): what the request latency
    # histogram times from, the front door's own steps (auth, rate limits, validation)
    # included. A ClassifyBatch item's is its call's.
    started: float = field(default_factory=time.perf_counter)

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
        # The log line says so too: with code OK, the call was answered PROCESSING.
        self.log_fields["timeout"] = True


_current: ContextVar[RequestTrace | None] = ContextVar("classify_request_trace", default=None)


def bind_trace(request_trace: RequestTrace) -> None:
    _current.set(request_trace)


def current_trace() -> RequestTrace | None:
    return _current.get()


def marks_error(error: BaseException, kind: SpanKind = SpanKind.INTERNAL) -> bool:
    """Whether `error` gives a span of `kind` error status, as OpenTelemetry's gRPC
    conventions say: a client span, any failure; a server or internal span, only the
    server's fault (SERVER_FAULT_CODES, or an exception that is no ServiceError, a
    bug), not a refused call nor a caller that went away."""
    if kind is SpanKind.CLIENT:
        return True
    if isinstance(error, ServiceError):
        return grpc_code_for(error) in SERVER_FAULT_CODES
    return not isinstance(error, asyncio.CancelledError)


def mark_error(span: trace.Span, error: BaseException, kind: SpanKind = SpanKind.INTERNAL) -> None:
    """The status code and reason an error maps to on `span`; error status and
    `error.type` when the error is a failure of the span's kind (marks_error). A
    request cancelled because its answer was due (ANSWER_DUE) is marked as the
    DEADLINE_EXCEEDED it was answered: a time-out, which keeps its trace."""
    if isinstance(error, asyncio.CancelledError) and error.args == (ANSWER_DUE,):
        error = _ANSWER_DUE_ERROR
    code = status_code_name(error, kind)
    if marks_error(error, kind):
        span.set_status(Status(StatusCode.ERROR, str(error)))
        span.set_attribute(ERROR_TYPE, code or _qualified_name(type(error)))
    if code is not None:
        span.set_attribute(RPC_RESPONSE_STATUS_CODE, code)
    if isinstance(error, ServiceError):
        span.set_attribute(CLASSIFY_ERROR_REASON, error.reason)


def status_code_name(error: BaseException, kind: SpanKind = SpanKind.INTERNAL) -> str | None:
    """The gRPC status code `error` stands for, by name; None for a bug. A client span
    reports the code its server answered (kept on the error as `upstream_code`)."""
    if isinstance(error, asyncio.CancelledError):
        return cancelled_code(error).name
    if not isinstance(error, ServiceError):
        return None
    upstream = error.context.get("upstream_code") if kind is SpanKind.CLIENT else None
    return upstream or grpc_code_for(error).name


def cancelled_code(error: asyncio.CancelledError) -> grpc.StatusCode:
    """What a request whose task was cancelled with `error` was answered: DEADLINE_EXCEEDED
    when its answer was due (ANSWER_DUE), UNAVAILABLE when the server cut it off at the
    end of its grace (CUT_OFF), else CANCELLED (its caller went away)."""
    if error.args == (ANSWER_DUE,):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if error.args == (CUT_OFF,):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.CANCELLED


def _qualified_name(cls: type) -> str:
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def peer_attributes(peer: str) -> dict[str, AttributeValue]:
    """`network.peer.*` from gRPC's peer string: "ipv4:10.0.0.7:5123",
    "ipv6:[::1]:5123", "unix:/run/classify.sock"."""
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return {NETWORK_PEER_ADDRESS: rest or peer}
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        return {NETWORK_PEER_ADDRESS: rest}
    return {NETWORK_PEER_ADDRESS: host.strip("[]"), NETWORK_PEER_PORT: int(port)}


def server_attributes(target: str) -> dict[str, AttributeValue]:
    """`server.address` and `server.port` of a "host:port" target ("[::1]:5000" too)."""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return {SERVER_ADDRESS: target}
    return {SERVER_ADDRESS: host.strip("[]"), SERVER_PORT: int(port)}


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


def client_call(method: str, target: str) -> AbstractContextManager[trace.Span]:
    """Run the body as the client span of one call to `target` ("host:port"): named
    after `method` (the full name, no leading slash), with `rpc.*` and `server.*`, a
    child of the current span and current for the body, so the call carries it and
    the server's spans hang under it. A non-recording span when no spans are made."""
    request_trace = _current.get()
    if request_trace is None or not request_trace.makes_spans:
        return _NO_CLIENT_SPAN
    return _client_span(method, target, request_trace)


_NO_CLIENT_SPAN = nullcontext(trace.INVALID_SPAN)


@contextmanager
def _client_span(method: str, target: str, request_trace: RequestTrace) -> Iterator[trace.Span]:
    attributes = {RPC_SYSTEM_NAME: RPC_SYSTEM_GRPC, RPC_METHOD: method, **server_attributes(target)}
    span = get_tracer().start_span(method, kind=SpanKind.CLIENT, attributes=attributes)
    with trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    ):
        try:
            yield span
        except BaseException as error:
            mark_error(span, error, SpanKind.CLIENT)
            raise
        finally:
            # Answered PROCESSING meanwhile, the call ends after its request's answer:
            # marked like the request's other spans that end late.
            if request_trace.timed_out:
                span.set_attribute(TIMEOUT_ATTRIBUTE, True)
        span.set_attribute(RPC_RESPONSE_STATUS_CODE, grpc.StatusCode.OK.name)


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
        mark_error(span, error, kind)
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


def emit_skipped_nodes(
    request_trace: RequestTrace, names: Sequence[str], at_ns: int, reason: str
) -> None:
    """Zero-length spans at `at_ns` (epoch ns) for nodes the request did not run, each
    with CLASSIFY_SKIPPED = `reason`, so its trace still has every node. They are
    neither observed in the node histogram nor timed in the log line: a zero there
    would read as a node that ran in no time. Nothing is done when no spans are made."""
    if not request_trace.makes_spans:
        return
    tracer = get_tracer()
    for name in names:
        span = tracer.start_span(
            name,
            context=request_trace.parent_context,
            attributes={CLASSIFY_SKIPPED: reason},
            start_time=at_ns,
        )
        if request_trace.timed_out:
            span.set_attribute(TIMEOUT_ATTRIBUTE, True)
        span.end(end_time=at_ns)

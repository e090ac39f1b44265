"""The request lifecycle every contract RPC goes through, as one server interceptor.

For each call to an `ai.classify.v1` method it
1. continues the caller's trace (W3C traceparent) in a server span, and binds
   the request ID (the request's own `request_id`, else `x-request-id`
   metadata, else a new one) and the trace ID to the request context,
2. parses the request itself, inside the receive node, so parse time is seen,
   and admits it through the server's admission (classify_common.admission:
   auth, rate limit and validation, as nodes of their own on the front door),
3. maps any ServiceError to its status (errors.status_for) with rich details,
   and any other exception (a bug) to INTERNAL: the client is told the request
   and trace IDs to quote, never the exception, and the log line with those
   IDs carries the traceback,
4. serialises the response itself (`output_serialize` on the front door), sends
   `x-request-id` and `x-trace-id` as trailing metadata on every outcome,
   counts the call, and writes one access-log line with its time breakdown;
   the server span (and `response_send`) end when gRPC reports the call done.
Handlers therefore only convert messages and call the domain layer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from classify_common.admission import Admission
from classify_common.context import (
    REQUEST_ID_HEADER,
    TRACE_ID_HEADER,
    RequestContext,
    bind_request,
    bind_time_left_on_arrival,
    is_valid_request_id,
    mark_repeated_credentials,
    new_request_id,
)
from classify_common.errors import (
    SERVER_FAULT_CODES,
    DeadlineExpired,
    FieldViolation,
    InternalError,
    InvalidRequest,
    MethodNotServed,
    ServerDraining,
    ServiceError,
    grpc_code_for,
    internal_error,
    status_for,
)
from classify_common.intake import (
    BATCH_METHODS,
    CLASSIFYING_METHODS,
    MAX_BATCH_ITEMS,
    BatchIntake,
    bind_batch_intake,
    texts_in_batch,
)
from classify_common.logs import log_event
from classify_common.metrics import RequestOutcomes, RpcMetrics
from classify_common.nodes import (
    CLASSIFY_ERROR_REASON,
    CLASSIFY_OUTCOME,
    CLASSIFY_REQUEST_BYTES,
    CLASSIFY_REQUEST_ID,
    CLASSIFY_RESPONSE_BYTES,
    CUT_OFF,
    ERROR_TYPE,
    OUTPUT_SERIALIZE,
    RESPONSE_SEND,
    RPC_METHOD,
    RPC_RESPONSE_STATUS_CODE,
    RPC_SYSTEM_GRPC,
    RPC_SYSTEM_NAME,
    TIMEOUT_ATTRIBUTE,
    USER_AGENT_ORIGINAL,
    RequestTrace,
    bind_trace,
    mark_error,
    node,
    peer_attributes,
)
from classify_common.tracing import (
    BAGGAGE_HEADER,
    exemplar_for,
    format_trace_id,
    get_tracer,
    start_server_span,
)
from classify_common.utf8 import read_with_bad_strings
from classify_common.validation import items_of

CONTRACT_METHOD_PREFIX = "/ai.classify.v1."
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# A request message larger than this is read (parsed) only once its caller's
# credentials would pass; a smaller one first, as any call's, so that a refusal carries
# the request_id it names (parsing 64 KiB takes at most a few milliseconds).
READ_UNIDENTIFIED_BYTES = 64 * 1024
# The receive node's `classify.outcome` for a request left unread.
OUTCOME_NOT_READ = "not_read"
# The method (span name, `rpc.method`, metrics label) of a call to a method this
# server does not have, as OpenTelemetry's conventions name a method outside the
# known set; the log line names the method asked for, up to this many characters.
UNKNOWN_METHOD = "_OTHER"
MAX_METHOD_NAME_SHOWN = 200
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
_UNKNOWN_METHOD_ATTRIBUTES = {RPC_SYSTEM_NAME: RPC_SYSTEM_GRPC, RPC_METHOD: UNKNOWN_METHOD}

log = logging.getLogger(__name__)


def is_cut_off(cancelled: asyncio.CancelledError) -> bool:
    """Whether `cancelled` is the server cutting its call off at the end of a stop's
    grace, not the caller leaving. A handler that catches it, answers at once and
    uncancels its task is answered as it says (ClassifyBatch: the items done, and the
    others SERVER_DRAINING each); one that lets it through is answered SERVER_DRAINING.
    """
    return CUT_OFF in cancelled.args


UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]
RawBehavior = Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]


def bind_ids(metadata: Sequence[tuple[str, str | bytes]], trace_id: str) -> RequestContext:
    """Bind the call's IDs before its request is parsed: the `x-request-id` metadata,
    else a new request ID (see rebind_own_request_id)."""
    request_id = ""
    for key, value in metadata:
        if key == REQUEST_ID_HEADER and isinstance(value, str) and is_valid_request_id(value):
            request_id = value
            break
    ids = RequestContext(request_id or new_request_id(), trace_id)
    bind_request(ids)
    return ids


def rebind_own_request_id(request: object, ids: RequestContext) -> RequestContext:
    """The request's own `request_id`, when it has a valid one, wins over the metadata's."""
    own = getattr(request, "request_id", "")
    if own == ids.request_id or not isinstance(own, str) or not is_valid_request_id(own):
        return ids
    ids = RequestContext(own, ids.trace_id)
    bind_request(ids)
    return ids


class _DeadlinePassed(asyncio.CancelledError):
    """The call's deadline passed before its error status could be sent: the handler
    ends as a cancelled one does, sending nothing."""


def _deadline_passed(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    """Whether the call's deadline has passed. Its caller's own gRPC has answered it
    DEADLINE_EXCEEDED then: nothing sent reaches it, and sending fails in gRPC core,
    which grpc logs as an error with a traceback (40 of them in one `make
    bench-overload`, most for FRONT_DOOR_BUSY refusals of calls taken in with their
    last milliseconds)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


class RequestLifecycleInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        metrics: RpcMetrics,
        admission_for: Callable[[str], Admission],
        outcomes: RequestOutcomes | None = None,
    ) -> None:
        """`admission_for`: the server's admission of a contract method, asked once per
        method (classify_common.admission); `outcomes`: where the front door counts
        each request's outcome (None on a capability server)."""
        self._metrics = metrics
        self._outcomes = outcomes
        self._admission_for = admission_for
        # Looked up once: get_tracer builds a new tracer object on every call.
        self._tracer = get_tracer()
        # The wrapped handler of each contract method, built on its first call: a
        # server's handlers never change, and wrapping costs more than a lookup.
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        # The calls in their handlers now, and whether they are being cut off because
        # the server stops (cut_off_calls).
        self._in_handlers: set[asyncio.Task[Any]] = set()
        self._cutting_off = False

    def cut_off_calls(self) -> int:
        """Answer every call still in its handler SERVER_DRAINING, with its request and
        trace IDs, now: the server's grace is running out, and gRPC would otherwise
        cancel them itself, answering UNAVAILABLE "Cancelling all calls" with neither.
        A handler may answer instead (see is_cut_off). Returns how many calls it cut off."""
        self._cutting_off = True
        for task in self._in_handlers:
            task.cancel(CUT_OFF)
        return len(self._in_handlers)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None:
            return grpc.stream_stream_rpc_method_handler(
                functools.partial(self._refuse_unknown_method, method)
            )
        if (
            handler.unary_unary is None
            or handler.request_deserializer is None
            or handler.response_serializer is None
            or not method.startswith(CONTRACT_METHOD_PREFIX)
        ):
            return handler
        # Bytes in and out: the lifecycle parses and serialises, so both are timed nodes.
        wrapped = grpc.unary_unary_rpc_method_handler(
            # On a grpc.aio server every behavior is a coroutine function.
            self._wrap(
                method,
                cast(UnaryBehavior, handler.unary_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        )
        self._wrapped[method] = wrapped
        return wrapped

    def _wrap(
        self,
        method: str,
        behavior: UnaryBehavior,
        parse: Callable[[bytes], Any],
        serialize: Callable[[Any], bytes],
    ) -> RawBehavior:
        span_name = method.lstrip("/")
        span_attributes = {RPC_SYSTEM_NAME: RPC_SYSTEM_GRPC, RPC_METHOD: span_name}
        # Chosen once per method, so a call asks nothing about its server or method.
        admission = self._admission_for(method)
        admit, times_output = admission.admit, admission.times_output
        drops_baggage = admission.drops_caller_baggage
        observe_node, counts_nodes = self._metrics.observe_node, admission.counts_own_nodes
        encode = _timed_serializer(serialize) if times_output else serialize

        in_handlers = self._in_handlers
        outcomes = self._outcomes if method in CLASSIFYING_METHODS else None
        is_batch = method in BATCH_METHODS

        async def run_lifecycle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            started = time.perf_counter()
            metadata = tuple(context.invocation_metadata() or ())
            if drops_baggage:
                metadata = tuple(entry for entry in metadata if entry[0] != BAGGAGE_HEADER)
            headers = {key.lower(): v for key, v in metadata if isinstance(v, str)}
            if len(headers) < len(metadata):  # a key repeated (or a binary value)
                mark_repeated_credentials(metadata, headers)
            server_span = start_server_span(span_name, metadata, span_attributes)
            request_trace = RequestTrace(
                server_span, observe_node, observes_own_nodes=counts_nodes, started=started
            )
            bind_trace(request_trace)
            # Current for the whole call, so every node and outgoing call is its child.
            attached = otel_context.attach(request_trace.parent_context)
            ids = bind_ids(metadata, format_trace_id(server_span))
            time_left = context.time_remaining()
            bind_time_left_on_arrival(time_left)
            code = grpc.StatusCode.OK
            reason = ""
            request: Any = None
            this_call = asyncio.current_task()
            if this_call is not None:
                in_handlers.add(this_call)
            try:
                try:
                    request = _receive(
                        method, raw, parse, context, headers, request_trace, admission
                    )
                except _Undecodable as undecodable:
                    await admission.refuse_undecodable(headers, undecodable.error)
                ids = rebind_own_request_id(request, ids)
                server_span.set_attribute(CLASSIFY_REQUEST_ID, ids.request_id)
                if admit is not None:
                    await admit(headers, request)
                response = await behavior(request, context)
                payload = encode(response)
                if _deadline_passed(context):
                    raise DeadlineExpired("the answer was ready after the deadline; not sent")
            except ServiceError as error:
                code, reason = grpc_code_for(error), error.reason
                try:
                    await self._abort(context, server_span, error, ids, request_trace)
                except _DeadlinePassed:
                    code = grpc.StatusCode.DEADLINE_EXCEEDED  # what the caller saw
                    raise
            except asyncio.CancelledError:
                if not self._cutting_off:  # the client went away
                    code = grpc.StatusCode.CANCELLED
                    raise
                if this_call is not None:
                    this_call.uncancel()  # answered, not cancelled: later awaits run as usual
                cut_off = ServerDraining("the server stopped before this call was answered")
                code, reason = grpc_code_for(cut_off), cut_off.reason
                await self._abort(context, server_span, cut_off, ids, request_trace)
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                code, reason = grpc.StatusCode.INTERNAL, InternalError.reason
                await self._answer_bug(method, context, server_span, ids, request_trace)
            finally:
                in_handlers.discard(this_call)
                elapsed = time.perf_counter() - started
                exemplar = exemplar_for(
                    ids.trace_id, server_span, code.name, timed_out=request_trace.timed_out
                )
                self._metrics.observe(method, code.name, elapsed, exemplar)
                if outcomes is not None and not request_trace.outcome_counted_elsewhere:
                    # A call refused whole, before its items were served, is a refusal
                    # of every text it carried; but a caller that names no key says
                    # nothing we count on (its items are anyone's to multiply).
                    requests = (
                        texts_in_batch(request)
                        if is_batch and request is not None and code != _UNAUTHENTICATED
                        else 1
                    )
                    route = str(request_trace.log_fields.get("route", ""))
                    outcomes.count(route, code.name, reason, requests)
                self._log_request(method, code, elapsed, time_left, request_trace)
                if times_output or request_trace.makes_spans:
                    self._end_when_done(context, server_span, code, request_trace, times_output)
                otel_context.detach(attached)
            # After what the servicer set (a capability server's load report).
            context.set_trailing_metadata(
                (*(context.trailing_metadata() or ()), *_id_trailers(ids))
            )
            return payload

        return run_lifecycle

    async def _refuse_unknown_method(
        self,
        method: str,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """UNIMPLEMENTED for a method no service on this server has, as gRPC would
        answer, but with the call's request and trace IDs and its access-log line
        (gRPC's own answer had neither: a client built from a newer contract, or
        pointed at the wrong address, had nothing to quote). A stream handler answers
        any kind of call, and reads none of its messages."""
        started = time.perf_counter()
        metadata = tuple(context.invocation_metadata() or ())
        span = start_server_span(UNKNOWN_METHOD, metadata, _UNKNOWN_METHOD_ATTRIBUTES)
        request_trace = RequestTrace(span, self._metrics.observe_node, observes_own_nodes=False)
        ids = bind_ids(metadata, format_trace_id(span))
        shown = (
            method if len(method) <= MAX_METHOD_NAME_SHOWN else f"{method[:MAX_METHOD_NAME_SHOWN]}…"
        )
        refused = MethodNotServed(
            f"this server has no method {shown!r}: see the services its reflection lists"
        )
        code = grpc_code_for(refused)
        try:
            await self._abort(context, span, refused, ids, request_trace)
        except _DeadlinePassed:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            raise
        finally:
            # Under one name: the caller chooses the method's, which as a label would
            # let anyone grow the metrics' series without bound.
            elapsed = time.perf_counter() - started
            self._metrics.observe(UNKNOWN_METHOD, code.name, elapsed)
            request_trace.log_fields["requested_method"] = shown
            self._log_request(UNKNOWN_METHOD, code, elapsed, None, request_trace)
            self._end_when_done(context, span, code, request_trace, times_send=False)

    async def _answer_bug(
        self,
        method: str,
        context: grpc.aio.ServicerContext[Any, Any],
        server_span: trace.Span,
        ids: RequestContext,
        request_trace: RequestTrace,
    ) -> None:
        """INTERNAL for an exception that is no ServiceError (a bug): the log line, with
        the traceback, is the one place the cause is told."""
        self._metrics.internal_errors.inc()
        log.exception("unhandled error", extra={"method": method})
        await self._abort(context, server_span, _internal_error(ids), ids, request_trace)

    def _end_when_done(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        server_span: trace.Span,
        code: grpc.StatusCode,
        request_trace: RequestTrace,
        times_send: bool,
    ) -> None:
        """End the server span (and, with `times_send`, time `response_send`) once gRPC
        has sent the answer and the call is over. Only needed then or when spans are
        made: the callback costs a closure and a call per request."""
        send_started = time.perf_counter()
        send_span = (
            self._tracer.start_span(RESPONSE_SEND, context=request_trace.parent_context)
            if times_send and request_trace.makes_spans
            else None
        )
        code_name = code.name

        def finish(_: grpc.aio.ServicerContext[Any, Any]) -> None:
            if times_send:
                request_trace.record(RESPONSE_SEND, time.perf_counter() - send_started)
            if send_span is not None:
                send_span.set_attribute(RPC_RESPONSE_STATUS_CODE, code_name)
                if request_trace.timed_out:
                    send_span.set_attribute(TIMEOUT_ATTRIBUTE, True)
                send_span.end()
            server_span.set_attribute(RPC_RESPONSE_STATUS_CODE, code_name)
            server_span.end()

        # The stubs declare the callback as a nominal class no function can be.
        context.add_done_callback(finish)  # type: ignore[arg-type]

    def _log_request(
        self,
        method: str,
        code: grpc.StatusCode,
        elapsed: float,
        time_left: float | None,
        request_trace: RequestTrace,
    ) -> None:
        fields: dict[str, object] = {
            "method": method,
            "code": code.name,
            # round(x * 1e5) / 100 is round(x * 1000, 2) at a third of its cost.
            "duration_ms": round(elapsed * 1e5) / 100,
            **request_trace.log_fields,
            "timings_ms": {
                name: round(seconds * 1e6) / 1000 for name, seconds in request_trace.seconds.items()
            },
        }
        if time_left is not None:
            # What the caller's deadline left when the handler began. Well under the
            # caller's own timeout, the call waited before any of this server's code
            # ran: in gRPC's queue behind a busy event loop, or on the network.
            fields["time_left_on_arrival_ms"] = round(time_left * 1e4) / 10
        log_event(log, "rpc", fields)

    @staticmethod
    async def _abort(
        context: grpc.aio.ServicerContext[Any, Any],
        span: trace.Span,
        error: ServiceError,
        ids: RequestContext,
        request_trace: RequestTrace,
    ) -> None:
        trailers = _id_trailers(ids)
        # The IDs travel in the ErrorInfo too, for clients that only keep the status.
        error.context.update(dict(trailers))
        status = status_for(error)
        code = grpc_code_for(error)
        # A refused call is the caller's fault: no error status (as the conventions say).
        if code in SERVER_FAULT_CODES:
            span.set_status(Status(StatusCode.ERROR, error.message))
            span.set_attribute(ERROR_TYPE, code.name)
        span.set_attribute(CLASSIFY_ERROR_REASON, error.reason)
        request_trace.log_fields.update(reason=error.reason, error=error.message)
        if _deadline_passed(context):
            raise _DeadlinePassed
        await context.abort(
            code,
            error.message,
            # After what the servicer set: a capability's refusal carries its load report
            # as an answer does, so that the orchestrator hears of the load that refused.
            trailing_metadata=(
                *(context.trailing_metadata() or ()),
                *trailers,
                (STATUS_DETAILS_KEY, status.SerializeToString()),
            ),
        )


class _Undecodable(Exception):
    """The request's bytes are not a message of its method; `error` refuses it once
    the caller's credentials are checked (Admission.refuse_undecodable)."""

    def __init__(self, error: InvalidRequest) -> None:
        super().__init__(str(error))
        self.error = error


def _receive(
    method: str,
    raw: bytes,
    parse: Callable[[bytes], Any],
    context: grpc.aio.ServicerContext[Any, Any],
    headers: Mapping[str, str],
    request_trace: RequestTrace,
    admission: Admission,
) -> Any:
    """The parsed request, inside the receive node; admitted there on an internal server."""
    attributes: dict[str, AttributeValue] | None = (
        {
            RPC_METHOD: method.lstrip("/"),
            **peer_attributes(context.peer()),
            USER_AGENT_ORIGINAL: headers.get("user-agent", ""),
            CLASSIFY_REQUEST_BYTES: len(raw),
        }
        if request_trace.makes_spans
        else None
    )
    refused: InvalidRequest | None = None
    with node(admission.receive_node, attributes) as span:
        try:
            if len(raw) <= READ_UNIDENTIFIED_BYTES or admission.identifies(headers):
                request = parse(raw)
            else:
                # The caller's credentials will be refused: its message is not read (a
                # keyless ClassifyBatch of 8 MiB of empty items held the event loop
                # 0.4 s to parse, only to be refused). The gate's own step refuses it,
                # as any call, for the empty message that stands in for it.
                span.set_attribute(CLASSIFY_OUTCOME, OUTCOME_NOT_READ)
                request = parse(b"")
        except DecodeError:
            request, refused = _read_with_bad_strings(method, raw)
            if refused is not None:
                # Marked as the refusal it is; _Undecodable, raised in here, marked the
                # node as a bug (error status), whose trace is kept whatever the sampling.
                mark_error(span, refused)
        if refused is None:
            if admission.on_receive is not None:
                admission.on_receive(headers, request, span)
            return request
    assert refused is not None
    raise _Undecodable(refused)


def _read_with_bad_strings(method: str, raw: bytes) -> tuple[Any, InvalidRequest | None]:
    """A request that did not decode: the request with its broken items refused on
    their own (bound as the batch's intake), when only strings that are not UTF-8 broke
    it and each is in an item of a batch; else the refusal of the whole call, naming
    the strings when those broke it."""
    service, _, name = method.lstrip("/").rpartition("/")
    request_type = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
    request_class = message_factory.GetMessageClass(request_type.input_type)
    read = read_with_bad_strings(request_class, raw, most_elements=MAX_BATCH_ITEMS)
    if read is None:
        # NOTE: not the decoder's text, which names protobuf's internals.
        message = f"not a protobuf request message of {method.lstrip('/')}"
        return None, InvalidRequest([FieldViolation("", "wire_format", message)])
    request, bad = read
    by_item = items_of([string.violation() for string in bad]) if method in BATCH_METHODS else None
    if by_item is None:
        return None, InvalidRequest([string.violation() for string in bad])
    bind_batch_intake(BatchIntake(by_item))
    return request, None


def _timed_serializer(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """`serialize` as the `output_serialize` node."""

    def serialize_timed(response: Any) -> bytes:
        with node(OUTPUT_SERIALIZE) as span:
            payload = serialize(response)
            span.set_attribute(CLASSIFY_RESPONSE_BYTES, len(payload))
            return payload

    return serialize_timed


def _internal_error(ids: RequestContext) -> InternalError:
    return internal_error(ids.request_id, ids.trace_id)


def _id_trailers(ids: RequestContext) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_HEADER, ids.request_id), (TRACE_ID_HEADER, ids.trace_id))

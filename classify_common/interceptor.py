"""The request lifecycle every contract RPC goes through, as one server interceptor.

For each call to an `ai.classify.v1` method it
1. continues the caller's trace (W3C traceparent) in a server span, and binds
   the request ID (the request's own `request_id`, else `x-request-id`
   metadata, else a new one) and the trace ID to the request context,
2. parses the request itself, inside the receive node, so parse time is seen,
3. on the public front door (`edge`): authenticates and rate-limits through the
   server's gate, then validates against the contract's protovalidate rules,
   each as its own lifecycle node (classify_common.nodes); on an internal
   server the gate and validation run inside `capability_receive`. Either way
   an invalid or refused request reaches no handler, let alone a model,
4. maps any ServiceError to its status (errors.status_for) with rich details,
   and any other exception (a bug) to INTERNAL: the client is told the request
   and trace IDs to quote, never the exception, and the log line with those
   IDs carries the traceback,
5. serialises the response itself (`output_serialize` on the edge), sends
   `x-request-id` and `x-trace-id` as trailing metadata on every outcome,
   counts the call, and writes one access-log line with its time breakdown;
   the server span (and `response_send`) end when gRPC reports the call done.
Handlers therefore only convert messages and call the domain layer.

A batch call (`ClassifyBatch`) goes through the same steps once. Its items are
checked one by one: an item that breaks the item rules, or that the tenant's
rate limit (one token per item) does not cover, is refused on its own and
recorded for the handler (classify_common.intake); only the batch's own rules
and a refused caller fail the whole call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from classify_common.context import (
    REQUEST_ID_HEADER,
    TRACE_ID_HEADER,
    RequestContext,
    bind_request,
    is_valid_request_id,
    new_request_id,
)
from classify_common.errors import (
    FieldViolation,
    InternalError,
    InvalidRequest,
    ServiceError,
    grpc_code_for,
    internal_error,
    status_for,
)
from classify_common.intake import (
    BATCH_METHODS,
    NO_REFUSALS,
    BatchIntake,
    bind_batch_intake,
)
from classify_common.logs import log_event
from classify_common.metrics import RpcMetrics
from classify_common.nodes import RequestTrace, bind_trace, node
from classify_common.tracing import format_trace_id, get_tracer, start_server_span
from classify_common.validation import validate_batch, validate_request

CONTRACT_METHOD_PREFIX = "/ai.classify.v1."
STATUS_DETAILS_KEY = "grpc-status-details-bin"

log = logging.getLogger(__name__)

UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]
RawBehavior = Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]


@dataclass(frozen=True)
class RateAllowance:
    """What a tenant's rate limit granted to one call of `calls` items."""

    tokens_left: float | None  # None: the tenant is not limited
    granted: int  # the first `granted` items may go ahead
    refusal: ServiceError | None = None  # answers the items past `granted`


class Gate(Protocol):
    """Who may call, and how often; each method raises a ServiceError to refuse."""

    def authenticate(self, method: str, metadata: Mapping[str, str]) -> str:
        """The caller's tenant, from the request metadata (lower-case keys)."""
        ...

    def check_rate_limit(self, tenant: str, calls: int = 1) -> RateAllowance:
        """Take one token per call (a batch item is a call) from the tenant's allowance;
        raise when not even one is left."""
        ...


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


class RequestLifecycleInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: RpcMetrics, gate: Gate | None = None, *, edge: bool) -> None:
        """`edge`: this server is the public front door (the orchestrator), whose
        intake steps are separate lifecycle nodes; else an internal server."""
        self._metrics = metrics
        self._gate = gate
        self._edge = edge
        # Looked up once: get_tracer builds a new tracer object on every call.
        self._tracer = get_tracer()
        # The wrapped handler of each contract method, built on its first call: a
        # server's handlers never change, and wrapping costs more than a lookup.
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

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
        if (
            handler is None
            or handler.unary_unary is None
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
        span_attributes = {"rpc.system": "grpc", "rpc.method": method}
        # An internal batch call's items count its nodes, each in its own trace.
        counts_nodes = self._edge or method not in BATCH_METHODS

        async def run_lifecycle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            started = time.perf_counter()
            metadata = tuple(context.invocation_metadata() or ())
            headers = {key.lower(): v for key, v in metadata if isinstance(v, str)}
            server_span = start_server_span(span_name, metadata, span_attributes)
            request_trace = RequestTrace(
                server_span, self._metrics.observe_node, observes_own_nodes=counts_nodes
            )
            bind_trace(request_trace)
            # Current for the whole call, so every node and outgoing call is its child.
            attached = otel_context.attach(request_trace.parent_context)
            ids = bind_ids(metadata, format_trace_id(server_span))
            code = grpc.StatusCode.OK
            try:
                request = self._receive(method, raw, parse, context, headers, request_trace)
                ids = rebind_own_request_id(request, ids)
                server_span.set_attribute("classify.request_id", ids.request_id)
                if self._edge:
                    self._admit(method, headers, request)
                response = await behavior(request, context)
                payload = self._serialize(response, serialize)
            except ServiceError as error:
                code = grpc_code_for(error)
                await self._abort(context, server_span, error, ids, request_trace)
            except asyncio.CancelledError:  # the client went away
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                code = grpc.StatusCode.INTERNAL
                self._metrics.internal_errors.inc()
                log.exception("unhandled error", extra={"method": method})
                await self._abort(context, server_span, _internal_error(ids), ids, request_trace)
            finally:
                elapsed = time.perf_counter() - started
                self._metrics.observe(method, code.name, elapsed, ids.trace_id)
                self._log_request(method, code, elapsed, request_trace)
                if self._edge or request_trace.makes_spans:
                    self._end_when_done(context, server_span, code, request_trace)
                otel_context.detach(attached)
            # After what the servicer set (a capability server's load report).
            context.set_trailing_metadata(
                (*(context.trailing_metadata() or ()), *_id_trailers(ids))
            )
            return payload

        return run_lifecycle

    def _receive(
        self,
        method: str,
        raw: bytes,
        parse: Callable[[bytes], Any],
        context: grpc.aio.ServicerContext[Any, Any],
        headers: Mapping[str, str],
        request_trace: RequestTrace,
    ) -> Any:
        """The parsed request; on an internal server, also gated and validated."""
        attributes: dict[str, AttributeValue] | None = (
            {
                "rpc.method": method,
                "net.peer.address": context.peer(),
                "user_agent.original": headers.get("user-agent", ""),
                "classify.request_bytes": len(raw),
            }
            if request_trace.makes_spans
            else None
        )
        with node("grpc_receive" if self._edge else "capability_receive", attributes) as span:
            try:
                request = parse(raw)
            except DecodeError as exc:
                raise InvalidRequest(
                    [FieldViolation("", "wire_format", f"not a valid request message: {exc}")]
                ) from exc
            if not self._edge:
                if self._gate is not None:
                    tenant = self._gate.authenticate(method, headers)
                    self._gate.check_rate_limit(tenant, _calls_in(method, request))
                _validate(method, request, span)
            return request

    def _admit(self, method: str, headers: Mapping[str, str], request: Any) -> None:
        """The front door's intake nodes: who is calling, whether they may, and what."""
        tenant = ""
        with node("auth_validate") as span:
            if self._gate is None:
                span.set_attribute("classify.outcome", "not_configured")
            else:
                try:
                    tenant = self._gate.authenticate(method, headers)
                except ServiceError:
                    span.set_attribute("classify.outcome", "refused")
                    raise
                span.set_attributes({"classify.tenant": tenant, "classify.outcome": "ok"})
        calls = _calls_in(method, request)
        allowance = RateAllowance(None, calls)
        with node("rate_limit_check", {"classify.tenant": tenant}) as span:
            if self._gate is not None:
                allowance = self._gate.check_rate_limit(tenant, calls)
            if allowance.tokens_left is not None:
                span.set_attribute("classify.tokens_left", allowance.tokens_left)
        with node("input_validate") as span:
            intake = _validate(method, request, span)
        if allowance.refusal is not None:
            over_limit = dict.fromkeys(range(allowance.granted, calls), allowance.refusal)
            bind_batch_intake(BatchIntake({**over_limit, **intake.refused}))

    def _serialize(self, response: Any, serialize: Callable[[Any], bytes]) -> bytes:
        if not self._edge:
            return serialize(response)
        with node("output_serialize") as span:
            payload = serialize(response)
            span.set_attribute("classify.response_bytes", len(payload))
            return payload

    def _end_when_done(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        server_span: trace.Span,
        code: grpc.StatusCode,
        request_trace: RequestTrace,
    ) -> None:
        """End the server span (and, on the edge, time `response_send`) once gRPC has
        sent the answer and the call is over. Only needed on the edge or when spans
        are made: the callback costs a closure and a call per request."""
        send_started = time.perf_counter()
        send_span = (
            self._tracer.start_span("response_send", context=request_trace.parent_context)
            if self._edge and request_trace.makes_spans
            else None
        )
        code_value = code.value[0]

        def finish(_: grpc.aio.ServicerContext[Any, Any]) -> None:
            if self._edge:
                request_trace.record("response_send", time.perf_counter() - send_started)
            if send_span is not None:
                send_span.set_attribute("rpc.grpc.status_code", code_value)
                if request_trace.timed_out:
                    send_span.set_attribute("timeout", True)
                send_span.end()
            server_span.set_attribute("rpc.grpc.status_code", code_value)
            server_span.end()

        # The stubs declare the callback as a nominal class no function can be.
        context.add_done_callback(finish)  # type: ignore[arg-type]

    def _log_request(
        self, method: str, code: grpc.StatusCode, elapsed: float, request_trace: RequestTrace
    ) -> None:
        log_event(
            log,
            "rpc",
            {
                "method": method,
                "code": code.name,
                # round(x * 1e5) / 100 is round(x * 1000, 2) at a third of its cost.
                "duration_ms": round(elapsed * 1e5) / 100,
                **request_trace.log_fields,
                "timings_ms": {
                    name: round(seconds * 1e6) / 1000
                    for name, seconds in request_trace.seconds.items()
                },
            },
        )

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
        span.set_status(Status(StatusCode.ERROR, error.message))
        span.set_attribute("classify.error_reason", error.reason)
        request_trace.log_fields.update(reason=error.reason, error=error.message)
        await context.abort(
            grpc_code_for(error),
            error.message,
            trailing_metadata=(*trailers, (STATUS_DETAILS_KEY, status.SerializeToString())),
        )


def _internal_error(ids: RequestContext) -> InternalError:
    return internal_error(ids.request_id, ids.trace_id)


def _calls_in(method: str, request: Any) -> int:
    """How many calls a request counts as: one per item for a batch."""
    return len(request.items) if method in BATCH_METHODS else 1


def _validate(method: str, request: Any, span: trace.Span) -> BatchIntake:
    """Check the request against the contract. A batch's broken items are bound as
    its intake (and returned); anything else that is broken raises InvalidRequest."""
    try:
        if method not in BATCH_METHODS:
            validate_request(request)
            span.set_attribute("classify.violations", 0)
            return NO_REFUSALS
        intake = BatchIntake(validate_batch(request))
    except InvalidRequest as error:
        span.set_attributes(
            {
                "classify.violations": len(error.violations),
                "classify.violation_fields": [v.field for v in error.violations],
            }
        )
        raise
    bind_batch_intake(intake)
    refused = cast(Mapping[int, InvalidRequest], intake.refused)
    violations = [v for error in refused.values() for v in error.violations]
    span.set_attribute("classify.violations", len(violations))
    if violations:
        span.set_attribute("classify.violation_fields", [v.field for v in violations])
    return intake


def _id_trailers(ids: RequestContext) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_HEADER, ids.request_id), (TRACE_ID_HEADER, ids.trace_id))

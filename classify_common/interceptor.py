"""The request lifecycle every contract RPC goes through, as one server interceptor.

For each call to an `ai.classify.v1` method it
1. continues the caller's trace (W3C traceparent) in a server span,
2. binds the request ID (the request's own `request_id`, else `x-request-id`
   metadata, else a new one) and the trace ID to the request context,
2b. runs the server's gate (authentication, rate limits), if it has one, so a
   refused caller reaches no handler,
3. validates the request against the contract's protovalidate rules, so an
   invalid request never reaches a handler, let alone a model,
4. maps any ServiceError to its status (errors.status_for) with rich details,
   and any other exception to INTERNAL,
5. sends `x-request-id` and `x-trace-id` as trailing metadata, on every
   outcome, counts the call and writes one access-log line for it.
Handlers therefore only convert messages and call the domain layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from classify_common.context import (
    REQUEST_ID_HEADER,
    TRACE_ID_HEADER,
    RequestContext,
    bind_request,
    is_valid_request_id,
    new_request_id,
)
from classify_common.errors import InternalError, ServiceError, grpc_code_for, status_for
from classify_common.metrics import RpcMetrics
from classify_common.tracing import extract_context, format_trace_id, get_tracer
from classify_common.validation import validate_request

CONTRACT_METHOD_PREFIX = "/ai.classify.v1."
STATUS_DETAILS_KEY = "grpc-status-details-bin"

log = logging.getLogger(__name__)

UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]
# Called with the full method name and the request metadata (lower-case keys);
# raises a ServiceError to refuse the call.
Gate = Callable[[str, Mapping[str, str]], None]


def choose_request_id(request: object, metadata: Sequence[tuple[str, str | bytes]]) -> str:
    own = getattr(request, "request_id", "")
    if isinstance(own, str) and is_valid_request_id(own):
        return own
    for key, value in metadata:
        if key == REQUEST_ID_HEADER and isinstance(value, str) and is_valid_request_id(value):
            return value
    return new_request_id()


class RequestLifecycleInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: RpcMetrics, gate: Gate | None = None) -> None:
        self._metrics = metrics
        self._gate = gate
        # Looked up once: get_tracer builds a new tracer object on every call.
        self._tracer = get_tracer()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if (
            handler is None
            or handler.unary_unary is None
            or not method.startswith(CONTRACT_METHOD_PREFIX)
        ):
            return handler
        return grpc.unary_unary_rpc_method_handler(
            # On a grpc.aio server every behavior is a coroutine function.
            self._wrap(method, cast(UnaryBehavior, handler.unary_unary)),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        async def run_lifecycle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            started = time.perf_counter()
            metadata = tuple(context.invocation_metadata() or ())
            code = grpc.StatusCode.OK
            with self._tracer.start_as_current_span(
                method.lstrip("/"),
                context=extract_context(metadata),
                kind=SpanKind.SERVER,
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                ids = RequestContext(choose_request_id(request, metadata), format_trace_id(span))
                bind_request(ids)
                trailers = ((REQUEST_ID_HEADER, ids.request_id), (TRACE_ID_HEADER, ids.trace_id))
                try:
                    if self._gate is not None:
                        self._gate(
                            method,
                            {k.lower(): v for k, v in metadata if isinstance(v, str)},
                        )
                    validate_request(request)
                    response = await behavior(request, context)
                except ServiceError as error:
                    code = grpc_code_for(error)
                    await self._abort(context, span, error, trailers)
                except Exception as exc:
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    code = grpc.StatusCode.INTERNAL
                    log.exception("unhandled error in %s", method)
                    internal = InternalError(f"internal error ({type(exc).__name__})")
                    await self._abort(context, span, internal, trailers)
                finally:
                    elapsed = time.perf_counter() - started
                    self._metrics.observe(method, code.name, elapsed, ids.trace_id)
                    log.info(
                        "rpc",
                        extra={
                            "method": method,
                            "code": code.name,
                            "duration_ms": round(elapsed * 1000, 2),
                        },
                    )
                context.set_trailing_metadata(trailers)
                return response

        return run_lifecycle

    @staticmethod
    async def _abort(
        context: grpc.aio.ServicerContext[Any, Any],
        span: trace.Span,
        error: ServiceError,
        trailers: tuple[tuple[str, str], ...],
    ) -> None:
        # The IDs travel in the ErrorInfo too, for clients that only keep the status.
        error.context.update(dict(trailers))
        status = status_for(error)
        code = grpc_code_for(error)
        span.set_status(Status(StatusCode.ERROR, error.message))
        span.set_attribute("rpc.grpc.status_code", status.code)
        log.info("request failed", extra={"reason": error.reason, "error": error.message})
        await context.abort(
            code,
            error.message,
            trailing_metadata=(*trailers, (STATUS_DETAILS_KEY, status.SerializeToString())),
        )

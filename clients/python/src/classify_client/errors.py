"""The errors a call can end with: the server's taxonomy, as the client sees it.

    ClassifyError                 base: code, reason, request and trace IDs
    ├── ClientError               the request is wrong; never retried
    │   ├── InvalidRequest        INVALID_ARGUMENT, with one FieldViolation per broken rule
    │   ├── Unauthenticated       UNAUTHENTICATED: no, unknown or wrong API key
    │   ├── PermissionDenied      PERMISSION_DENIED: the key's role may not do this
    │   ├── MessageTooLarge       RESOURCE_EXHAUSTED from gRPC itself: a message over its limit
    │   └── NotFound              NOT_FOUND
    │       ├── ModelNotFound
    │       └── ResultNotFound    GetResult: unknown or expired request ID
    ├── MethodNotServed           UNIMPLEMENTED: the wrong layer (e.g. GetResult on a model server)
    ├── Unavailable               UNAVAILABLE: retried; the server or its model could not answer
    │   └── ModelError            ... the server says why (ErrorInfo)
    │       ├── ModelNotReady
    │       ├── ModelUnavailable
    │       ├── ModelFault
    │       ├── ModelNotServed    a replica lacks its route's model: the deployment is wrong
    │       └── ServerDraining
    ├── Overloaded                RESOURCE_EXHAUSTED: retried after `retry_after_seconds`
    │   ├── RateLimited           the tenant's rate is used up
    │   ├── QueueFull
    │   ├── ConcurrencyLimited
    │   ├── FrontDoorBusy
    │   └── DeviceMemoryPressure
    ├── DeadlineExpired           DEADLINE_EXCEEDED
    │   ├── DeadlineUnreachable   refused before any work: the deadline cannot be met
    │   ├── ExpiredInQueue        evicted unseen when its deadline passed
    │   └── StillProcessing       the deadline passed while the work goes on; fetch it later
    ├── ReloadRefused             FAILED_PRECONDITION: the old model keeps serving
    ├── UnscorableText            INTERNAL: the model cannot score this text; not retried
    └── InternalError             INTERNAL (and any code the service does not use): a bug

The server names the outcome in a google.rpc.ErrorInfo `reason`, which picks the
class (`ERROR_BY_REASON`); a status without one (a connection that failed before
any server answered, say) gets its code's class (`ERROR_BY_CODE`). An error that
ended a call after retries carries `attempts` and the earlier attempts'
errors (`attempt_errors`). Every error
carries the request and trace IDs from the call's `x-request-id` and
`x-trace-id` trailers (or, for a batch item, its ErrorInfo), so a failure can be
found in the server's logs and traces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc
from google.protobuf.any_pb2 import Any
from google.rpc import error_details_pb2, status_pb2

REQUEST_ID_HEADER = "x-request-id"
TRACE_ID_HEADER = "x-trace-id"
# ErrorInfo metadata: the trace a stored result's work ran in (a GetResult of a result
# that failed), and a deadline that passed while the work goes on, its result kept.
RESULT_TRACE_ID = "result_trace_id"
RESULT_KEPT = "result_kept"
# The trailer in which gRPC servers send the google.rpc.Status with its details.
STATUS_DETAILS_TRAILER = "grpc-status-details-bin"
# gRPC's own refusal of a message over its size limit, sent or received ("Received
# message larger than max (9000041 vs. 8388608)"): it carries no reason.
GRPC_SIZE_LIMIT = re.compile(r"\b(?:Sent|Received) message larger than max\b")


@dataclass(frozen=True)
class FieldViolation:
    """One broken validation rule: the field path, the rule id and the message."""

    field: str
    rule: str
    description: str


class ClassifyError(Exception):
    """Base of every error a call can end with."""

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        reason: str = "",
        request_id: str = "",
        trace_id: str = "",
        metadata: Mapping[str, str] | None = None,
        retry_after_seconds: float | None = None,
        violations: Iterable[FieldViolation] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        # The server's ErrorInfo reason (e.g. RATE_LIMITED); empty when it sent none.
        self.reason = reason
        self.request_id = request_id
        self.trace_id = trace_id
        # The ErrorInfo metadata (e.g. the tenant of a RateLimited).
        self.metadata = dict(metadata or {})
        # The server's RetryInfo delay, where it sent one.
        self.retry_after_seconds = retry_after_seconds
        self.violations = tuple(violations)
        # Attempts the call made, the first included, and the errors of the earlier
        # ones that failed (oldest first); set when retries ran out (retry.Attempts).
        self.attempts = 1
        self.attempt_errors: tuple[ClassifyError, ...] = ()

    def __str__(self) -> str:
        return (
            f"{self.code.name}: {self.message} "
            f"(request {self.request_id or '-'}, trace {self.trace_id or '-'})"
        )


class ClientError(ClassifyError):
    """The request itself is wrong; retrying it unchanged cannot help."""


class InvalidRequest(ClientError):
    """The request broke validation rules; `violations` names each field and rule."""


class Unauthenticated(ClientError):
    """The call carries no API key, or one the server does not accept."""


class MessageTooLarge(ClientError):
    """gRPC refused a message over its size limit (RESOURCE_EXHAUSTED "... message
    larger than max", before any service code ran): send a smaller one. Not an
    Overloaded, whose contract, retry after a while, would loop forever here."""


class PermissionDenied(ClientError):
    """The key is valid but its role may not make this call."""


class NotFound(ClientError):
    """The named thing does not exist on the server."""


class ModelNotFound(NotFound):
    """No model of that name is served."""


class ResultNotFound(NotFound):
    """GetResult: no result is kept under that request ID (never sent, or expired)."""


class MethodNotServed(ClassifyError):
    """This server does not serve that RPC (e.g. GetResult sent to a capability server)."""


class Unavailable(ClassifyError):
    """The service could not answer now (UNAVAILABLE); a retry may succeed."""


class ModelError(Unavailable):
    """The server reached no model that could answer."""


class ModelNotReady(ModelError):
    """The model is loading or warming up."""


class ModelUnavailable(ModelError):
    """The server could not reach the model's capability server."""


class ModelFault(ModelError):
    """The model produced no usable answer."""


class ModelNotServed(ModelError):
    """A replica behind the front door does not serve the model its route names: the
    service's deployment is wrong, not the request."""


class ServerDraining(ModelError):
    """The server is shutting down; another replica can answer."""


class Overloaded(ClassifyError):
    """Too much work (RESOURCE_EXHAUSTED); retry after `retry_after_seconds`."""


class RateLimited(Overloaded):
    """The caller's tenant has used its rate for now."""


class QueueFull(Overloaded):
    """The model's bounded queue had no room; the request was not queued."""


class ConcurrencyLimited(Overloaded):
    """The backend had as many calls in flight as its limit allows."""


class FrontDoorBusy(Overloaded):
    """Calls were reaching the orchestrator with their deadlines spent; it refused new
    ones until it caught up."""


class DeviceMemoryPressure(Overloaded):
    """The model's device memory was past its admission threshold."""


class DeadlineExpired(ClassifyError):
    """The deadline passed before an answer was ready (DEADLINE_EXCEEDED)."""


class DeadlineUnreachable(DeadlineExpired):
    """Refused before any work: the time left was less than the predicted service time."""


class ExpiredInQueue(DeadlineExpired):
    """The request's deadline passed while it was queued; it was never computed."""


class StillProcessing(DeadlineExpired):
    """The deadline passed while the work went on (wait=True polled until it, or the
    server said so); the server keeps the result for a while, so
    `get_result(request_id)` can fetch it later."""


class ReloadRefused(ClassifyError):
    """A model reload failed its checks; the previous version keeps serving."""


class UnscorableText(ClassifyError):
    """The model gave no usable scores for this text while it scores others: sending
    it again fails alike, so it is not retried."""


class InternalError(ClassifyError):
    """The server hit a bug (INTERNAL, or a code the service does not use)."""


# The server's ErrorInfo reasons (classify_common/errors.py), each to its class.
ERROR_BY_REASON: Mapping[str, type[ClassifyError]] = {
    "INVALID_REQUEST": InvalidRequest,
    "CLIENT_ERROR": ClientError,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
    "NOT_FOUND": NotFound,
    "MODEL_NOT_FOUND": ModelNotFound,
    "RESULT_NOT_FOUND": ResultNotFound,
    "METHOD_NOT_SERVED": MethodNotServed,
    "MODEL_ERROR": ModelError,
    "MODEL_NOT_READY": ModelNotReady,
    "MODEL_UNAVAILABLE": ModelUnavailable,
    "MODEL_FAULT": ModelFault,
    "MODEL_NOT_SERVED": ModelNotServed,
    "SERVER_DRAINING": ServerDraining,
    "OVERLOADED": Overloaded,
    "RATE_LIMITED": RateLimited,
    "QUEUE_FULL": QueueFull,
    "CONCURRENCY_LIMITED": ConcurrencyLimited,
    "FRONT_DOOR_BUSY": FrontDoorBusy,
    "DEVICE_MEMORY_PRESSURE": DeviceMemoryPressure,
    "DEADLINE_EXPIRED": DeadlineExpired,
    "DEADLINE_UNREACHABLE": DeadlineUnreachable,
    "EXPIRED_IN_QUEUE": ExpiredInQueue,
    "RELOAD_REFUSED": ReloadRefused,
    "UNSCORABLE_TEXT": UnscorableText,
    "INTERNAL": InternalError,
}

# A status without a known reason: its code's class (the docs' error table).
ERROR_BY_CODE: Mapping[grpc.StatusCode, type[ClassifyError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNIMPLEMENTED: MethodNotServed,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExpired,
    grpc.StatusCode.FAILED_PRECONDITION: ReloadRefused,
}

_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def code_from_number(number: int) -> grpc.StatusCode:
    return _CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_from_status(
    status: status_pb2.Status, trailers: Mapping[str, str] | None = None
) -> ClassifyError:
    """The typed error for a google.rpc.Status: a failed call's (with its trailers)
    or a ClassifyBatch item's (whose ErrorInfo carries its IDs)."""
    code = code_from_number(status.code)
    info = error_details_pb2.ErrorInfo()
    retry_after: float | None = None
    violations: list[FieldViolation] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry_after = _retry_delay_seconds(detail)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            violations += _field_violations(detail)
    cls = ERROR_BY_REASON.get(info.reason) or ERROR_BY_CODE.get(code, InternalError)
    if cls is Overloaded and not info.reason and GRPC_SIZE_LIMIT.search(status.message):
        cls = MessageTooLarge
    if cls is DeadlineExpired and info.metadata.get(RESULT_KEPT) == "true":
        cls = StillProcessing  # get_result(request_id) fetches it later
    trailers = trailers or {}
    return cls(
        status.message,
        code=code,
        reason=info.reason,
        request_id=trailers.get(REQUEST_ID_HEADER) or info.metadata.get(REQUEST_ID_HEADER, ""),
        trace_id=trailers.get(TRACE_ID_HEADER) or info.metadata.get(TRACE_ID_HEADER, ""),
        metadata={
            k: v for k, v in info.metadata.items() if k not in (REQUEST_ID_HEADER, TRACE_ID_HEADER)
        },
        retry_after_seconds=retry_after,
        violations=violations,
    )


def error_from_rpc(error: grpc.RpcError, request_id: str = "") -> ClassifyError:
    """The typed error for a failed call (sync or asyncio), from its status details
    trailer, or from its code and message where the server sent none. `request_id` is
    the ID the call was sent under: the error carries it when no answer named one (the
    deadline passed first, or no server was reached), so it can still be looked up."""
    call: grpc.Call = error  # type: ignore[assignment]
    trailers: dict[str, str] = {}
    status: status_pb2.Status | None = None
    for key, value in call.trailing_metadata() or ():
        if key == STATUS_DETAILS_TRAILER and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
        elif isinstance(value, str):
            trailers[key] = value
    code = call.code()
    if status is None or status.code != code.value[0]:
        # No details, or details that do not belong to this code (gRPC's own
        # failures, such as a deadline passing on the client, have neither).
        status = status_pb2.Status(code=code.value[0], message=call.details() or "")
    typed = error_from_status(status, trailers)
    typed.request_id = typed.request_id or request_id
    return typed


def _retry_delay_seconds(detail: Any) -> float:
    retry = error_details_pb2.RetryInfo()
    detail.Unpack(retry)
    return float(retry.retry_delay.ToNanoseconds()) / 1e9


def _field_violations(detail: Any) -> list[FieldViolation]:
    bad_request = error_details_pb2.BadRequest()
    detail.Unpack(bad_request)
    return [
        FieldViolation(field=v.field, rule=v.reason, description=v.description)
        for v in bad_request.field_violations
    ]

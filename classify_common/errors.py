"""The one error taxonomy of both layers, and the one table that maps it to gRPC.

    ServiceError
    ├── ClientError               the request is wrong; never retried
    │   ├── InvalidRequest        INVALID_ARGUMENT, one FieldViolation per broken rule
    │   │   └── UnreadableText    the model's vocabulary knows no token of the text
    │   ├── Unauthenticated       UNAUTHENTICATED: no, unknown or wrong credentials
    │   ├── PermissionDenied      PERMISSION_DENIED: the caller's role may not do this
    │   └── NotFound              NOT_FOUND
    │       ├── ModelNotFound
    │       └── ResultNotFound
    ├── MethodNotServed           UNIMPLEMENTED: ask the other layer
    ├── ModelError                the model could not answer; eligible for fallback
    │   ├── ModelNotReady         UNAVAILABLE: loading or warming up
    │   ├── ModelUnavailable      UNAVAILABLE: the capability server is unreachable
    │   ├── ModelFault            UNAVAILABLE: NaN output, failed batch, crashed worker
    │   ├── ModelNotServed        UNAVAILABLE: a backend's replica lacks its model
    │   └── ServerDraining        UNAVAILABLE: shutting down, try another replica
    ├── StateUnavailable          UNAVAILABLE: the shared state store (Redis) failed; RetryInfo
    ├── Overloaded                RESOURCE_EXHAUSTED, with a retry-after hint
    │   ├── RateLimited           the tenant's token bucket is empty
    │   ├── QueueFull             the worker's bounded queue has no room
    │   ├── ConcurrencyLimited    the backend's adaptive concurrency limit is reached
    │   ├── FrontDoorBusy         calls reach the orchestrator with their deadlines spent
    │   └── DeviceMemoryPressure  device memory use is past its threshold
    ├── DeadlineExpired           DEADLINE_EXCEEDED
    │   ├── DeadlineUnreachable   refused at admission: predicted service > time left
    │   ├── ExpiredInQueue        evicted unseen by the model when its deadline passed
    │   └── BackendTimedOut       a backend's own timeout ran out, the caller's has not
    ├── ReloadRefused             FAILED_PRECONDITION: the old model keeps serving
    ├── UnscorableText            INTERNAL: the model scores others, not this text
    └── InternalError             INTERNAL: a bug

Each error knows its machine-readable `reason` (sent as google.rpc.ErrorInfo)
and the rich details that go with its status. Code that catches a lower-layer
exception re-raises one of these with `raise ... from exc`; the server
interceptor turns them into statuses (see `status_for`), so no handler picks a
status code itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Self

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "classify.ai"


@dataclass(frozen=True)
class FieldViolation:
    """One broken validation rule: where, which rule, and what is wrong."""

    field: str
    rule: str
    message: str


class ServiceError(Exception):
    """Base of every error a client may see."""

    reason = "SERVICE_ERROR"

    def __init__(self, message: str, **context: object) -> None:
        super().__init__(message)
        self.message = message
        # Sent to the client as ErrorInfo metadata; keep values short.
        self.context = {key: str(value) for key, value in context.items()}

    def with_context(self, **extra: object) -> Self:
        """A copy of this error (same class, message and details), `extra` added to its
        context, and without its traceback."""
        clone = self.__class__.__new__(self.__class__)
        clone.__dict__.update(self.__dict__)
        Exception.__init__(clone, *self.args)
        clone.context = {**self.context, **{key: str(value) for key, value in extra.items()}}
        return clone

    def details(self) -> list[Message]:
        """Rich status details (google.rpc.*) that go with this error."""
        return [
            error_details_pb2.ErrorInfo(
                reason=self.reason, domain=ERROR_DOMAIN, metadata=self.context
            )
        ]


class ClientError(ServiceError):
    """The request itself is wrong; retrying it unchanged cannot help."""

    reason = "CLIENT_ERROR"


class InvalidRequest(ClientError):
    """The request broke one or more validation rules."""

    reason = "INVALID_REQUEST"

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        # A rule of the whole message (a CEL rule on it) names no field.
        fields = ", ".join(f"{v.field}: {v.message}" if v.field else v.message for v in violations)
        super().__init__(f"invalid request: {fields}", violations=len(violations))
        self.violations = tuple(violations)

    def details(self) -> list[Message]:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field, reason=v.rule, description=v.message
                )
                for v in self.violations
            ]
        )
        return [*super().details(), bad_request]

    def within(self, field: str) -> Self:
        """This error with each violation's field path put under `field` (a batch's
        `items[3]`): a capability names the fields of the item it was sent."""
        moved = type(self)(
            [
                FieldViolation(f"{field}.{v.field}" if v.field else field, v.rule, v.message)
                for v in self.violations
            ]
        )
        moved.context = dict(self.context)
        return moved


class UnreadableText(InvalidRequest):
    """Every token of the text (within its token budget) is one the model's vocabulary
    lacks ([UNK]: emoji, symbols, a script it was not trained on), or the text has no
    token at all (only characters the tokenizer drops): the model has nothing to read,
    and its scores would be its bias, given with confidence. A client error
    (INVALID_ARGUMENT, field `text`) that the route's fallback, another model with
    another vocabulary, may still read (is_fallback_eligible)."""

    reason = "UNREADABLE_TEXT"
    rule = "text.readable"

    @classmethod
    def for_model(cls, model: str) -> UnreadableText:
        return cls(
            [
                FieldViolation(
                    "text",
                    cls.rule,
                    f"has no token the vocabulary of model {model} knows (emoji, symbols, "
                    "or a script it was not trained on): nothing for it to classify",
                )
            ]
        )


class Unauthenticated(ClientError):
    """The call carries no credentials, or ones that are not valid."""

    reason = "UNAUTHENTICATED"


class PermissionDenied(ClientError):
    """The caller is known but its role may not make this call."""

    reason = "PERMISSION_DENIED"


class NotFound(ClientError):
    """The named thing does not exist here."""

    reason = "NOT_FOUND"


class ModelNotFound(NotFound):
    """No model of that name is held by this server."""

    reason = "MODEL_NOT_FOUND"


class ResultNotFound(NotFound):
    """No stored result has that request ID, or it has expired."""

    reason = "RESULT_NOT_FOUND"


class MethodNotServed(ServiceError):
    """This layer does not serve that RPC (e.g. GetResult on a capability server)."""

    reason = "METHOD_NOT_SERVED"


class ModelError(ServiceError):
    """The model could not answer; another model may (fallback-eligible)."""

    reason = "MODEL_ERROR"


class ModelNotReady(ModelError):
    """The model is loading or warming up and cannot serve yet."""

    reason = "MODEL_NOT_READY"


class ModelUnavailable(ModelError):
    """The capability server holding the model could not be reached."""

    reason = "MODEL_UNAVAILABLE"


class ModelFault(ModelError):
    """The model produced no usable answer: non-finite output, a failed batch, a crash."""

    reason = "MODEL_FAULT"


class ModelNotServed(ModelError):
    """A replica of the route's backend does not serve the backend's model: a fault of
    the deployment (routes.yaml names a model that replica was not started with), not
    of the request. Another replica, or the route's fallback, may answer."""

    reason = "MODEL_NOT_SERVED"


class ServerDraining(ModelError):
    """The server is shutting down and admits no new work; another replica can."""

    reason = "SERVER_DRAINING"


def with_retry_info(details: list[Message], retry_after_seconds: float | None) -> list[Message]:
    """`details` and, with a delay, a RetryInfo saying when to try again: rounded up to
    the microsecond, so that a client that waits it out (Python's timedelta keeps
    microseconds) finds what it waits for there. Cut to the nanosecond, a rate
    limit's hint for its next token was a fraction short, and a client that waited
    exactly that long was refused again."""
    if retry_after_seconds is None:
        return details
    delay = duration_pb2.Duration()
    delay.FromMicroseconds(math.ceil(retry_after_seconds * 1e6))
    return [*details, error_details_pb2.RetryInfo(retry_delay=delay)]


class MayRetryAfter(ServiceError):
    """An error that may say when to try again: with `retry_after_seconds`, its status
    carries a RetryInfo. Listed first among a class's bases."""

    def __init__(
        self, message: str, *, retry_after_seconds: float | None = None, **context: object
    ) -> None:
        super().__init__(message, **context)
        self.retry_after_seconds = retry_after_seconds

    def details(self) -> list[Message]:
        return with_retry_info(super().details(), self.retry_after_seconds)


class StateUnavailable(MayRetryAfter, ServiceError):
    """The shared state store (Redis) did not answer in time, or refused the command;
    retrying after `retry_after_seconds` (sent as a RetryInfo) may work.

    The hint is the time left before the orchestrator asks Redis again
    (orchestrator.state.connection): a retry sooner is failed unasked."""

    reason = "STATE_UNAVAILABLE"


class Overloaded(ServiceError):
    """Too much work queued; try again after `retry_after_seconds`."""

    reason = "OVERLOADED"

    def __init__(self, message: str, *, retry_after_seconds: float, **context: object) -> None:
        super().__init__(message, **context)
        self.retry_after_seconds = retry_after_seconds

    def details(self) -> list[Message]:
        return with_retry_info(super().details(), self.retry_after_seconds)


class RateLimited(Overloaded):
    """The caller's tenant has used its rate; retry after the hint."""

    reason = "RATE_LIMITED"


class QueueFull(Overloaded):
    """The worker's bounded queue is full; the request was not queued."""

    reason = "QUEUE_FULL"


class ConcurrencyLimited(Overloaded):
    """The backend has as many calls in flight as its concurrency limit allows; the
    call was refused before any work was spent on it."""

    reason = "CONCURRENCY_LIMITED"


class FrontDoorBusy(Overloaded):
    """Calls are reaching the orchestrator with their deadlines spent: it is behind
    taking them in. The call was refused before validation and routing
    (orchestrator.policy.backlog)."""

    reason = "FRONT_DOOR_BUSY"


class DeviceMemoryPressure(Overloaded):
    """Device memory in use is past the admission threshold."""

    reason = "DEVICE_MEMORY_PRESSURE"


class DeadlineExpired(ServiceError):
    """The request's deadline passed before an answer was ready."""

    reason = "DEADLINE_EXPIRED"


class DeadlineUnreachable(MayRetryAfter, DeadlineExpired):
    """Refused at admission: the time left is less than the predicted service time.

    With `retry_after_seconds`, the refusal came from load (a queue too long for the
    time left, not a deadline too short for any wait), and its status carries a
    RetryInfo as an overload refusal does."""

    reason = "DEADLINE_UNREACHABLE"


class ExpiredInQueue(DeadlineExpired):
    """The deadline passed while queued; the request was evicted without being computed."""

    reason = "EXPIRED_IN_QUEUE"


class BackendTimedOut(DeadlineExpired):
    """A backend did not answer within its own timeout (routes.yaml), which ran out
    before the caller's deadline: a replica hung or too slow, while a fallback may
    still answer in the time left. Its reason is DeadlineExpired's: to a caller who
    gets it, the call ran out of time."""


class ReloadRefused(ServiceError):
    """A model reload failed its checks; the previous version keeps serving."""

    reason = "RELOAD_REFUSED"


class UnscorableText(ServiceError):
    """The model gave no usable scores (non-finite) for this text while it scores
    others: the text fails, not the replica, so it fails alike on every replica of
    the model. INTERNAL (a fault of the model, counted against the service's error
    budget), never retried and never held against the replica; the route's fallback,
    another model, may still score it (is_fallback_eligible)."""

    reason = "UNSCORABLE_TEXT"


class InternalError(ServiceError):
    """Something broke that is not the caller's fault: a bug to report."""

    reason = "INTERNAL"


def internal_error(request_id: str, trace_id: str) -> InternalError:
    """What a caller learns of a bug: the IDs that find its log line and trace.

    NOTE: nothing of the exception itself, not even its type: its message and
    traceback can hold file paths, internal host names and other callers' data."""
    return InternalError(
        f"internal error (request {request_id}, trace {trace_id}); the server logged the cause"
    )


# The one table from error class to status code. Looked up along the class's
# MRO, so a subclass inherits its parent's code unless listed itself.
GRPC_CODE_BY_ERROR: Mapping[type[ServiceError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ClientError: grpc.StatusCode.INVALID_ARGUMENT,
    MethodNotServed: grpc.StatusCode.UNIMPLEMENTED,
    ModelError: grpc.StatusCode.UNAVAILABLE,
    StateUnavailable: grpc.StatusCode.UNAVAILABLE,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExpired: grpc.StatusCode.DEADLINE_EXCEEDED,
    ReloadRefused: grpc.StatusCode.FAILED_PRECONDITION,
    UnscorableText: grpc.StatusCode.INTERNAL,
    InternalError: grpc.StatusCode.INTERNAL,
    ServiceError: grpc.StatusCode.INTERNAL,
}

# Status codes that are the server's fault, as OpenTelemetry's gRPC conventions
# list them: only these give a server (or internal) span error status, so refused
# calls (INVALID_ARGUMENT, UNAUTHENTICATED, NOT_FOUND, ...) are not kept whatever
# the sampling (classify_common.nodes.marks_error).
SERVER_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

# Status codes that mean "the model could not answer": a route may try its
# fallback backends. No client error's code qualifies (UnreadableText does by its
# class: another model may read the text).
FALLBACK_ELIGIBLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
)


def is_fallback_eligible(error: ServiceError) -> bool:
    """Whether a route may try its next backend after `error`: the model could not
    answer (UNAVAILABLE, RESOURCE_EXHAUSTED), could not score this text
    (UnscorableText) or read it (UnreadableText), or this backend could not answer in
    the time left (DeadlineUnreachable, refused before any work) or within its own
    timeout (BackendTimedOut), where another model still may."""
    return (
        isinstance(error, (DeadlineUnreachable, UnscorableText, UnreadableText, BackendTimedOut))
        or grpc_code_for(error) in FALLBACK_ELIGIBLE_CODES
    )


def is_routine_refusal(error: ServiceError) -> bool:
    """Whether `error` refuses a request for its text (InvalidRequest: a validation
    rule, UnreadableText) or for load and time (Overloaded, a deadline passed or out of
    reach), outcomes the metrics count by reason and nothing to repair in a server:
    logged per item and per attempt, a ClassifyBatch of 1,024 texts no model reads
    wrote 5,121 orchestrator and 2,064 capability lines (3 MB, WARNINGs among them,
    for an 8 KB request), and overload wrote a line for every item it refused. Not
    routine: a backend's own timeout (BackendTimedOut: a backend is slow; logged where
    it is told apart, orchestrator.upstream.pool) and device memory pressure (a
    device short of memory)."""
    return isinstance(error, InvalidRequest | Overloaded | DeadlineExpired) and not isinstance(
        error, BackendTimedOut | DeviceMemoryPressure
    )


def grpc_code_for(error: ServiceError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        code = GRPC_CODE_BY_ERROR.get(cls)
        if code is not None:
            return code
    raise AssertionError(f"{type(error).__name__} is not a ServiceError")


def status_for(error: ServiceError) -> status_pb2.Status:
    """The google.rpc.Status (code, message, details) that a client receives."""
    details = []
    for detail in error.details():
        packed = any_pb2.Any()
        packed.Pack(detail)
        details.append(packed)
    return status_pb2.Status(
        code=grpc_code_for(error).value[0], message=error.message, details=details
    )

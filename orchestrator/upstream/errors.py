"""Translate a capability server's failure into our error taxonomy.

The orchestrator never forwards a raw upstream status: each code becomes the
ServiceError that means the same thing one layer up, so the client sees one
consistent set of codes and the request/trace IDs of the orchestrator. A
DEADLINE_EXCEEDED whose ErrorInfo says DEADLINE_UNREACHABLE was refused before
any work (the capability predicted it could not answer in the time left: a long
queue, or an on-demand model's cold start), so it stays DeadlineUnreachable and
the route's fallback may still answer in time.
"""

from __future__ import annotations

import logging
import re

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from classify_common.errors import (
    DeadlineExpired,
    DeadlineUnreachable,
    DeviceMemoryPressure,
    FieldViolation,
    InternalError,
    InvalidRequest,
    ModelFault,
    ModelNotFound,
    ModelNotServed,
    ModelUnavailable,
    Overloaded,
    QueueFull,
    ServiceError,
    UnreadableText,
    UnscorableText,
    is_routine_refusal,
)

log = logging.getLogger(__name__)

# When an overloaded server sends no RetryInfo, clients wait this long.
DEFAULT_RETRY_AFTER_SECONDS = 1.0

# The capability's own overload refusals keep their reason one layer up, so the
# orchestrator's retry and fallback counters (and the caller) tell a full queue
# from short device memory; any other RESOURCE_EXHAUSTED is plain Overloaded.
_OVERLOADS: dict[str, tuple[type[Overloaded], str]] = {
    QueueFull.reason: (QueueFull, "backend {backend}'s queue is full"),
    DeviceMemoryPressure.reason: (
        DeviceMemoryPressure,
        "backend {backend} is short of device memory",
    ),
}

# What a code no capability server should answer the orchestrator says of this
# deployment, for the error line (the caller is told only INTERNAL and its IDs).
MISCONFIGURATION_CAUSES = {
    grpc.StatusCode.UNAUTHENTICATED: (
        "the capability server refused this orchestrator's internal token: "
        "the two --internal-token-file files do not hold the same token"
    ),
    grpc.StatusCode.NOT_FOUND: (
        "the replica does not serve the backend's model: routes.yaml names a model "
        "that replica was not started with (its --models), or the name is misspelt"
    ),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        "gRPC refused a message of the call as larger than its limit: no code of "
        "ours sent this refusal, and sending the call again cannot succeed"
    ),
}
# What gRPC's own refusal of a message past its size limit says ("Received message
# larger than max (N vs. M)", or "Sent ..." on this side).
_TOO_LARGE = "larger than max"


def _upstream_details(error: grpc.aio.AioRpcError) -> list[object]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    return [] if status is None else _unpack(status)


def _unpack(status: status_pb2.Status) -> list[object]:
    unpacked: list[object] = []
    for packed in status.details:
        for kind in (
            error_details_pb2.BadRequest,
            error_details_pb2.RetryInfo,
            error_details_pb2.ErrorInfo,
        ):
            if packed.Is(kind.DESCRIPTOR):
                message = kind()
                packed.Unpack(message)
                unpacked.append(message)
    return unpacked


def translate_upstream_error(
    error: grpc.aio.AioRpcError, backend: str, target: str, *, classifying: bool = True
) -> ServiceError:
    """The client-facing error for a failed capability call: a ClassifyService call
    for the backend's model, or (`classifying` False) an operator's ModelService call,
    whose NOT_FOUND names a model or version the caller asked for.

    NOTE: the upstream's own message and the replica's address are logged here
    and never copied into the client's error: they can name internal hosts.
    """
    return _translate(
        error.code(),
        error.details() or "",
        _upstream_details(error),
        backend,
        target,
        classifying=classifying,
    )


def translate_item_status(status: status_pb2.Status, backend: str, target: str) -> ServiceError:
    """The client-facing error for one failed item of a capability batch call."""
    return _translate(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message,
                      _unpack(status), backend, target)  # fmt: skip


_CODES = {code.value[0]: code for code in grpc.StatusCode}
_ITEM_PREFIX = re.compile(r"^items\[\d+\]\.")


def _translate(
    code: grpc.StatusCode,
    message: str,
    details: list[object],
    backend: str,
    target: str,
    *,
    classifying: bool = True,
) -> ServiceError:
    error = _error_for(code, message, details, backend, classifying)
    fields = {"backend": backend, "target": target, "code": code.name, "details": message}
    if isinstance(error, (InternalError, ModelNotServed)):
        # No exception of ours: the lifecycle logs no `unhandled error` line for it, so
        # this is the line the INTERNAL answer's runbook steps find (RouteCaller counts
        # an InternalError in classify_internal_errors_total). A replica without the
        # backend's model is a deployment fault too, logged here whatever its retry or
        # fallback answers, and counted only as its reason (MODEL_NOT_SERVED).
        cause = MISCONFIGURATION_CAUSES.get(code, "the capability answered a code it should not")
        log.error("capability call failed unexpectedly", extra={**fields, "cause": cause})
    elif is_routine_refusal(error):
        log.debug("capability call failed", extra=fields)  # see is_routine_refusal
    else:
        log.warning("capability call failed", extra=fields)
    return error


def _error_for(
    code: grpc.StatusCode, message: str, details: list[object], backend: str, classifying: bool
) -> ServiceError:
    where = {"backend": backend, "upstream_code": code.name}
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not details and _TOO_LARGE in message:
        # gRPC's own refusal of a message past its size limit, not a capability's of
        # load (which always names its reason): the same call can never succeed, and
        # says nothing of the backend's load. Taken for overload, it was retried, spent
        # the route's retry budget and shrank the backend's adaptive limit, and other
        # tenants' calls were refused for it.
        return InternalError(f"backend {backend} refused the call as too large", **where)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        # Paths relative to the text sent: a capability names a batch item's fields
        # `items[j].…`, j its place in a call the orchestrator made, not the caller's.
        violations = [
            FieldViolation(
                field=_ITEM_PREFIX.sub("", v.field), rule=v.reason, message=v.description
            )
            for detail in details
            if isinstance(detail, error_details_pb2.BadRequest)
            for v in detail.field_violations
        ]
        if violations:
            # The model's own refusal keeps its class: the route's fallback may read the
            # text (is_fallback_eligible).
            if _reason(details) == UnreadableText.reason:
                return UnreadableText(violations)
            return InvalidRequest(violations)
        return InternalError(f"backend {backend} rejected the request", **where)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_after = next(
            (
                d.retry_delay.ToTimedelta().total_seconds()
                for d in details
                if isinstance(d, error_details_pb2.RetryInfo)
            ),
            DEFAULT_RETRY_AFTER_SECONDS,
        )
        kind, message = _OVERLOADS.get(
            _reason(details), (Overloaded, "backend {backend} is overloaded")
        )
        return kind(message.format(backend=backend), retry_after_seconds=retry_after, **where)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if any(
            isinstance(d, error_details_pb2.ErrorInfo) and d.reason == DeadlineUnreachable.reason
            for d in details
        ):
            return DeadlineUnreachable(
                # The capability's own message stays in the log (see the NOTE above).
                f"backend {backend} cannot answer in the time left",
                backend=backend,
                upstream_code=code.name,
            )
        return DeadlineExpired(f"backend {backend} did not answer in time", **where)
    if code == grpc.StatusCode.NOT_FOUND and not classifying:
        return ModelNotFound(f"backend {backend} has no such model or version", **where)
    if code == grpc.StatusCode.NOT_FOUND:
        # A classify call asks a replica for its backend's model only, so this is the
        # deployment's fault, not the caller's: retried on another replica, and the
        # route's fallback may answer (a NOT_FOUND did neither, and told the caller to
        # fix a request that was right).
        return ModelNotServed(f"a replica of backend {backend} does not serve its model", **where)
    if code == grpc.StatusCode.UNAVAILABLE and _reason(details) == ModelFault.reason:
        # The replica was reached and its model failed (a non-finite output, a failed
        # batch): the caller is told that, not that the backend could not be reached.
        return ModelFault(f"backend {backend} failed to compute the text", **where)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return ModelUnavailable(f"backend {backend} is unavailable", **where)
    if code == grpc.StatusCode.INTERNAL and _reason(details) == UnscorableText.reason:
        return UnscorableText(f"backend {backend}'s model cannot score this text", **where)
    return InternalError(f"backend {backend} failed with {code.name}", **where)


def _reason(details: list[object]) -> str:
    """The ErrorInfo reason among an upstream status's details, or ""."""
    return next((d.reason for d in details if isinstance(d, error_details_pb2.ErrorInfo)), "")

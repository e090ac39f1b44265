"""Catch a failed call, and read its rich status details (google.rpc.*) and trailers."""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from typing import TypeVar

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

M = TypeVar("M", bound=Message)


async def refusal(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    """The error `call` fails with; the test fails if it succeeds."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def unpack(status: status_pb2.Status, kind: type[M]) -> list[M]:
    """The details of type `kind` in a google.rpc.Status (a failed call's, or a batch
    item's)."""
    found: list[M] = []
    for packed in status.details:
        if packed.Is(kind.DESCRIPTOR):
            message = kind()
            packed.Unpack(message)
            found.append(message)
    return found


def _status(error: grpc.aio.AioRpcError) -> status_pb2.Status:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "a failed call must carry google.rpc.Status details"
    return status


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    for detail in _status(error).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    raise AssertionError("no ErrorInfo in the status details")


def error_reason(error: grpc.aio.AioRpcError) -> str:
    """The ErrorInfo reason (e.g. MODEL_NOT_READY) of a failed call, after checking that
    its ErrorInfo and its trailers carry the same request and trace IDs."""
    info = error_info(error)
    trailers = trailers_of(error)
    assert info.metadata["x-request-id"] == trailers["x-request-id"]
    assert info.metadata["x-trace-id"] == trailers["x-trace-id"]
    return str(info.reason)


def violations_of(error: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    """(field, rule id) of each BadRequest field violation, in order."""
    found: list[tuple[str, str]] = []
    for detail in _status(error).details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            found += [(v.field, v.reason) for v in bad_request.field_violations]
    return found


def metadata_dict(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str | bytes]:
    """Metadata (grpc.aio's `Metadata`, or pairs) as a dict, the first value of each key.

    Not `dict(metadata)`: grpcio before 1.80 gives `aio.Metadata` a `keys()` that yields
    (key, value) pairs, so `dict()` looks each pair up as a key and fails.
    """
    found: dict[str, str | bytes] = {}
    for key, value in metadata or ():
        found.setdefault(key, value)
    return found


def trailers_of(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return {key: str(value) for key, value in metadata_dict(error.trailing_metadata()).items()}


def retry_delay_seconds(error: grpc.aio.AioRpcError) -> float:
    """The RetryInfo delay of a failed call, in seconds."""
    (retry,) = unpack(_status(error), error_details_pb2.RetryInfo)
    return float(retry.retry_delay.ToTimedelta().total_seconds())

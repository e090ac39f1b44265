"""What the sync and asyncio clients share: channel credentials, requests, batch chunks
and results. Neither does I/O here."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc

from classify_client.errors import ClassifyError, StillProcessing, error_from_status
from classify_client.gen.ai.classify.v1 import classify_service_pb2 as pb
from classify_client.retry import RetryEvent, RetryPolicy

DEFAULT_TARGET = "127.0.0.1:50051"
# Seconds a call may take, retries and GetResult polls included, unless the call says.
DEFAULT_TIMEOUT_SECONDS = 10.0
# The contract's limits on one ClassifyBatch call.
BATCH_MAX_ITEMS = 1024
BATCH_MAX_CHARS = 1_000_000

Priority = Literal["interactive", "batch"]
PRIORITIES: dict[str, pb.Priority.ValueType] = {
    "interactive": pb.PRIORITY_INTERACTIVE,
    "batch": pb.PRIORITY_BATCH,
}


class _UseClientTimeout:
    """The `timeout` default: the client's own timeout (None means no deadline)."""

    def __repr__(self) -> str:
        return "<client timeout>"


CLIENT_TIMEOUT = _UseClientTimeout()


def channel_credentials(tls: bool, ca_file: str | Path | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `ca_file`, or gRPC's default roots when only `tls` is
    set; None for a plaintext channel."""
    if ca_file is not None:
        return grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
    if tls:
        return grpc.ssl_channel_credentials()
    return None


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


@dataclass(frozen=True)
class RequestOptions:
    """What every text of a call is classified with (the ClassifyRequest fields)."""

    top_k: int | None = None
    max_length: int | None = None
    model: str = ""
    priority: Priority = "interactive"

    def request(self, text: str, request_id: str = "") -> pb.ClassifyRequest:
        try:
            priority = PRIORITIES[self.priority]
        except KeyError:
            raise ValueError(
                f"priority {self.priority!r} must be one of {sorted(PRIORITIES)}"
            ) from None
        request = pb.ClassifyRequest(
            text=text, model=self.model, priority=priority, request_id=request_id
        )
        if self.top_k is not None:
            request.top_k = self.top_k
        if self.max_length is not None:
            request.max_length = self.max_length
        return request


@dataclass(frozen=True)
class BatchItem:
    """One text's outcome in a batch: its answer, or the error a Classify call for it
    would have raised. Exactly one of the two is set."""

    response: pb.ClassifyResponse | None = None
    error: ClassifyError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def batch_item(result: pb.ClassifyBatchResult) -> BatchItem:
    if result.HasField("error"):
        return BatchItem(error=error_from_status(result.error))
    return BatchItem(response=result.response)


def record_batch(
    sent: list[int],
    response: pb.ClassifyBatchResponse,
    items: list[BatchItem],
    policy: RetryPolicy,
    attempt: int,
) -> tuple[list[int], RetryEvent | None]:
    """Store the answers to the items `sent` (indices into `items`); return the
    indices the policy sends again, and the retry (the longest wait any of them
    needs), or None when none is retried."""
    again: list[int] = []
    retry: RetryEvent | None = None
    for index, result in zip(sent, response.results, strict=True):
        items[index] = batch_item(result)
        error = items[index].error
        delay = None if error is None else policy.delay_before_retry(error, attempt)
        if error is None or delay is None:
            continue
        again.append(index)
        if retry is None or delay > retry.delay_seconds:
            retry = RetryEvent("ClassifyBatch", attempt, error, delay)
    return again, retry


def batch_chunks(requests: Sequence[pb.ClassifyRequest]) -> Iterator[list[int]]:
    """Indices of `requests` in groups that each fit one ClassifyBatch call (items and
    characters); a single text over the character limit goes alone, for the server
    to refuse by name."""
    chunk: list[int] = []
    chars = 0
    for index, request in enumerate(requests):
        size = len(request.text)
        if chunk and (len(chunk) == BATCH_MAX_ITEMS or chars + size > BATCH_MAX_CHARS):
            yield chunk
            chunk, chars = [], 0
        chunk.append(index)
        chars += size
    if chunk:
        yield chunk


def still_processing(response: pb.ClassifyResponse) -> StillProcessing:
    return StillProcessing(
        f"the result was still PROCESSING when the deadline came; "
        f"get_result({response.request_id!r}) fetches it later",
        code=grpc.StatusCode.DEADLINE_EXCEEDED,
        request_id=response.request_id,
        trace_id=response.trace_id,
    )


def is_processing(response: pb.ClassifyResponse) -> bool:
    return response.status == pb.RESULT_STATUS_PROCESSING

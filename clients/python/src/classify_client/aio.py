"""The asyncio client: the same calls as classify_client.client, awaited.

    async with AsyncClassifyClient("classify.example.com:443", api_key=key, tls=True) as client:
        response = await client.classify("Shares fell after the earnings call", wait=True)
        print(response.labels[0].name)

Each call has a deadline (the client's `timeout`, or the call's own) that
covers its retries and, with `wait=True`, its GetResult polls. Failures raise
the typed errors of classify_client.errors, with the request and trace IDs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from classify_client._shared import (
    CLIENT_TIMEOUT,
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT_SECONDS,
    BatchItem,
    Priority,
    RequestOptions,
    _UseClientTimeout,
    batch_chunks,
    call_metadata,
    channel_credentials,
    is_processing,
    record_batch,
    still_processing,
)
from classify_client.errors import ClassifyError, error_from_rpc
from classify_client.gen.ai.classify.v1 import classify_service_pb2 as pb
from classify_client.gen.ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from classify_client.retry import Deadline, PollPolicy, RetryEvent, RetryPolicy

Response = TypeVar("Response", bound=Message)
Request = TypeVar("Request", bound=Message)


class AsyncClassifyClient:
    """A grpc.aio channel to the orchestrator and the calls of ClassifyService. Make it
    inside the running event loop that uses it."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls: bool = False,
        ca_file: str | Path | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_SECONDS,
        retry: RetryPolicy | None = None,
        poll: PollPolicy | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        channel_options: Sequence[tuple[str, object]] = (),
    ) -> None:
        """`target` is host:port. `tls` (gRPC's default roots) or `ca_file` (a PEM CA
        bundle) make the channel TLS. `timeout` is each call's deadline in seconds,
        retries and polls included (None: none). `on_retry` is told of every retry."""
        credentials = channel_credentials(tls, ca_file)
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=channel_options)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=channel_options)
        )
        self._stub = pb_grpc.ClassifyServiceStub(self._channel)
        self._metadata = call_metadata(api_key)
        self._timeout = timeout
        self._retry = retry or RetryPolicy()
        self._poll = poll or PollPolicy()
        self._on_retry = on_retry

    async def __aenter__(self) -> AsyncClassifyClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def classify(
        self,
        text: str,
        *,
        top_k: int | None = None,
        max_length: int | None = None,
        model: str = "",
        priority: Priority = "interactive",
        request_id: str = "",
        timeout: float | _UseClientTimeout | None = CLIENT_TIMEOUT,
        wait: bool = False,
    ) -> pb.ClassifyResponse:
        """Classify one text. The answer is DONE with labels, or PROCESSING when the
        route's time budget ran out first; with `wait=True` a PROCESSING answer is
        followed with GetResult until DONE (StillProcessing if the deadline comes
        first)."""
        deadline = self._deadline(timeout)
        options = RequestOptions(top_k, max_length, model, priority)
        response = await self._call(
            "Classify", self._stub.Classify, options.request(text, request_id), deadline
        )
        return await self._follow(response, deadline) if wait else response

    async def get_result(
        self,
        request_id: str,
        *,
        timeout: float | _UseClientTimeout | None = CLIENT_TIMEOUT,
        wait: bool = False,
    ) -> pb.ClassifyResponse:
        """The result kept for an earlier PROCESSING answer: DONE, or still PROCESSING
        (with `wait=True`, polled until DONE). ResultNotFound once it has expired."""
        deadline = self._deadline(timeout)
        request = pb.GetResultRequest(request_id=request_id)
        response = await self._call("GetResult", self._stub.GetResult, request, deadline)
        return await self._follow(response, deadline) if wait else response

    async def classify_batch(
        self,
        texts: Sequence[str],
        *,
        top_k: int | None = None,
        max_length: int | None = None,
        model: str = "",
        priority: Priority = "interactive",
        timeout: float | _UseClientTimeout | None = CLIENT_TIMEOUT,
        wait: bool = False,
    ) -> list[BatchItem]:
        """Classify many texts with ClassifyBatch (as many calls as the contract's
        limits need), one BatchItem per text, in order. Items refused with a
        retryable error (say RESOURCE_EXHAUSTED past the tenant's rate) are sent
        again under the retry policy; with `wait=True` PROCESSING items are followed
        to DONE. A refused call (bad batch, bad key) raises."""
        deadline = self._deadline(timeout)
        options = RequestOptions(top_k, max_length, model, priority)
        requests = [options.request(text) for text in texts]
        items: list[BatchItem] = [BatchItem() for _ in requests]
        for chunk in batch_chunks(requests):
            await self._classify_chunk(requests, chunk, items, deadline)
        if wait:
            for index, item in enumerate(items):
                if item.response is not None and is_processing(item.response):
                    items[index] = await self._follow_item(item.response, deadline)
        return items

    async def _classify_chunk(
        self,
        requests: list[pb.ClassifyRequest],
        pending: list[int],
        items: list[BatchItem],
        deadline: Deadline,
    ) -> None:
        attempt = 0
        while pending:
            attempt += 1
            batch = pb.ClassifyBatchRequest(items=[requests[i] for i in pending])
            response = await self._call("ClassifyBatch", self._stub.ClassifyBatch, batch, deadline)
            pending, retry = record_batch(pending, response, items, self._retry, attempt)
            if retry is None or not deadline.allows_wait(retry.delay_seconds):
                return
            self._notify(retry)
            await asyncio.sleep(retry.delay_seconds)

    async def _follow_item(self, response: pb.ClassifyResponse, deadline: Deadline) -> BatchItem:
        try:
            return BatchItem(response=await self._follow(response, deadline))
        except ClassifyError as error:
            return BatchItem(error=error)

    async def _follow(
        self, response: pb.ClassifyResponse, deadline: Deadline
    ) -> pb.ClassifyResponse:
        """Poll GetResult while `response` is PROCESSING, spaced by the poll policy."""
        poll = 0
        while is_processing(response):
            poll += 1
            interval = self._poll.interval(poll)
            if not deadline.allows_wait(interval):
                raise still_processing(response)
            await asyncio.sleep(interval)
            request = pb.GetResultRequest(request_id=response.request_id)
            response = await self._call("GetResult", self._stub.GetResult, request, deadline)
        return response

    async def _call(
        self,
        method: str,
        rpc: grpc.aio.UnaryUnaryMultiCallable[Request, Response],
        request: Request,
        deadline: Deadline,
    ) -> Response:
        """One RPC under the retry policy, every attempt within `deadline`."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return await rpc(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as failure:
                error = error_from_rpc(failure)
                delay = self._retry.delay_before_retry(error, attempt)
                if delay is None or not deadline.allows_wait(delay):
                    raise error from failure
            self._notify(RetryEvent(method, attempt, error, delay))
            await asyncio.sleep(delay)

    def _notify(self, event: RetryEvent) -> None:
        if self._on_retry is not None:
            self._on_retry(event)

    def _deadline(self, timeout: float | _UseClientTimeout | None) -> Deadline:
        return Deadline(self._timeout if isinstance(timeout, _UseClientTimeout) else timeout)

"""The synchronous client.

    with ClassifyClient("classify.example.com:443", api_key=key, tls=True) as client:
        response = client.classify("Shares fell after the earnings call", wait=True)
        print(response.labels[0].name)

Each call has a deadline (the client's `timeout`, or the call's own) that
covers its retries and, with `wait=True`, its GetResult polls. Each call has a
request ID (the caller's, or one the client makes), which its retries and polls
reuse. Failures raise the typed errors of classify_client.errors, with the
request and trace IDs.
"""

from __future__ import annotations

import threading
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
    ProcessingPolls,
    RequestOptions,
    _UseClientTimeout,
    batch_chunks,
    call_metadata,
    channel_arguments,
    channel_credentials,
    check_batch_answer,
    checked_batch_request_id,
    checked_target,
    client_closed,
    new_request_id,
    record_batch,
    record_failed_call,
    refuse_single_text,
    refused_alone,
    with_request_id,
)
from classify_client.errors import ClassifyError, error_from_rpc
from classify_client.gen.ai.classify.v1 import classify_service_pb2 as pb
from classify_client.gen.ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from classify_client.retry import (
    NO_RETRIES,
    Attempts,
    Deadline,
    PollPolicy,
    RetryEvent,
    RetryPolicy,
    checked_connection_wait,
    checked_timeout,
    is_connection_failure,
)

Response = TypeVar("Response", bound=Message)
Request = TypeVar("Request", bound=Message)


class ClassifyClient:
    """A channel to the orchestrator and the calls of ClassifyService. Thread-safe."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls: bool = False,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_SECONDS,
        retry: RetryPolicy | None = None,
        poll: PollPolicy | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        channel_options: Sequence[tuple[str, object]] = (),
    ) -> None:
        """`target` is host:port. `tls` (gRPC's default roots) or `ca_file` (a PEM CA
        bundle) make the channel TLS; `cert_file` and `key_file` (PEM), a client
        certificate for a front door that asks for one (mutual TLS). `timeout` is
        each call's deadline in seconds, retries and polls included (None: none).
        `on_retry` is told of every retry."""
        self._timeout = checked_timeout(timeout)
        target = checked_target(target)
        # Before the channel, which a refused key would leave open.
        self._metadata = call_metadata(api_key)
        credentials = channel_credentials(tls, ca_file, cert_file, key_file)
        options = channel_arguments(channel_options)
        self._closed = False
        # Set by close(): wakes the calls waiting to retry or poll (_pause).
        self._closing = threading.Event()
        # The readiness futures of the wait_for_connection calls in progress, which
        # close() cancels (see wait_for_connection); the lock orders a wait's start
        # against close(), so that none starts on a channel close() has missed.
        self._readiness: set[grpc.Future[None]] = set()
        self._readiness_lock = threading.Lock()
        self._channel = (
            grpc.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(target, options=options)
        )
        self._stub = pb_grpc.ClassifyServiceStub(self._channel)
        self._retry = retry or RetryPolicy()
        self._poll = poll or PollPolicy()
        self._on_retry = on_retry

    def __enter__(self) -> ClassifyClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        with self._readiness_lock:
            self._closed = True
            # Each future is cancelled once, by whoever takes it out of the set: gRPC's
            # cancel() called twice raises TypeError.
            waiting, self._readiness = self._readiness, set()
        self._closing.set()
        for ready in waiting:
            ready.cancel()
        self._channel.close()

    def wait_for_connection(self, timeout: float) -> bool:
        """Whether the channel connects (and completes TLS, where set) within `timeout`
        seconds. A caller about to send many calls under one long deadline can check
        this first: a server that is down then fails it in `timeout`, where the calls
        would wait for it to come up until their deadline."""
        # NOTE: on a closed channel gRPC's readiness thread died with a traceback, and
        # this waited all of `timeout` to say False. Closing the channel under a wait
        # did the same: gRPC drops the readiness future's subscription without a word,
        # so close() cancels the future, and the wait ends with the closed client's error.
        self._refuse_if_closed()
        timeout = checked_connection_wait(timeout)
        with self._readiness_lock:
            self._refuse_if_closed()
            ready = grpc.channel_ready_future(self._channel)
            self._readiness.add(ready)
        try:
            ready.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return False
        except grpc.FutureCancelledError:
            if self._closed:
                raise client_closed() from None
            raise
        finally:
            with self._readiness_lock:
                ours = ready in self._readiness
                self._readiness.discard(ready)
            if ours:
                ready.cancel()  # after a timeout, stop watching the channel
        return True

    def classify(
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
        first). Without a `request_id` the client makes one."""
        deadline = self._start_call(timeout)
        request_id = request_id or new_request_id()
        request = RequestOptions(top_k, max_length, model, priority).request(text, request_id)
        response = self._call("Classify", self._stub.Classify, request, deadline, request_id)
        return self._follow(response, deadline) if wait else response

    def get_result(
        self,
        request_id: str,
        *,
        timeout: float | _UseClientTimeout | None = CLIENT_TIMEOUT,
        wait: bool = False,
    ) -> pb.ClassifyResponse:
        """The result kept for an earlier PROCESSING answer: DONE, or still PROCESSING
        (with `wait=True`, polled until DONE). ResultNotFound once it has expired."""
        deadline = self._start_call(timeout)
        request = pb.GetResultRequest(request_id=request_id)
        response = self._call("GetResult", self._stub.GetResult, request, deadline, request_id)
        return self._follow(response, deadline) if wait else response

    def classify_batch(
        self,
        texts: Sequence[str],
        *,
        top_k: int | None = None,
        max_length: int | None = None,
        model: str = "",
        priority: Priority = "interactive",
        request_id: str = "",
        timeout: float | _UseClientTimeout | None = CLIENT_TIMEOUT,
        wait: bool = False,
    ) -> list[BatchItem]:
        """Classify many texts with ClassifyBatch (as many calls as the contract's
        limits need), one BatchItem per text, in order. Items refused with a
        retryable error (say RESOURCE_EXHAUSTED past the tenant's rate) are sent
        again under the retry policy; with `wait=True` PROCESSING items are followed
        to DONE. When the first call is refused as a whole (bad batch, bad key) this
        raises; a later call that fails as a whole becomes the error of its items and
        of those not sent yet, and the earlier answers are kept.

        `request_id` names the ClassifyBatch calls (the client makes one without it);
        each item gets its own from the server, in its answer or error."""
        refuse_single_text(texts)
        deadline = self._start_call(timeout)
        request_id = checked_batch_request_id(request_id) or new_request_id()
        options = RequestOptions(top_k, max_length, model, priority)
        requests = [
            options.request(text, what=f"texts[{index}]") for index, text in enumerate(texts)
        ]
        items: list[BatchItem] = [BatchItem() for _ in requests]
        chunks = list(batch_chunks([request.text for request in requests]))
        for number, chunk in enumerate(chunks):
            try:
                self._classify_chunk(requests, chunk, items, deadline, request_id)
            except ClassifyError as error:
                if refused_alone(requests, chunk, error):
                    record_failed_call(items, chunk, error)
                    continue
                if number == 0:
                    raise
                unanswered = (index for later in chunks[number:] for index in later)
                record_failed_call(items, unanswered, error)
                break
        return self._follow_processing(items, deadline) if wait else items

    def _classify_chunk(
        self,
        requests: list[pb.ClassifyRequest],
        pending: list[int],
        items: list[BatchItem],
        deadline: Deadline,
        request_id: str,
    ) -> None:
        """Send one chunk, and again its items refused with a retryable error. Raises
        only when its first call fails as a whole, when no item of it has an answer."""
        attempts = Attempts()
        answered = False
        while pending:
            batch = pb.ClassifyBatchRequest(items=[requests[i] for i in pending])
            try:
                response = self._call(
                    "ClassifyBatch",
                    self._stub.ClassifyBatch,
                    batch,
                    deadline,
                    request_id,
                    attempts,
                )
                check_batch_answer(pending, response, request_id)
            except ClassifyError as error:
                if not answered:
                    raise
                record_failed_call(items, pending, error)
                return
            answered = True
            pending, retry = record_batch(
                pending, response, items, self._retry, attempts.made, deadline
            )
            if retry is None or not deadline.allows_wait(retry.delay_seconds):
                return
            self._notify(retry)
            self._pause(retry.delay_seconds)

    def _follow(self, response: pb.ClassifyResponse, deadline: Deadline) -> pb.ClassifyResponse:
        """`response`, or (while it is PROCESSING) the answer GetResult polls get."""
        (item,) = self._follow_processing([BatchItem(response=response)], deadline)
        if item.error is not None:
            raise item.error
        assert item.response is not None
        return item.response

    def _follow_processing(self, items: list[BatchItem], deadline: Deadline) -> list[BatchItem]:
        """Poll GetResult for the PROCESSING items, all of them each round (see
        ProcessingPolls), until each is DONE, has failed, or the deadline comes."""
        polls = ProcessingPolls(items, self._poll)
        while (wait := polls.wait_before_next_round(deadline)) is not None:
            self._pause(wait)
            for index, request_id in polls.due():
                # One after another, a round of many polls ran into the deadline and
                # sent the last ones with no time left: each failed, and the front door
                # counted them against the tenant (FRONT_DOOR_BUSY). Those not sent now
                # end as StillProcessing at the next round's start. After a refusal with
                # a RetryInfo delay the rest wait for the next round too.
                if not deadline.allows_wait(0) or polls.pushed_back:
                    break
                polls.record(index, self._poll_result(request_id, deadline))
        return items

    def _poll_result(
        self, request_id: str, deadline: Deadline
    ) -> pb.ClassifyResponse | ClassifyError:
        request = pb.GetResultRequest(request_id=request_id)
        try:
            return self._call(
                "GetResult", self._stub.GetResult, request, deadline, request_id, retry=NO_RETRIES
            )
        except ClassifyError as error:
            return error

    def _call(
        self,
        method: str,
        rpc: grpc.UnaryUnaryMultiCallable[Request, Response],
        request: Request,
        deadline: Deadline,
        request_id: str,
        attempts: Attempts | None = None,
        retry: RetryPolicy | None = None,
    ) -> Response:
        """One RPC under the retry policy (`retry`, else the client's), every attempt
        within `deadline` and sent under `request_id`, which an error names when the
        server did not answer; `attempts`: the tries already made of it (see Attempts)."""
        metadata = with_request_id(self._metadata, request_id)
        attempts = attempts or Attempts()
        wait_for_ready = False
        while True:
            # Closed while this call waited to retry (or, for a poll, for its round).
            self._refuse_if_closed(request_id)
            attempts.made += 1
            try:
                return rpc(
                    request,
                    timeout=deadline.remaining(),
                    metadata=metadata,
                    wait_for_ready=wait_for_ready,
                )
            except ValueError as failure:
                # gRPC's refusal of a channel closed since the check above.
                if self._closed:
                    raise client_closed(request_id) from failure
                raise
            except grpc.RpcError as failure:
                if self._closed and failure.code() == grpc.StatusCode.CANCELLED:
                    raise client_closed(request_id) from failure  # closed while in flight
                error = error_from_rpc(failure, request_id)
                attempts.record_failure(error)
                delay = (retry or self._retry).delay_before_retry(error, attempts.made)
                if delay is None or not deadline.allows_wait(delay):
                    raise attempts.give_up(error) from failure
            self._notify(RetryEvent(method, attempts.made, error, delay))
            self._pause(delay)
            # No server answered: gRPC fails a fail-fast call at once until it has
            # connected again, so the retry waits for that, within the deadline (a call
            # without one stays fail-fast, never to wait for ever on a server gone).
            wait_for_ready = is_connection_failure(error) and deadline.remaining() is not None

    def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or until the client is closed: a call then ends at once, with
        the closed client's error, where it waited out its backoff (a server's RetryInfo
        may ask for minutes) before it learnt that."""
        self._closing.wait(seconds)

    def _notify(self, event: RetryEvent) -> None:
        if self._on_retry is not None:
            self._on_retry(event)

    def _refuse_if_closed(self, request_id: str = "") -> None:
        if self._closed:
            raise client_closed(request_id)

    def _start_call(self, timeout: float | _UseClientTimeout | None) -> Deadline:
        """The deadline of a call that starts now; first of all, a closed client refuses
        it (gRPC's own refusal differs: ValueError, or the asyncio channel's UsageError)."""
        self._refuse_if_closed()
        return Deadline(self._timeout if isinstance(timeout, _UseClientTimeout) else timeout)

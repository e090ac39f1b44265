"""What the sync and asyncio clients share: channel credentials, request IDs, requests,
batch chunks and results, and the rounds of GetResult polls. Nothing here does I/O."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import ssl
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc

from classify_client.errors import (
    REQUEST_ID_HEADER,
    RESULT_TRACE_ID,
    ClassifyError,
    InternalError,
    StillProcessing,
    error_from_status,
)
from classify_client.gen.ai.classify.v1 import classify_service_pb2 as pb
from classify_client.retry import (
    MAX_RETRY_INFO_SECONDS,
    MIN_SECONDS_FOR_A_CALL,
    RETRYABLE_CODES,
    Deadline,
    PollPolicy,
    RetryEvent,
    RetryPolicy,
)

DEFAULT_TARGET = "127.0.0.1:50051"
# Seconds a call may take, retries and GetResult polls included, unless the call says.
DEFAULT_TIMEOUT_SECONDS = 10.0
# The contract's limits on one ClassifyBatch call.
BATCH_MAX_ITEMS = 1024
BATCH_MAX_CHARS = 1_000_000

# The contract's rule for ClassifyRequest.request_id (and the server's for x-request-id):
# letters, digits and `._:-`, up to 128, starting with a letter or a digit.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
# The start of a StillProcessing message; the rest says how to fetch the result.
STILL_PROCESSING = "the result was still PROCESSING when the deadline came"

# gRPC target schemes whose addresses carry no port, and those that list addresses.
_PORTLESS_SCHEMES = ("unix:", "unix-abstract:")
_ADDRESS_SCHEMES = ("dns:", "ipv4:", "ipv6:")
_PORTS = range(1, 65536)
# A port as gRPC reads it: ASCII digits only (int() would also take "+99999", " 99999"
# and other scripts' digits, and the check pass what gRPC then dials modulo 65536).
_PORT_DIGITS = re.compile(r"[0-9]{1,5}")
# What a target may not hold: gRPC drops a URI's query or fragment, and trailing
# whitespace, before it reads the port, which a check of the text would not see.
_NOT_IN_A_TARGET = re.compile(r"[?#\s]")


def checked_target(target: str) -> str:
    """`target` (host:port, [v6]:port, or a gRPC URI such as dns:///host:port or
    ipv4:a.b.c.d:port,...) unless it holds a query, a fragment or whitespace, or a port
    it names is not a number in 1..65535: gRPC takes such a port modulo 65536 and
    dials another (127.0.0.1:99999 is 127.0.0.1:34463, and so was 127.0.0.1:99999?x=1)."""
    if target.startswith(_PORTLESS_SCHEMES):
        return target
    if (found := _NOT_IN_A_TARGET.search(target)) is not None:
        raise ValueError(
            f"target {target!r} holds {found.group()!r}: a target is host:port or a gRPC "
            "URI, without a query, a fragment or whitespace"
        )
    addresses = target.rsplit("/", 1)[-1]  # dns:///host:port, dns://resolver/host:port
    for scheme in _ADDRESS_SCHEMES:
        addresses = addresses.removeprefix(scheme)
    if not addresses:
        # `host:port/` and `dns:///` name nothing gRPC can dial: every call waited out
        # its deadline to fail DEADLINE_EXCEEDED, which read as a slow server.
        raise ValueError(f"target {target!r} names no address after its last '/'")
    for address in addresses.split(","):
        if address.startswith("["):
            _, _, port = address.partition("]:")
        elif address.count(":") == 1:
            port = address.split(":", 1)[1]
        else:
            port = ""  # no port (gRPC's default), or an IPv6 address without brackets
        if not port:
            continue
        if _PORT_DIGITS.fullmatch(port) is None:
            raise ValueError(f"target {target!r}: port {port!r} is not a number 1 to 65535")
        if int(port) not in _PORTS:
            raise ValueError(f"target {target!r}: port {port} is outside 1..65535")
    return target


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

# gRPC channel arguments the clients start from (a caller's channel_options win). After a
# lost connection gRPC waits 1 s, then x1.6 each time up to 120 s, before it tries to
# connect again; a retry that waits for the server to come back (retry.py) would thus
# find it up to 4 s late within a 10 s deadline. At most 1 s between tries, instead.
DEFAULT_CHANNEL_OPTIONS: dict[str, object] = {"grpc.max_reconnect_backoff_ms": 1000}


def channel_arguments(channel_options: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
    """DEFAULT_CHANNEL_OPTIONS, with the caller's `channel_options` added or in their place."""
    return list({**DEFAULT_CHANNEL_OPTIONS, **dict(channel_options)}.items())


def channel_credentials(
    tls: bool,
    ca_file: str | Path | None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `ca_file`, or gRPC's default roots when only `tls` is
    set, presenting the client certificate `cert_file` (with its key `key_file`) when
    given; None for a plaintext channel."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    if ca_file is None and cert_file is None and not tls:
        return None
    root_certificates = None if ca_file is None else Path(ca_file).read_bytes()
    private_key = None if key_file is None else Path(key_file).read_bytes()
    certificate_chain = None if cert_file is None else Path(cert_file).read_bytes()
    # NOTE: gRPC reads these only in the handshake: there a CA file that is not PEM or
    # a key that is not the certificate's only logged native errors and failed every
    # attempt UNAVAILABLE, as if no server were there.
    if ca_file is not None and root_certificates is not None:
        check_ca_bundle(ca_file, root_certificates)
    if cert_file is not None and key_file is not None:
        check_certificate_and_key(cert_file, key_file)
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates,
        private_key=private_key,
        certificate_chain=certificate_chain,
    )


# A PEM certificate block; what lies between blocks (a bundle's comment lines, in any
# encoding) is not read, by gRPC nor here.
PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----\r?\n.*?-----END CERTIFICATE-----", re.DOTALL
)


def check_ca_bundle(ca_file: str | Path, data: bytes) -> None:
    """Refuse a CA file that holds no PEM certificate gRPC could trust."""
    blocks = PEM_CERTIFICATE.findall(data)
    if not blocks:
        # DER, say, a common mistake: gRPC reads PEM only.
        raise ValueError(
            f"ca_file {ca_file} holds no usable PEM CA certificate (no PEM certificate block)"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # Only the blocks: ssl takes PEM as an ASCII str, and refused (TypeError) a
        # bundle whose comment lines held any other byte, which gRPC trusts.
        context.load_verify_locations(cadata="\n".join(b.decode("latin-1") for b in blocks))
    except (ssl.SSLError, TypeError) as error:
        reason = error.reason if isinstance(error, ssl.SSLError) else None
        raise ValueError(
            f"ca_file {ca_file} holds no usable PEM CA certificate ({reason or error})"
        ) from None


def check_certificate_and_key(cert_file: str | Path, key_file: str | Path) -> None:
    """Refuse a client certificate and key that are not PEM, or not a pair."""

    def refuse_encrypted_key() -> bytes:
        # NOTE: without a callback OpenSSL would prompt on the terminal for a password.
        raise ValueError(f"key_file {key_file} is encrypted: gRPC needs an unencrypted PEM key")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert_file, key_file, password=refuse_encrypted_key)
    except ssl.SSLError as error:
        raise ValueError(
            f"cert_file {cert_file} and key_file {key_file} are not a PEM certificate "
            f"and its private key ({error.reason or error})"
        ) from None


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The header that carries `api_key` (None: no key), without the whitespace around
    it, as the CLI sends it: a key read from a file or a variable often ends in a
    newline. A blank key, "" too, is refused rather than sent as none without a word
    (`api_key=os.environ.get("KEY", "")` with the variable unset); a key with a
    character a header value cannot hold (a newline, a non-ASCII letter) is refused
    here: gRPC failed such a call as INTERNAL, which says a bug."""
    if api_key is None:
        return ()
    api_key = api_key.strip()
    if not api_key:
        raise ValueError("the API key is blank: pass None to send no key")
    if not (api_key.isascii() and api_key.isprintable()):
        raise ValueError(
            "the API key holds a character a header cannot carry (not printable ASCII)"
        )
    return (("authorization", f"Bearer {api_key}"),)


def checked_batch_request_id(request_id: str) -> str:
    """A ClassifyBatch call's own request ID: it travels only as a header, where one the
    server would not accept was left out without a word (a Classify's is a request
    field, which the server refuses by name)."""
    if request_id and REQUEST_ID_PATTERN.fullmatch(request_id) is None:
        raise ValueError(
            f"request_id {request_id!r} must be letters, digits and ._:- (up to 128, "
            "starting with a letter or a digit)"
        )
    return request_id


def new_request_id() -> str:
    """A request ID for a call the caller named none for: 32 random hex digits, the
    form the server gives such calls, and as unguessable (a request ID fetches its
    result from GetResult). Made by the client so that the call's retries and polls
    share it, and an error the server never answered can still name it."""
    return os.urandom(16).hex()


def with_request_id(
    metadata: tuple[tuple[str, str], ...], request_id: str
) -> tuple[tuple[str, str], ...]:
    """`metadata` plus `x-request-id`, which names the call in the server's logs (a
    ClassifyBatch call has no request_id field of its own). An ID the server would not
    accept is left out: the server refuses it in the request's field, by name, while
    gRPC fails a metadata value outside printable ASCII before sending anything."""
    if REQUEST_ID_PATTERN.fullmatch(request_id) is None:
        return metadata
    return (*metadata, (REQUEST_ID_HEADER, request_id))


@dataclass(frozen=True)
class RequestOptions:
    """What every text of a call is classified with (the ClassifyRequest fields)."""

    top_k: int | None = None
    max_length: int | None = None
    model: str = ""
    priority: Priority = "interactive"

    def request(self, text: str, request_id: str = "", what: str = "text") -> pb.ClassifyRequest:
        """The ClassifyRequest of `text` (named `what` in an error)."""
        try:
            priority = PRIORITIES[self.priority]
        except KeyError:
            raise ValueError(
                f"priority {self.priority!r} must be one of {sorted(PRIORITIES)}"
            ) from None
        try:
            request = pb.ClassifyRequest(
                text=text, model=self.model, priority=priority, request_id=request_id
            )
        except UnicodeEncodeError as error:
            # NOTE: protobuf's own error names neither the argument nor what to do.
            fields = ((what, text), ("model", self.model), ("request_id", request_id))
            culprit = next((name for name, value in fields if value == error.object), what)
            raise ValueError(
                f"{culprit} holds {error.object[error.start]!r} at {error.start}, a lone "
                "surrogate, which UTF-8 cannot carry: the contract's strings are UTF-8"
            ) from error
        if self.top_k is not None:
            request.top_k = self.top_k
        if self.max_length is not None:
            request.max_length = self.max_length
        return request


@dataclass(frozen=True)
class BatchItem:
    """One text's outcome in a batch: its answer, or its error: the one a Classify call
    for it would have raised, or, when the ClassifyBatch call that carried it failed as
    a whole (or one before it did, so it was never sent), that call's error. Exactly
    one of the two is set."""

    response: pb.ClassifyResponse | None = None
    error: ClassifyError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def batch_item(result: pb.ClassifyBatchResult, position: int, index: int) -> BatchItem:
    """The outcome of the item at `position` in its call, which is text `index` of the
    caller's: an error names the caller's index (`items[index].text`), not the
    position in whichever call carried it."""
    if not result.HasField("error"):
        return BatchItem(response=result.response)
    error = error_from_status(result.error)
    if position != index:
        error = renumbered(error, f"items[{position}]", f"items[{index}]")
    return BatchItem(error=error)


def renumbered(error: ClassifyError, sent_as: str, caller_s: str) -> ClassifyError:
    """`error` with its field paths and message naming `caller_s` where the server,
    which saw one call, named `sent_as`."""
    error.violations = tuple(
        dataclasses.replace(v, field=caller_s + v.field.removeprefix(sent_as))
        if v.field.startswith(sent_as)
        else v
        for v in error.violations
    )
    error.message = error.message.replace(sent_as, caller_s)
    error.args = (error.message,)
    return error


def check_batch_answer(
    sent: list[int], response: pb.ClassifyBatchResponse, request_id: str
) -> None:
    """Refuse a ClassifyBatch answer without exactly one result per item `sent`, as the
    server's bug, under the call's `request_id`: the contract pairs them by position,
    so no result could be given to its item (record_batch's zip raised a bare
    ValueError, which no caller expects of a call)."""
    if len(response.results) != len(sent):
        raise InternalError(
            f"ClassifyBatch answered {len(response.results)} results for {len(sent)} "
            "items: the contract gives one per item, in order",
            code=grpc.StatusCode.INTERNAL,
            request_id=request_id,
        )


def record_batch(
    sent: list[int],
    response: pb.ClassifyBatchResponse,
    items: list[BatchItem],
    policy: RetryPolicy,
    attempt: int,
    deadline: Deadline,
) -> tuple[list[int], RetryEvent | None]:
    """Store the answers to the items `sent` (indices into `items`); return the
    indices the policy sends again within `deadline`, and the retry (the longest wait
    any of them needs), or None when none is retried. An item whose own wait does not
    fit keeps its error, and holds back none of the others: one item's 60 s pushback
    kept every item of its call from being sent again."""
    again: list[int] = []
    retry: RetryEvent | None = None
    for position, (index, result) in enumerate(zip(sent, response.results, strict=True)):
        items[index] = batch_item(result, position, index)
        error = items[index].error
        delay = None if error is None else policy.delay_before_retry(error, attempt)
        if error is None or delay is None or not deadline.allows_wait(delay):
            continue
        again.append(index)
        if retry is None or delay > retry.delay_seconds:
            retry = RetryEvent("ClassifyBatch", attempt, error, delay)
    return again, retry


def record_failed_call(
    items: list[BatchItem], indices: Iterable[int], error: ClassifyError
) -> None:
    """A ClassifyBatch call failed as a whole: it is the outcome of the items it carried,
    and of those that were never sent because of it (`indices`). The other items keep
    their answers."""
    for index in indices:
        items[index] = BatchItem(error=error)


def refused_alone(
    requests: Sequence[pb.ClassifyRequest], chunk: list[int], error: ClassifyError
) -> bool:
    """Whether `error`, which refused the call of `chunk` whole, is its one text's own:
    a text over the batch's character limit goes alone (batch_chunks), and its call is
    refused whole (INVALID_ARGUMENT by the service; RESOURCE_EXHAUSTED by gRPC itself
    past 8 MiB), but it is that item that is wrong, not the calls after it."""
    return (
        len(chunk) == 1
        and len(requests[chunk[0]].text) > BATCH_MAX_CHARS
        and error.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    )


CLIENT_CLOSED = "the client is closed: make a new one"


def client_closed(request_id: str = "") -> ValueError:
    """The error of a call on a closed client, also of one the client was closed under
    (in flight, or waiting to retry or poll), naming the `request_id` it was sent
    under. gRPC's own words for it were a ValueError or UsageError about the channel,
    or, for a call in flight, CANCELLED, which read as the server's bug."""
    error = ValueError(CLIENT_CLOSED)
    if request_id:
        error.add_note(f"the call was sent under request ID {request_id}")
    return error


def refuse_single_text(texts: Sequence[str]) -> None:
    """A str is a Sequence[str] of its characters; classifying each one is never meant."""
    if isinstance(texts, str):
        raise TypeError(
            "classify_batch takes a sequence of texts, not one str; classify() takes one text"
        )


def batch_chunks(texts: Sequence[str]) -> Iterator[list[int]]:
    """Indices of `texts` in groups that each fit one ClassifyBatch call (items and
    characters); a single text over the character limit goes alone, for the server
    to refuse by name."""
    chunk: list[int] = []
    chars = 0
    for index, text in enumerate(texts):
        size = len(text)
        if chunk and (len(chunk) == BATCH_MAX_ITEMS or chars + size > BATCH_MAX_CHARS):
            yield chunk
            chunk, chars = [], 0
        chunk.append(index)
        chars += size
    if chunk:
        yield chunk


def still_processing(response: pb.ClassifyResponse) -> StillProcessing:
    return StillProcessing(
        f"{STILL_PROCESSING}; get_result({response.request_id!r}) fetches it later",
        code=grpc.StatusCode.DEADLINE_EXCEEDED,
        request_id=response.request_id,
        trace_id=response.trace_id,
    )


def is_processing(response: pb.ClassifyResponse) -> bool:
    return response.status == pb.RESULT_STATUS_PROCESSING


# GetResult polls the asyncio client has in flight at once while following a batch.
POLLS_AT_ONCE = 16
# A last round cut short by the deadline ends this much sooner than the least time a
# poll needs: a sleep overshoots, and the poll after it found under 50 ms left and was
# not sent.
LAST_ROUND_SLACK_SECONDS = 0.01
# Up to this share of a refused poll's RetryInfo delay is added to the next round's wait
# (as RetryPolicy's pushback_jitter), so that many refused clients do not come back at
# the same instant.
POLL_PUSHBACK_JITTER = 0.2
# With no deadline, an item whose polls are refused this many times in a row ends with
# the last refusal: a call without one never waits for ever on a server that is gone.
MAX_REFUSED_POLLS = 10


class ProcessingPolls:
    """The PROCESSING answers among `items`, followed to DONE with GetResult in rounds:
    each round waits once (the poll policy's interval, growing from round to round) and
    then asks for every answer still PROCESSING. N answers thus cost one wait a round,
    not one each, and all of them share the call's deadline.

    The client does the waiting and the calls: `wait_before_next_round`, then
    `record` the outcome of a GetResult for each of `due()`, until there is no next
    round. What is still PROCESSING then (the deadline left no time for another round)
    ends as StillProcessing, with the request ID to fetch it by later.

    A poll refused for the moment (the tenant's rate, a busy front door, a server
    restarting: a retryable code, with no stored result's trace) refuses the poll,
    not the work: the result is kept, so the item stays PROCESSING and the next round
    asks again, no sooner than the longest RetryInfo delay of the round. Taken as the
    item's outcome, it made a caller read "refused" and send the text again, though
    its result came to DONE. Each poll is sent once: the rounds are the retries."""

    def __init__(self, items: list[BatchItem], poll: PollPolicy) -> None:
        self._items = items
        self._poll = poll
        self._round = 0
        self._pending = [
            index
            for index, item in enumerate(items)
            if item.response is not None and is_processing(item.response)
        ]
        # The refused polls of each item still pending since its last answered one,
        # oldest first, the last MAX_REFUSED_POLLS of them.
        self._refused: dict[int, deque[ClassifyError]] = {}
        # The longest RetryInfo delay among the polls refused in this round, jittered.
        self._pushback = 0.0

    def wait_before_next_round(self, deadline: Deadline) -> float | None:
        """Seconds to wait before the next round; None when there is none: nothing is
        PROCESSING any more, or no time is left to poll. A round whose interval would
        leave no time to poll waits only as long as leaves it: giving up there left up
        to a whole interval (a second by default) of the deadline unused, and a result
        ready in it unfetched. A server's delay that leaves no time is not shortened:
        a poll sent sooner would only be refused again; nor is one over
        MAX_RETRY_INFO_SECONDS waited out, deadline or none."""
        self._pending = [index for index in self._pending if self._processing(index)]
        if deadline.remaining() is None:
            for index in self._pending:
                refused = self._refused.get(index, ())
                if len(refused) >= MAX_REFUSED_POLLS:
                    self._items[index] = BatchItem(error=self._gave_up(index))
            self._pending = [index for index in self._pending if self._processing(index)]
        if not self._pending:
            return None
        self._round += 1
        pushback, self._pushback = self._pushback, 0.0
        # An infinite pushback is a RetryInfo delay longer than the client waits
        # (MAX_RETRY_INFO_SECONDS): no round comes after it, deadline or none.
        if math.isfinite(pushback):
            interval = max(self._poll.interval(self._round), pushback)
            if deadline.allows_wait(interval):
                return interval
            left = deadline.remaining()
            cut_short = None if left is None else left - MIN_SECONDS_FOR_A_CALL
            if cut_short is not None and cut_short - LAST_ROUND_SLACK_SECONDS > pushback:
                return cut_short - LAST_ROUND_SLACK_SECONDS
        for index in self._pending:
            self._items[index] = BatchItem(error=self._still_processing(index))
        self._pending = []
        return None

    def due(self) -> list[tuple[int, str]]:
        """(index, request ID) of each answer this round polls."""
        return [(index, self._response(index).request_id) for index in self._pending]

    @property
    def pushed_back(self) -> bool:
        """Whether a poll of this round was refused with a RetryInfo delay: the rest of
        the round is not sent (each would be refused too), and waits for the next."""
        return self._pushback > 0

    def record(self, index: int, outcome: pb.ClassifyResponse | ClassifyError) -> None:
        """The answer of one GetResult poll, or its error. A deadline that passed during
        the poll ends it as StillProcessing: the result is not lost, only late; a poll
        refused for the moment leaves it pending (see the class docstring)."""
        if isinstance(outcome, pb.ClassifyResponse):
            self._items[index] = BatchItem(response=outcome)
            self._refused.pop(index, None)
        elif outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED and not outcome.reason:
            self._items[index] = BatchItem(error=self._still_processing(index))
        elif poll_refused_for_now(outcome):
            self._refused.setdefault(index, deque(maxlen=MAX_REFUSED_POLLS)).append(outcome)
            hint = outcome.retry_after_seconds or 0.0
            delay = (
                hint * (1 + POLL_PUSHBACK_JITTER * random.random())
                if hint <= MAX_RETRY_INFO_SECONDS
                else math.inf
            )
            self._pushback = max(self._pushback, delay)
        else:
            self._items[index] = BatchItem(error=outcome)

    def _still_processing(self, index: int) -> StillProcessing:
        """The item's end at the deadline, carrying its polls' refusals, if any."""
        error = still_processing(self._response(index))
        error.attempt_errors = tuple(self._refused.pop(index, ()))
        for refused in error.attempt_errors:
            error.add_note(f"a poll was refused: {refused}")
        return error

    def _gave_up(self, index: int) -> ClassifyError:
        """The item's end after MAX_REFUSED_POLLS refused polls in a row, without a
        deadline: the last refusal, carrying the earlier ones."""
        *earlier, last = self._refused.pop(index)
        last.attempts = len(earlier) + 1
        last.attempt_errors = tuple(earlier)
        last.add_note(f"its result was polled {last.attempts} times, each refused")
        return last

    def _processing(self, index: int) -> bool:
        response = self._items[index].response
        return response is not None and is_processing(response)

    def _response(self, index: int) -> pb.ClassifyResponse:
        response = self._items[index].response
        assert response is not None, "only answered items are polled"
        return response


def poll_refused_for_now(error: ClassifyError) -> bool:
    """Whether a GetResult error refused the poll, not the work: a retryable code,
    not a stored outcome (which names its work's trace), and no RetryInfo saying
    never to ask again."""
    if error.code not in RETRYABLE_CODES or RESULT_TRACE_ID in error.metadata:
        return False
    if error.retry_after_seconds is None:
        # RESOURCE_EXHAUSTED without one is a limit the same poll meets again (gRPC's
        # message size), as RetryPolicy reads it.
        return error.code != grpc.StatusCode.RESOURCE_EXHAUSTED
    return error.retry_after_seconds >= 0

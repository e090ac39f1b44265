"""Per-request identity (request ID, trace ID), carried in a contextvar.

The server interceptor sets it when a call arrives; logs, errors and outgoing
calls read it, so nothing has to pass IDs down by hand.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import time
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass

# Same rule as ClassifyRequest.request_id in the contract.
REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
REQUEST_ID_HEADER = "x-request-id"
TRACE_ID_HEADER = "x-trace-id"
# Sent by the orchestrator to capability servers, which refuse calls without it.
INTERNAL_TOKEN_HEADER = "x-internal-token"
AUTHORIZATION_HEADER = "authorization"
# What a gate sees for a credential header a call sent more than once
# (mark_repeated_credentials): a value no header can carry, so it never matches one.
REPEATED_CREDENTIAL = "\n(sent more than once)"
CREDENTIAL_HEADERS = (AUTHORIZATION_HEADER, INTERNAL_TOKEN_HEADER)
# Binary trailer on a capability server's answers: a serialized ai.classify.v1.LoadReport.
LOAD_REPORT_TRAILER = "classify-load-bin"
# Sent by the orchestrator on a ClassifyBatch call: the most bytes of early results it
# takes in the answer's initial metadata. The capability then sends the items it
# refuses while others are still to be computed (at intake or admission, or else the
# first left out at the device) when it refuses them, under EARLY_RESULTS_HEADER, as
# a serialized ai.classify.v1.ClassifyBatchResponse whose other results are empty;
# the answer still carries every item's result.
EARLY_RESULTS_REQUEST_HEADER = "classify-early-results-max-bytes"
EARLY_RESULTS_HEADER = "classify-early-results-bin"
# Sent by the orchestrator on a Classify call (a ClassifyBatch call's items carry
# theirs in ItemContext.cache_scope): the scope of the capability's result cache the
# text is looked up in and stored under, cache_scope_of(the caller's tenant), so a
# tenant's results never answer another tenant (capability.result_cache).
CACHE_SCOPE_HEADER = "classify-cache-scope"


@dataclass(frozen=True)
class RequestContext:
    request_id: str
    # 32 lowercase hex digits (W3C trace-id); empty outside a traced call.
    trace_id: str


_current: ContextVar[RequestContext | None] = ContextVar("classify_request", default=None)


def new_request_id() -> str:
    """32 random hex digits, as unguessable as a UUID4's (a request ID fetches its
    result from GetResult) without building a UUID object."""
    return os.urandom(16).hex()


def is_valid_request_id(value: str) -> bool:
    return REQUEST_ID_PATTERN.fullmatch(value) is not None


def mark_repeated_credentials(
    metadata: Sequence[tuple[str, str | bytes]], headers: dict[str, str]
) -> None:
    """Set each credential header `metadata` holds more than once to REPEATED_CREDENTIAL
    in `headers` (its keys lower-cased, the last value of each kept). Two keys are
    refused, not one picked: a proxy that checked the first and a server that used the
    last would disagree about who is calling."""
    for name in CREDENTIAL_HEADERS:
        if sum(key.lower() == name for key, _ in metadata) > 1:
            headers[name] = REPEATED_CREDENTIAL


def current_request() -> RequestContext | None:
    return _current.get()


def bind_request(context: RequestContext) -> None:
    """Make `context` the current request for this task (asyncio copies contextvars per task)."""
    _current.set(context)


# Seconds the current call had left when its handler began (None: no deadline), and
# its deadline on time.monotonic()'s clock.
_arrived_with: ContextVar[float | None] = ContextVar("classify_arrived_with", default=None)
_deadline: ContextVar[float | None] = ContextVar("classify_deadline", default=None)


def bind_time_left_on_arrival(seconds: float | None) -> None:
    _arrived_with.set(seconds)
    _deadline.set(None if seconds is None else time.monotonic() + seconds)


def time_left_on_arrival() -> float | None:
    """Seconds the current call's deadline left it when its handler began, None when it
    has no deadline (or outside a call)."""
    return _arrived_with.get()


def time_left() -> float | None:
    """Seconds the current call's deadline leaves it now (negative once past), None when
    it has no deadline (or outside a call)."""
    deadline = _deadline.get()
    return None if deadline is None else deadline - time.monotonic()


@functools.lru_cache(maxsize=1024)  # once per tenant, not per call
def cache_scope_of(tenant: str) -> str:
    """The result-cache scope of a tenant's calls: its name's SHA-256, in hex. Always
    printable ASCII of one length (a metadata value; a tenant name may be neither),
    and the capability never learns tenant names."""
    return hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()

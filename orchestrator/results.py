"""Where results that outlived their route's time budget wait for GetResult.

Only calls that answered PROCESSING (or whose client gave up first) are kept,
so a store holds the slow tail, not all traffic. A store holds at most
`capacity` entries, oldest dropped first, each for `ttl_seconds` after it was
created; an unknown, dropped or expired request ID is NOT_FOUND.

Results belong to the tenant whose call made them: a request ID names a result
only within that tenant (the authenticated caller of the call each store method
runs in, orchestrator.security.gate.current_caller). Another tenant's poll is
answered exactly as an unknown ID is, so request IDs cannot be probed across
tenants, and two tenants that pick the same request ID keep two results.

Two stores keep that contract: `LocalResultStore` in this process (the
default), and orchestrator.state.RedisResultStore, shared by every
orchestrator process that uses the same Redis, so a poll may land on any of
them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.errors import ResultNotFound, ServiceError
from orchestrator.security.gate import current_caller

DEFAULT_CAPACITY = 10_000
DEFAULT_TTL_SECONDS = 300.0


class ResultStore(Protocol):
    """Results kept for GetResult, by tenant and request ID: each method acts for
    `result_owner()`, the tenant of the call it runs in."""

    async def hold(self, request_id: str, pending: pb.ClassifyResponse) -> bool:
        """Keep a place for a result that is still being computed; False when the
        store could not take it (the caller must then answer some other way)."""
        ...

    async def finish(
        self,
        request_id: str,
        response: pb.ClassifyResponse | None = None,
        error: ServiceError | None = None,
    ) -> None:
        """Store the outcome, if a place is still held for it."""
        ...

    async def get(self, request_id: str) -> pb.ClassifyResponse:
        """The final response, PROCESSING while running; the stored error is raised;
        ResultNotFound for an unknown or expired ID."""
        ...


def result_owner() -> str:
    """The tenant the current call's results belong to.

    Read from the call's context rather than passed in: the dispatcher holds and
    finishes results in the call's own context (its background tasks copy it), and
    GetResult runs in the poller's.
    """
    return current_caller().tenant


def result_not_found(request_id: str) -> ResultNotFound:
    return ResultNotFound(
        f"no result is stored for request {request_id!r} (unknown or expired)",
        request_id=request_id,
    )


@dataclass
class _Entry:
    expires_at: float
    pending: pb.ClassifyResponse  # what GetResult says while the work runs
    response: pb.ClassifyResponse | None = None
    error: ServiceError | None = None


class LocalResultStore:
    """A ResultStore in this process's memory. Used from the event loop only."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or ttl_seconds <= 0:
            raise ValueError("the result store needs a capacity of 1 or more and a positive TTL")
        self._capacity = capacity
        self._ttl = ttl_seconds
        self._clock = clock
        # By (tenant, request ID); see result_owner.
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def hold(self, request_id: str, pending: pb.ClassifyResponse) -> bool:
        key = (result_owner(), request_id)
        self._entries.pop(key, None)
        self._entries[key] = _Entry(expires_at=self._clock() + self._ttl, pending=pending)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
            self.dropped += 1
        return True

    async def finish(
        self,
        request_id: str,
        response: pb.ClassifyResponse | None = None,
        error: ServiceError | None = None,
    ) -> None:
        entry = self._entries.get((result_owner(), request_id))
        if entry is not None:
            entry.response, entry.error = response, error

    async def get(self, request_id: str) -> pb.ClassifyResponse:
        key = (result_owner(), request_id)
        entry = self._entries.get(key)
        if entry is None or entry.expires_at <= self._clock():
            self._entries.pop(key, None)
            raise result_not_found(request_id)
        if entry.error is not None:
            raise entry.error
        return entry.response if entry.response is not None else entry.pending

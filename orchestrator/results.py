"""Where results that outlived their route's time budget wait for GetResult.

Only calls that answered PROCESSING (or whose client gave up first) are kept,
so a store holds the slow tail, not all traffic. A store holds at most
`capacity` entries, oldest dropped first, each for `ttl_seconds` after it was
created; an unknown, dropped or expired request ID is NOT_FOUND.

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

DEFAULT_CAPACITY = 10_000
DEFAULT_TTL_SECONDS = 300.0


class ResultStore(Protocol):
    """Results kept for GetResult, by request ID."""

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
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def hold(self, request_id: str, pending: pb.ClassifyResponse) -> bool:
        self._entries.pop(request_id, None)
        self._entries[request_id] = _Entry(expires_at=self._clock() + self._ttl, pending=pending)
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
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.response, entry.error = response, error

    async def get(self, request_id: str) -> pb.ClassifyResponse:
        entry = self._entries.get(request_id)
        if entry is None or entry.expires_at <= self._clock():
            self._entries.pop(request_id, None)
            raise result_not_found(request_id)
        if entry.error is not None:
            raise entry.error
        return entry.response if entry.response is not None else entry.pending

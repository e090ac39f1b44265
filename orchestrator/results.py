"""Where results that outlived their route's time budget wait for GetResult.

Only calls that answered PROCESSING (or whose client gave up first) are kept,
so a store holds the slow tail, not all traffic. A store holds at most
`capacity` entries, each for `ttl_seconds` after it was created; an unknown,
dropped or expired request ID is NOT_FOUND.

Expired entries are let go as new ones are held (not only when polled); past
the capacity, the oldest entry of the tenant holding the most goes. A tenant
that holds no more than its share (capacity / tenants holding results) thus
never loses a result to another tenant's burst of slow calls: the burst pushes
out its own oldest results.

Results belong to the tenant whose call made them: a request ID names a result
only within that tenant (the authenticated caller of the call each store method
runs in, orchestrator.security.gate.current_caller). Another tenant's poll is
answered exactly as an unknown ID is, so request IDs cannot be probed across
tenants, and two tenants that pick the same request ID keep two results.

A later call that reuses a request ID replaces the earlier one's entry, even
while the earlier one is still running: `hold` hands each call a token, and
`finish` writes only into the entry its own token names, so the earlier call's
outcome, arriving later, cannot answer a poll for the later one.

Two stores keep that contract: `LocalResultStore` in this process (the
default), and orchestrator.state.RedisResultStore, shared by every
orchestrator process that uses the same Redis, so a poll may land on any of
them.
"""

from __future__ import annotations

import secrets
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

    # The longest a `hold` may take (0 for a store in this process): a caller whose
    # answer is due at a set time starts holding this long before it.
    hold_seconds: float

    async def hold(self, request_id: str, pending: pb.ClassifyResponse) -> str | None:
        """Keep a place for a result that is still being computed, in place of any
        earlier call's under the same ID; the token that `finish` needs, or None when
        the store could not take it (the caller must then answer some other way)."""
        ...

    async def finish(
        self,
        request_id: str,
        token: str,
        response: pb.ClassifyResponse | None = None,
        error: ServiceError | None = None,
    ) -> None:
        """Store the outcome, if the place `token` names (hold's) is still held for it:
        not when it has expired, been pushed out, or been taken by a later call."""
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


def without_traceback(error: ServiceError | None) -> ServiceError | None:
    """`error` as a store keeps it: without its traceback and the exceptions it was
    raised from, whose frames hold the call's request (its text, up to 100,000
    characters, twice: as sent and as forwarded) for as long as the result is kept."""
    if error is not None:
        error.__traceback__ = error.__context__ = error.__cause__ = None
    return error


def new_hold_token() -> str:
    """The token of one call's place in a store (see ResultStore.hold)."""
    return secrets.token_hex(8)


def result_not_found(request_id: str) -> ResultNotFound:
    return ResultNotFound(
        f"no result is stored for request {request_id!r} (unknown or expired)",
        request_id=request_id,
    )


@dataclass
class _Entry:
    expires_at: float
    token: str  # the holding call's (ResultStore.hold)
    pending: pb.ClassifyResponse  # what GetResult says while the work runs
    response: pb.ClassifyResponse | None = None
    error: ServiceError | None = None


class LocalResultStore:
    """A ResultStore in this process's memory. Used from the event loop only."""

    hold_seconds = 0.0

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
        # Tenant -> request ID -> entry, each tenant's oldest first (see result_owner).
        self._by_tenant: dict[str, OrderedDict[str, _Entry]] = {}
        # Every entry's (tenant, request ID), oldest first: the expired ones lead.
        self._order: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._order)

    def held_by(self, tenant: str) -> int:
        return len(self._by_tenant.get(tenant, ()))

    async def hold(self, request_id: str, pending: pb.ClassifyResponse) -> str | None:
        tenant = result_owner()
        self._remove(tenant, request_id)
        self._drop_expired()
        token = new_hold_token()
        entry = _Entry(expires_at=self._clock() + self._ttl, token=token, pending=pending)
        self._by_tenant.setdefault(tenant, OrderedDict())[request_id] = entry
        self._order[tenant, request_id] = None
        while len(self._order) > self._capacity:
            self._remove(*self._eviction_victim())
            self.dropped += 1  # a result still kept, not an expired one
        return token

    def _drop_expired(self) -> None:
        """Let go of the expired entries, oldest first (all entries live equally long, so
        they lead): a result nobody polls would otherwise stay until the store is full."""
        now = self._clock()
        while self._order:
            tenant, request_id = next(iter(self._order))
            if self._by_tenant[tenant][request_id].expires_at > now:
                return
            self._remove(tenant, request_id)

    def _eviction_victim(self) -> tuple[str, str]:
        """The oldest entry of the tenants holding the most (the shared store's rule:
        on a tie, the tenant whose oldest entry is oldest)."""
        most = max(map(len, self._by_tenant.values()))
        tenant = min(
            (name for name, entries in self._by_tenant.items() if len(entries) == most),
            key=lambda name: next(iter(self._by_tenant[name].values())).expires_at,
        )
        return tenant, next(iter(self._by_tenant[tenant]))

    def _entry(self, tenant: str, request_id: str) -> _Entry | None:
        entries = self._by_tenant.get(tenant)
        return None if entries is None else entries.get(request_id)

    def _remove(self, tenant: str, request_id: str) -> None:
        entries = self._by_tenant.get(tenant)
        if entries is None or entries.pop(request_id, None) is None:
            return
        del self._order[tenant, request_id]
        if not entries:
            del self._by_tenant[tenant]

    async def finish(
        self,
        request_id: str,
        token: str,
        response: pb.ClassifyResponse | None = None,
        error: ServiceError | None = None,
    ) -> None:
        entry = self._entry(result_owner(), request_id)
        if entry is not None and entry.token == token:
            entry.response, entry.error = response, without_traceback(error)

    async def get(self, request_id: str) -> pb.ClassifyResponse:
        tenant = result_owner()
        entry = self._entry(tenant, request_id)
        if entry is None or entry.expires_at <= self._clock():
            self._remove(tenant, request_id)
            raise result_not_found(request_id)
        if entry.error is not None:
            raise entry.error.with_traceback(None)  # not one that grows with each poll
        return entry.response if entry.response is not None else entry.pending

"""The orchestrator's gate: authenticate the caller, refuse it while the front door is
behind (orchestrator.policy.backlog), then apply its tenant's rate limit.

It runs in the request lifecycle before validation, so a refused call reaches
no handler and no model. The authenticated caller is bound to the request
context, and its tenant replaces any `x-tenant` header the client sent, so
routes that match on the tenant cannot be steered by a spoofed header.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from contextvars import ContextVar

from classify_common.admission import RateAllowance
from classify_common.context import (
    AUTHORIZATION_HEADER,
    REPEATED_CREDENTIAL,
    time_left_on_arrival,
)
from classify_common.errors import FrontDoorBusy, RateLimited, Unauthenticated
from classify_common.nodes import current_trace
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.policy.backlog import FrontDoorBacklog
from orchestrator.security.keys import ApiKeys, Caller
from orchestrator.security.limits import RateLimits, TenantRateLimits

BEARER = "bearer "
TENANT_HEADER = "x-tenant"
# The caller when auth is switched off (development only).
ANONYMOUS = Caller(key_id="anonymous", tenant="anonymous", role="user")

_caller: ContextVar[Caller] = ContextVar("classify_caller", default=ANONYMOUS)


def current_caller() -> Caller:
    return _caller.get()


def context_of_caller(caller: Caller) -> contextvars.Context:
    """An empty context but for `caller`: for work started on a caller's behalf that must
    not see the rest of its call's state (its trace, its log line). In a context with no
    caller at all, current_caller() is ANONYMOUS, whose tenant name a keys file may give
    a real tenant: that tenant would then share what is kept per tenant (result-cache
    entries) with the work."""
    context = contextvars.Context()
    context.run(_caller.set, caller)
    return context


class CallerGate:
    """The interceptor's gate (classify_common.admission.Gate) for the front door."""

    def __init__(
        self,
        keys: ApiKeys | None,
        metrics: OrchestratorMetrics,
        limits: RateLimits | None = None,
        backlog: FrontDoorBacklog | None = None,
    ) -> None:
        """`keys` None switches authentication off (development only); `limits` None:
        the keys file's tenant limits, in this process; `backlog`, when given, refuses
        calls while calls reach the front door with their deadlines spent (before any
        tenant's tokens are spent on them)."""
        self._keys = keys
        self._backlog = backlog
        self._limits: RateLimits = (
            limits if limits is not None else TenantRateLimits(keys.tenant_limits if keys else {})
        )
        self._metrics = metrics

    def replace_keys(self, keys: ApiKeys) -> None:
        """An edit of the keys file, applied: the calls that follow are identified by its
        keys (a key it leaves out is refused from the next call on), and their tenants
        limited by its limits (RateLimits.set_limits).

        NOTE: the limits first: should setting them fail, the keys in force stay with
        their own limits, rather than the edit's keys with the old limits (the watcher
        reports the edit as refused, and the keys in force as kept)."""
        self._limits.set_limits(keys.tenant_limits)
        self._keys = keys

    def authenticate(self, method: str, metadata: Mapping[str, str]) -> str:
        try:
            caller = self._identify(metadata)
        except Unauthenticated as refused:
            self._metrics.auth_failures.labels(refused.context["cause"]).inc()
            raise
        _caller.set(caller)
        request_trace = current_trace()
        if request_trace is not None:
            # Who made the call, on its access line (neither is a secret): without them
            # a ReloadModel, or a run of calls, could not be traced to a key.
            request_trace.log_fields.update(tenant=caller.tenant, key_id=caller.key_id)
        return caller.tenant

    def identifies(self, metadata: Mapping[str, str]) -> bool:
        try:
            self._identify(metadata)
        except Unauthenticated:
            return False
        return True

    async def check_rate_limit(self, tenant: str, calls: int = 1) -> RateAllowance:
        if self._backlog is not None:
            try:
                self._backlog.admit(tenant, time_left_on_arrival())
            except FrontDoorBusy:
                self._metrics.front_door_busy.inc()  # one call, however many items
                raise
        tokens_left, granted, wait = await self._limits.try_acquire(tenant, calls)
        if granted == calls:
            return RateAllowance(tokens_left, granted)
        refusal = RateLimited(
            f"tenant {tenant!r} is over its rate limit", retry_after_seconds=wait, tenant=tenant
        )
        if granted == 0:
            # Calls refused whole, and their items: the tenant's usage (the SLO leaves
            # both out of its errors by their reason, RATE_LIMITED).
            self._metrics.rate_limited.labels(tenant).inc()
            self._metrics.rate_limited_items.labels(tenant).inc(calls)
            raise refusal
        # The items past the allowance are counted as they are answered (a repeated
        # request_id refuses an item for that instead: orchestrator.dispatch).
        return RateAllowance(tokens_left, granted, refusal)

    def _identify(self, metadata: Mapping[str, str]) -> Caller:
        if self._keys is None:
            return ANONYMOUS
        header = metadata.get(AUTHORIZATION_HEADER, "")
        if header == REPEATED_CREDENTIAL:
            raise Unauthenticated(
                "send one `authorization` header, not several", cause="repeated_key"
            )
        if not header.lower().startswith(BEARER):
            raise Unauthenticated(
                "send an API key as `authorization: Bearer <key>`", cause="missing_key"
            )
        key = header[len(BEARER) :].strip()
        if not key:
            raise Unauthenticated(
                "send an API key as `authorization: Bearer <key>`", cause="missing_key"
            )
        caller = self._keys.identify(key)
        if caller is None:
            raise Unauthenticated("the API key is not valid", cause="unknown_key")
        return caller

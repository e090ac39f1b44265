"""The orchestrator's gate: authenticate the caller, then apply its tenant's rate limit.

It runs in the request lifecycle before validation, so a refused call reaches
no handler and no model. The authenticated caller is bound to the request
context, and its tenant replaces any `x-tenant` header the client sent, so
routes that match on the tenant cannot be steered by a spoofed header.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar

from classify_common.errors import RateLimited, Unauthenticated
from orchestrator.security.keys import ApiKeys, Caller
from orchestrator.security.limits import TenantRateLimits

BEARER = "bearer "
TENANT_HEADER = "x-tenant"
# The caller when auth is switched off (development only).
ANONYMOUS = Caller(key_id="anonymous", tenant="anonymous", role="user")

_caller: ContextVar[Caller] = ContextVar("classify_caller", default=ANONYMOUS)


def current_caller() -> Caller:
    return _caller.get()


class CallerGate:
    def __init__(self, keys: ApiKeys | None) -> None:
        """`keys` None switches authentication off (development only)."""
        self._keys = keys
        self._limits = TenantRateLimits(keys.tenant_limits if keys else {})

    def __call__(self, method: str, metadata: Mapping[str, str]) -> None:
        caller = self._authenticate(metadata)
        _caller.set(caller)
        wait = self._limits.try_acquire(caller.tenant)
        if wait > 0:
            raise RateLimited(
                f"tenant {caller.tenant!r} is over its rate limit",
                retry_after_seconds=wait,
                tenant=caller.tenant,
            )

    def _authenticate(self, metadata: Mapping[str, str]) -> Caller:
        if self._keys is None:
            return ANONYMOUS
        header = metadata.get("authorization", "")
        if not header.lower().startswith(BEARER):
            raise Unauthenticated("send an API key as `authorization: Bearer <key>`")
        caller = self._keys.identify(header[len(BEARER) :].strip())
        if caller is None:
            raise Unauthenticated("the API key is not valid")
        return caller

"""Who may call the orchestrator, and how often: API keys and per-tenant rate limits."""

from orchestrator.security.gate import CallerGate
from orchestrator.security.keys import (
    ApiKeys,
    Caller,
    KeysFileError,
    hash_key,
    load_api_keys,
    new_key,
    quoted_tenant,
)
from orchestrator.security.limits import RateLimits, TenantRateLimits, TokenBucketSettings

__all__ = [
    "ApiKeys",
    "Caller",
    "CallerGate",
    "KeysFileError",
    "RateLimits",
    "TenantRateLimits",
    "TokenBucketSettings",
    "hash_key",
    "load_api_keys",
    "new_key",
    "quoted_tenant",
]

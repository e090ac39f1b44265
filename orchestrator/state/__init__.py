"""State that orchestrator processes share: results for GetResult, tenants' token buckets.

By default each process keeps both in its own memory
(orchestrator.results.LocalResultStore, orchestrator.security.TenantRateLimits):
right for one process, wrong for several, where a poll lands on a process that
never saw the call and each process grants a tenant its whole rate. With
`--state-url redis://...` both live in Redis, so every orchestrator process
that names the same Redis shares them.

    SharedState                 what the server is wired with (open_shared_state)
      results: ResultStore      LocalResultStore | RedisResultStore (results.py here)
      limits: RateLimits        TenantRateLimits | RedisRateLimits (limits.py here)
    RedisState                  one client; every command timed out, counted, and
                                skipped for a while after a failure (connection.py)

Keys, all under `classify:v1:` (v1 changes whenever a value's format does):

    classify:v1:result:<tenant>/<request id>
                                     string: one kind byte, then the payload: P (pending)
                                     or D (done) and a serialized ClassifyResponse, or E
                                     and the error as JSON; expires --results-ttl-seconds
                                     after it was held
    classify:v1:result-token:<tenant>/<request id>
                                     string: the token of the call holding that result
                                     (orchestrator.results), so only its outcome fills it;
                                     expires with the result
    classify:v1:result-process:<tenant>/<request id>
                                     string: "<token> <process ID>", the holding call's
                                     token and its process (results.py here); expires
                                     with the result; absent for an older version's results
    classify:v1:process-lease:<process ID>
                                     string: the Redis time (ms) the process's lease runs
                                     to: renewed while it lives; a pending result whose
                                     process's lease lapsed is answered "send again";
                                     expires --results-ttl-seconds after the last renewal
    classify:v1:results              sorted set of the held results' `<tenant>/<request
                                     id>` by when they were held (ms): --results-capacity
                                     bounds it
    classify:v1:results:<tenant>     the same, of one tenant's results: past the capacity,
                                     the oldest of the tenant holding the most goes
    classify:v1:results-by-tenant    sorted set of tenants by how many results they hold
    classify:v1:bucket:<tenant>      hash {tokens, updated}: the tenant's token bucket;
                                     expires once it would have refilled completely

When Redis does not answer (down, or slower than --state-timeout-ms), calls are
still answered; docs/deploy.md#shared-state-redis says how, and what is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.config import OrchestratorSettings
from orchestrator.results import LocalResultStore, ResultStore
from orchestrator.security.limits import RateLimits, TenantRateLimits, TokenBucketSettings
from orchestrator.state.connection import KEY_PREFIX, RedisState, StateMetrics
from orchestrator.state.limits import RedisRateLimits
from orchestrator.state.results import RedisResultStore

__all__ = [
    "KEY_PREFIX",
    "RedisRateLimits",
    "RedisResultStore",
    "RedisState",
    "SharedState",
    "StateMetrics",
    "open_shared_state",
]

log = logging.getLogger(__name__)


@dataclass
class SharedState:
    results: ResultStore
    limits: RateLimits
    redis: RedisState | None = None  # None: in this process

    async def close(self) -> None:
        if isinstance(self.results, RedisResultStore):
            await self.results.close()  # one more try for outcomes Redis did not take
        if self.redis is not None:
            await self.redis.close()


def open_shared_state(
    settings: OrchestratorSettings,
    tenant_limits: Mapping[str, TokenBucketSettings],
    metrics: StateMetrics,
) -> SharedState:
    """In-process state, or Redis's where --state-url names one (nothing is sent yet)."""
    if settings.state_url is None:
        return SharedState(
            LocalResultStore(settings.results_capacity, settings.results_ttl_seconds),
            TenantRateLimits(tenant_limits),
        )
    redis = RedisState.from_settings(settings, metrics)
    # While Redis does not answer, each of the processes sharing it grants its share.
    limits = RedisRateLimits(redis, tenant_limits, settings.state_processes)
    results = RedisResultStore(
        redis,
        settings.results_capacity,
        settings.results_ttl_seconds,
        retry_max_seconds=settings.state_retry_seconds,
        lease_seconds=settings.state_lease_seconds,
    )
    return SharedState(results, limits, redis)

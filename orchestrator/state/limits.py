"""Tenants' token buckets in Redis: one bucket per tenant for every orchestrator process.

A check is one server-side script (one round trip, atomic): refill the bucket
for the time since it was last touched, by Redis's own clock, take up to the
calls asked for, and keep the bucket until it would be full again anyway.

When Redis does not answer, the check falls back to this process's own bucket
for the tenant (orchestrator.security.TenantRateLimits), which holds its share
of the tenant's: 1/N of the rate and of the burst (rounded up), N being
--state-processes, the orchestrator processes that share the Redis. That
bucket is also charged for every call Redis granted this process, so a stall
does not find it full after a busy spell: with calls spread evenly, the N
processes together grant about the tenant's rate while Redis is away. The
bound, however Redis flaps: in any span of T seconds, the fallback buckets
grant at most rate x T + burst + N - 1 calls, on top of at most rate x T +
burst from Redis's bucket. A process that gets more than 1/N of a tenant's
calls refuses some sooner while Redis is away. Each such check counts as a
failed (or skipped) `rate_limit` operation. A call whose deadline leaves no time
to ask Redis takes from this process's bucket too, and Redis's bucket pays for it
at the tenant's next check: unpaid, callers choosing such deadlines had this
process's share on top of Redis's bucket whenever they liked.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from functools import partial

from classify_common.context import time_left
from classify_common.errors import StateUnavailable
from orchestrator.security.limits import (
    Grant,
    TenantRateLimits,
    TokenBucketSettings,
    seconds_until_granted,
    share_of_bucket,
)
from orchestrator.state.connection import KEY_PREFIX, RedisState, StateNotAsked

BUCKET_PREFIX = KEY_PREFIX + "bucket:"

log = logging.getLogger(__name__)

# A bucket's key lapses once it would have refilled (it starts full when next read),
# but not later than this (ms, about 317 years): Redis reads a Lua number handed to a
# command as its text (`%.17g`), which from 1e17 on is `1e+17`, no integer to
# PEXPIRE. A tenant of a tiny rate that had spent a large burst (10^6 calls at one
# every three years) failed every check of its bucket.
MAX_BUCKET_LAPSE_MS = 10**13
_LAPSE = f"math.min(math.ceil((burst - tokens) / rate * 1000) + 1000, {MAX_BUCKET_LAPSE_MS})"

# KEYS[1] the bucket. ARGV: rate (tokens/s), burst, calls. Returns {calls granted,
# tokens left as text} (a Lua number would come back truncated to an integer).
_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local calls = tonumber(ARGV[3])
local now = redis.call('TIME')
local now_s = tonumber(now[1]) + tonumber(now[2]) / 1000000
local bucket = redis.call('HMGET', KEYS[1], 'tokens', 'updated')
local tokens = tonumber(bucket[1])
local updated = tonumber(bucket[2])
if tokens == nil or updated == nil then
  tokens = burst
  updated = now_s
end
tokens = math.min(burst, tokens + math.max(0, now_s - updated) * rate)
local granted = math.min(calls, math.floor(tokens))
tokens = tokens - granted
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'updated', tostring(now_s))
redis.call('PEXPIRE', KEYS[1], LAPSE)
return {granted, tostring(tokens)}
""".replace("LAPSE", _LAPSE)

# KEYS[1] the bucket. ARGV: the limit before an edit of the keys file (rate, burst),
# the limit after it (rate, burst). The bucket refilled up to now at the limit before,
# capped at the new burst, and kept until the new limit would fill it: kept as the
# limit before set it, the key could lapse first, and the next check found a full
# bucket (a rate cut from 100 to 0.01 a second granted 100 calls 2 s later). A
# bucket that has lapsed already was full anyway: the next check starts it full.
_REBASE = """
local bucket = redis.call('HMGET', KEYS[1], 'tokens', 'updated')
local tokens = tonumber(bucket[1])
local updated = tonumber(bucket[2])
if tokens == nil or updated == nil then
  return 0
end
local before_rate = tonumber(ARGV[1])
local before_burst = tonumber(ARGV[2])
local rate = tonumber(ARGV[3])
local burst = tonumber(ARGV[4])
local now = redis.call('TIME')
local now_s = tonumber(now[1]) + tonumber(now[2]) / 1000000
tokens = math.min(before_burst, tokens + math.max(0, now_s - updated) * before_rate)
tokens = math.min(burst, tokens)
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'updated', tostring(now_s))
redis.call('PEXPIRE', KEYS[1], LAPSE)
return 1
""".replace("LAPSE", _LAPSE)


class RedisRateLimits:
    """RateLimits (orchestrator.security.limits) whose buckets live in Redis."""

    def __init__(
        self, state: RedisState, limits: Mapping[str, TokenBucketSettings], sharers: int
    ) -> None:
        """`sharers`: the orchestrator processes that share the Redis (--state-processes);
        while Redis does not answer, this one grants its share of each tenant's bucket
        (share_of_bucket)."""
        self._state = state
        self._sharers = sharers
        self._limits = dict(limits)
        self._fallback = TenantRateLimits(self._shares(limits))
        # Per tenant: tokens the stand-in granted to calls too hurried to ask Redis
        # (StateNotAsked), which Redis's bucket pays first at the tenant's next check.
        # Unpaid, a tenant whose callers chose such deadlines had the stand-in's share
        # on top of Redis's bucket (twice its burst, in a review helper's run).
        self._owed: dict[str, int] = {}
        self._take = state.register_script(_TAKE)
        self._rebase_bucket = state.register_script(_REBASE)
        # Rebases under way after an edit, held until they end (the loop keeps only a
        # weak reference to a task).
        self._rebasing: set[asyncio.Task[None]] = set()

    def _shares(self, limits: Mapping[str, TokenBucketSettings]) -> dict[str, TokenBucketSettings]:
        return {tenant: share_of_bucket(bucket, self._sharers) for tenant, bucket in limits.items()}

    @property
    def stand_in_limits(self) -> Mapping[str, TokenBucketSettings]:
        """This process's share of each tenant's bucket, granted while Redis is away."""
        return self._fallback.limits

    def set_limits(self, limits: Mapping[str, TokenBucketSettings]) -> None:
        """Follow an edit of the keys file as TenantRateLimits.set_limits does: each
        check sends the tenant's limit with it, and the bucket of a tenant whose limit
        changed is rebased in Redis at once (_REBASE); this process's share follows.
        Every orchestrator process rebases as it applies the edit: those after the
        first refill at the limit before for the moments between them."""
        changed = {
            tenant: (before, limits[tenant])
            for tenant, before in self._limits.items()
            if tenant in limits and limits[tenant] != before
        }
        self._limits = dict(limits)
        self._fallback.set_limits(self._shares(limits))
        if changed:
            task = asyncio.get_running_loop().create_task(self._rebase(changed))
            self._rebasing.add(task)
            task.add_done_callback(self._rebasing.discard)

    async def _rebase(
        self, changed: Mapping[str, tuple[TokenBucketSettings, TokenBucketSettings]]
    ) -> None:
        for tenant, (before, after) in changed.items():
            keys = [BUCKET_PREFIX + tenant]
            args = [before.rate_per_second, before.burst, after.rate_per_second, after.burst]
            try:
                await self._state.run(
                    "rate_limit_edit", partial(self._rebase_bucket, keys=keys, args=args)
                )
            except StateUnavailable:
                # Counted as failed; the key lapses as the limit before set it.
                log.warning(
                    "a tenant's bucket was not rebased on its edited limit: Redis did not answer",
                    extra={"tenant": tenant},
                )

    async def try_acquire(self, tenant: str, calls: int = 1) -> Grant:
        settings = self._limits.get(tenant)
        if settings is None:
            return None, calls, 0.0
        keys = [BUCKET_PREFIX + tenant]
        owed = self._owed.get(tenant, 0)
        args = [settings.rate_per_second, settings.burst, owed + calls]
        try:
            taken, left = await self._state.run(
                "rate_limit", lambda: self._take(keys=keys, args=args), within=time_left()
            )
        except StateNotAsked:
            grant = self._fallback.take(tenant, calls)
            # At most a burst's worth: a debt beyond it would refuse the tenant for
            # longer than its bucket ever holds.
            self._owed[tenant] = min(owed + grant[1], math.ceil(settings.burst))
            return grant
        except StateUnavailable:
            return self._fallback.take(tenant, calls)
        # The debt first, as the calls it stood for came first.
        repaid = min(int(taken), owed)
        if repaid:
            self._owed[tenant] = owed - repaid
        granted = int(taken) - repaid
        if granted:
            self._fallback.charge(tenant, granted)
        tokens = float(left)
        if granted == calls:
            return tokens, calls, 0.0
        return tokens, granted, seconds_until_granted(tokens, calls - granted, settings)

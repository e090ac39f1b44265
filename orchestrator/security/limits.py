"""Per-tenant rate limits: one token bucket each, refilled continuously.

Two implementations keep the `RateLimits` contract: `TenantRateLimits` in this
process (the default), and orchestrator.state.RedisRateLimits, whose buckets
live in Redis, so every orchestrator process that shares it draws on one bucket
per tenant.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from classify_common.settings import spoken_number

# What a check grants: (tokens left, or None for an unlimited tenant; calls granted;
# seconds to wait before retrying the rest, 0 when all were granted).
Grant = tuple[float | None, int, float]

# Upper bounds of a tenant's limit: far above any real one (a billion calls a second,
# or at once), and low enough that a bucket's float arithmetic stays exact to a token.
# A burst past a float's range loaded, then float(burst) raised OverflowError when the
# limiter was built: a traceback at start, a half-applied edit at a reload.
MAX_RATE_PER_SECOND = 10**9
MAX_BURST = 10**9


class RateLimits(Protocol):
    async def try_acquire(self, tenant: str, calls: int = 1) -> Grant:
        """Take one token per call, as many as there are up to `calls` (a batch counts
        each item)."""
        ...

    def set_limits(self, limits: Mapping[str, TokenBucketSettings]) -> None:
        """Follow an edit of the keys file (TenantRateLimits.set_limits says how)."""
        ...


@dataclass(frozen=True)
class TokenBucketSettings:
    # Sustained calls per second: finite, > 0, at most MAX_RATE_PER_SECOND.
    rate_per_second: float
    # Calls allowed at once after a quiet spell: 1..MAX_BURST.
    burst: int

    def __post_init__(self) -> None:
        # NOTE: not `rate <= 0` alone: NaN compares false with everything, so a bucket
        # refilled at NaN a second would pass and never refuse a call.
        if not (math.isfinite(self.rate_per_second) and self.rate_per_second > 0):
            raise ValueError(
                f"rate_per_second {self.rate_per_second} must be a finite number above 0"
            )
        if self.rate_per_second > MAX_RATE_PER_SECOND:
            raise ValueError(
                f"rate_per_second {spoken_number(self.rate_per_second)} is above "
                f"{MAX_RATE_PER_SECOND}"
            )
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ValueError(f"burst {self.burst!r} must be an integer, at least 1")
        if self.burst > MAX_BURST:
            raise ValueError(f"burst {self.burst} is above {MAX_BURST}")


def share_of_bucket(settings: TokenBucketSettings, processes: int) -> TokenBucketSettings:
    """One of `processes` processes' part of a tenant's bucket: 1/N of the rate, 1/N of
    the burst rounded up (at least 1), so that N of them together grant about what the
    whole bucket does (at most N - 1 calls more of the burst)."""
    return TokenBucketSettings(
        settings.rate_per_second / processes, max(1, -(-settings.burst // processes))
    )


def seconds_until_granted(tokens: float, refused: int, settings: TokenBucketSettings) -> float:
    """How long a bucket holding `tokens` takes to hold a token for each of `refused`
    calls, up to its burst: the retry-after hint. Not the time to the next token: a
    batch's refused items sent again after that got one of them served, and the rest
    refused again (the Python client's retries spent themselves in a second or two)."""
    wanted = min(refused, settings.burst)
    return max(wanted - tokens, 0.0) / settings.rate_per_second


class _Bucket:
    def __init__(self, settings: TokenBucketSettings, now: float) -> None:
        self.settings = settings
        self.tokens = float(settings.burst)
        self.updated = now

    def take(self, now: float, calls: int) -> tuple[int, float]:
        """(calls granted, one token each, up to `calls`; when fewer than `calls` were
        granted, seconds until the bucket holds a token for each refused, else 0)."""
        self.tokens = min(
            self.settings.burst, self.tokens + (now - self.updated) * self.settings.rate_per_second
        )
        self.updated = now
        granted = min(calls, int(self.tokens))
        self.tokens -= granted
        if granted == calls:
            return granted, 0.0
        return granted, seconds_until_granted(self.tokens, calls - granted, self.settings)

    def charge(self, now: float, calls: int) -> None:
        """Take a token for each of `calls` granted elsewhere, down to none left."""
        self.take(now, calls)


class TenantRateLimits:
    """Tenants without settings are not limited. Call from the event loop."""

    def __init__(
        self, limits: Mapping[str, TokenBucketSettings], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._buckets = {tenant: _Bucket(s, clock()) for tenant, s in limits.items()}

    @property
    def limits(self) -> Mapping[str, TokenBucketSettings]:
        return {tenant: bucket.settings for tenant, bucket in self._buckets.items()}

    def set_limits(self, limits: Mapping[str, TokenBucketSettings]) -> None:
        """Follow an edit of the keys file: a tenant whose limit stays keeps its bucket
        as it is; one whose limit changed keeps what its bucket held, up to the new
        burst (a lower limit holds at once, and a higher one grants no fresh burst to
        a tenant that has just spent its own); a new one starts full; one left out is
        no longer limited."""
        now = self._clock()
        buckets: dict[str, _Bucket] = {}
        for tenant, settings in limits.items():
            bucket = self._buckets.get(tenant)
            if bucket is not None and bucket.settings != settings:
                bucket.take(now, 0)  # refilled up to now at the limit it had
                held = bucket.tokens
                bucket = _Bucket(settings, now)
                bucket.tokens = min(held, float(settings.burst))
            buckets[tenant] = bucket if bucket is not None else _Bucket(settings, now)
        self._buckets = buckets

    async def try_acquire(self, tenant: str, calls: int = 1) -> Grant:
        return self.take(tenant, calls)

    def take(self, tenant: str, calls: int = 1) -> Grant:
        """try_acquire without a coroutine, for callers already on the event loop."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            return None, calls, 0.0
        granted, wait = bucket.take(self._clock(), calls)
        return bucket.tokens, granted, wait

    def charge(self, tenant: str, calls: int) -> None:
        """Draw `calls` tokens that another bucket granted (down to none left), so that
        this one, standing in for it (orchestrator.state.RedisRateLimits), starts from
        what this process has used rather than full."""
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            bucket.charge(self._clock(), calls)

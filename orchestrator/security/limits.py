"""Per-tenant rate limits: one token bucket each, refilled continuously."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenBucketSettings:
    # Sustained calls per second, > 0.
    rate_per_second: float
    # Calls allowed at once after a quiet spell, >= 1.
    burst: int

    def __post_init__(self) -> None:
        if self.rate_per_second <= 0:
            raise ValueError(f"rate_per_second {self.rate_per_second} must be above 0")
        if self.burst < 1:
            raise ValueError(f"burst {self.burst} must be at least 1")


class _Bucket:
    def __init__(self, settings: TokenBucketSettings, now: float) -> None:
        self.settings = settings
        self.tokens = float(settings.burst)
        self.updated = now

    def take(self, now: float) -> float:
        """0 when a token was taken, else the seconds until one will be there."""
        self.tokens = min(
            self.settings.burst, self.tokens + (now - self.updated) * self.settings.rate_per_second
        )
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.settings.rate_per_second


class TenantRateLimits:
    """Tenants without settings are not limited. Call from the event loop."""

    def __init__(
        self, limits: Mapping[str, TokenBucketSettings], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._buckets = {tenant: _Bucket(s, clock()) for tenant, s in limits.items()}

    def try_acquire(self, tenant: str) -> tuple[float | None, float]:
        """(tokens left after this call, or None for an unlimited tenant; seconds to wait
        before retrying, 0 when the call may go ahead)."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            return None, 0.0
        wait = bucket.take(self._clock())
        return bucket.tokens, wait

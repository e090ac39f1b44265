"""Retry policy in the vocabulary of gRPC's retry design (A6).

`max_attempts` counts the first try. Before attempt n+1 the caller waits
`random(0, min(initial_backoff · multiplier^(n-1), max_backoff))` ("full
jitter"), so retries from many clients spread out instead of arriving in
waves. Only the listed status codes are retried, never a client error.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import grpc

DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_INITIAL_BACKOFF_SECONDS = 0.025
DEFAULT_MAX_BACKOFF_SECONDS = 0.25
DEFAULT_MULTIPLIER = 2.0
DEFAULT_RETRYABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
# Codes that may be retried at all: retrying anything else either cannot help
# (a client error) or may repeat work the server already did.
RETRYABLE_CODE_CHOICES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    # Attempts including the first, 1..5.
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    # Upper bound of the first backoff, seconds, 0.001..10.
    initial_backoff_seconds: float = DEFAULT_INITIAL_BACKOFF_SECONDS
    # Cap on any backoff, seconds, >= initial, <= 60.
    max_backoff_seconds: float = DEFAULT_MAX_BACKOFF_SECONDS
    # Growth of the bound per attempt, 1..10.
    multiplier: float = DEFAULT_MULTIPLIER
    # Status codes worth another attempt; a subset of RETRYABLE_CODE_CHOICES.
    retryable_codes: frozenset[grpc.StatusCode] = field(default=DEFAULT_RETRYABLE_CODES)

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts {self.max_attempts} is outside 1..5")
        if not 0.001 <= self.initial_backoff_seconds <= 10:
            raise ValueError(f"initial_backoff {self.initial_backoff_seconds}s is outside 1ms..10s")
        if not self.initial_backoff_seconds <= self.max_backoff_seconds <= 60:
            raise ValueError("max_backoff must be at least initial_backoff and at most 60s")
        if not 1 <= self.multiplier <= 10:
            raise ValueError(f"multiplier {self.multiplier} is outside 1..10")
        unsupported = self.retryable_codes - RETRYABLE_CODE_CHOICES
        if unsupported:
            names = ", ".join(sorted(code.name for code in unsupported))
            raise ValueError(f"{names} may not be retried")

    def retries(self, code: grpc.StatusCode) -> bool:
        return code in self.retryable_codes


def backoff_seconds(policy: RetryPolicy, attempt: int, rng: random.Random | None = None) -> float:
    """Wait before attempt `attempt + 1`, after `attempt` (1-based) has failed."""
    bound = min(
        policy.initial_backoff_seconds * policy.multiplier ** (attempt - 1),
        policy.max_backoff_seconds,
    )
    return (rng or random).uniform(0, bound)

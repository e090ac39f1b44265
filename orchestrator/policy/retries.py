"""Retry policy in the vocabulary of gRPC's retry design (A6).

`max_attempts` counts the first try. Before attempt n+1 the caller waits
`random(0, min(initial_backoff · multiplier^(n-1), max_backoff))` ("full
jitter"), so retries from many clients spread out instead of arriving in
waves. Only the listed status codes are retried, never a client error.

`RetryPolicy.decide` is the whole decision after a failed attempt on one
backend: `RetryAfter(seconds)` or a `GiveUp` naming what stopped it, checked in
this order — the attempts are spent or the status is not retryable; the backend
refused at its concurrency limit (another replica of it cannot help, a fallback
may); the replica does not serve the backend's model, or did not answer within the
backend's timeout, and every replica has been tried (asked again, it answers the
same, or spends the fallback's time); every replica has been tried and the last had
no room on its device for longer (its RetryInfo) than the caller has left; the
backoff would leave the next attempt no time (it would end past the caller's
deadline less DEADLINE_SAFETY_MARGIN_SECONDS); the retry budget has no token left
(Linkerd/Envoy budgets: retries are a share of recent requests).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

import grpc

from classify_common.errors import (
    BackendTimedOut,
    ConcurrencyLimited,
    DeadlineUnreachable,
    DeviceMemoryPressure,
    ModelNotServed,
    ServiceError,
    grpc_code_for,
)
from orchestrator.policy.budget import RetryBudget

# Time kept back from the caller's deadline for the orchestrator's own work
# (answering, serialising) after the capability call returns.
DEADLINE_SAFETY_MARGIN_SECONDS = 0.02

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

    def decide(
        self,
        failure: ServiceError,
        attempt: int,
        time_left: float | None,
        budget: RetryBudget,
        rng: random.Random | None = None,
        *,
        untried_replica: bool = True,
    ) -> RetryDecision:
        """What follows attempt `attempt` (1-based, on one backend) failing with `failure`,
        `time_left` seconds before the caller's deadline (None: it set none), with a
        replica of the backend not yet tried (`untried_replica`) or none.

        A `RetryAfter` has taken its token from `budget`.
        """
        if attempt >= self.max_attempts:
            return GiveUp.ATTEMPTS_SPENT
        if not self.retries(grpc_code_for(failure)):
            return GiveUp.NOT_RETRYABLE
        if isinstance(failure, ConcurrencyLimited):
            # The whole backend is at its limit: another replica of it cannot help,
            # and waiting here only holds the caller; a fallback may.
            return GiveUp.BACKEND_AT_LIMIT
        if isinstance(failure, ModelNotServed) and not untried_replica:
            # The replica lacks the model: the same one answers the same every time,
            # so only another replica is worth a retry; without one, a fallback may.
            return GiveUp.NO_REPLICA_SERVES
        if isinstance(failure, BackendTimedOut) and not untried_replica:
            # Hung or slow past its timeout: asked again, the same replica would spend
            # the time a fallback could answer in (and the last try, cut by the
            # caller's deadline, would end in a failure no fallback may take).
            return GiveUp.NO_REPLICA_ANSWERS
        if isinstance(failure, DeadlineUnreachable) and not untried_replica:
            # The replica refused before any work: its queue is longer than the time
            # left (a route that retries DEADLINE_EXCEEDED). Asked again after a backoff,
            # with less time left, it refuses again; the fallback is what may answer.
            return GiveUp.NO_REPLICA_IN_TIME
        if (
            isinstance(failure, DeviceMemoryPressure)
            and not untried_replica
            and time_left is not None
            and failure.retry_after_seconds >= time_left
        ):
            # The replica has no room on its device (its budget, or the memory-use
            # threshold) and asked for a wait longer than the caller has left: asked
            # again before then, it refuses again, and the fallback's time is gone.
            # (Not a full queue: its hint is the whole queue's drain, and a place in it
            # frees far sooner.)
            return GiveUp.NO_ROOM_IN_TIME
        wait = backoff_seconds(self, attempt, rng)
        # Not `wait >= time_left`: a retry due inside the margin was refused unsent
        # (DEADLINE_UNREACHABLE, in place of the failure a fallback might take), after
        # taking its token from the budget.
        if time_left is not None and wait + DEADLINE_SAFETY_MARGIN_SECONDS >= time_left:
            return GiveUp.DEADLINE_TOO_NEAR
        if not budget.try_spend():
            return GiveUp.BUDGET_EXHAUSTED
        return RetryAfter(wait)


@dataclass(frozen=True)
class RetryAfter:
    """Try the backend again after this many seconds, on a replica not yet tried, or,
    once every one has been, on one tried before."""

    seconds: float


class GiveUp(enum.Enum):
    """Why a backend gets no further attempt; its failure goes to the fallbacks or the caller."""

    ATTEMPTS_SPENT = "attempts_spent"
    NOT_RETRYABLE = "not_retryable"
    BACKEND_AT_LIMIT = "backend_at_limit"
    NO_REPLICA_SERVES = "no_replica_serves"
    NO_REPLICA_ANSWERS = "no_replica_answers"
    NO_ROOM_IN_TIME = "no_room_in_time"
    NO_REPLICA_IN_TIME = "no_replica_in_time"
    DEADLINE_TOO_NEAR = "deadline_too_near"
    BUDGET_EXHAUSTED = "budget_exhausted"


RetryDecision = RetryAfter | GiveUp


def backoff_seconds(policy: RetryPolicy, attempt: int, rng: random.Random | None = None) -> float:
    """Wait before attempt `attempt + 1`, after `attempt` (1-based) has failed."""
    bound = min(
        policy.initial_backoff_seconds * policy.multiplier ** (attempt - 1),
        policy.max_backoff_seconds,
    )
    return (rng or random).uniform(0, bound)

"""RetryPolicy.decide: what follows a failed attempt on one backend, without a server."""

from __future__ import annotations

import random

import grpc

from classify_common.errors import (
    ConcurrencyLimited,
    DeadlineUnreachable,
    DeviceMemoryPressure,
    ModelNotFound,
    ModelUnavailable,
    QueueFull,
)
from orchestrator.policy import GiveUp, RetryAfter, RetryBudget, RetryBudgetSettings, RetryPolicy
from orchestrator.policy.retries import DEADLINE_SAFETY_MARGIN_SECONDS

POLICY = RetryPolicy(max_attempts=3, initial_backoff_seconds=0.1, max_backoff_seconds=0.3)
UNAVAILABLE = ModelUnavailable("replica unreachable")


def roomy_budget() -> RetryBudget:
    return RetryBudget(RetryBudgetSettings(min_retries_per_second=100))


def empty_budget() -> RetryBudget:
    return RetryBudget(RetryBudgetSettings(ratio=0, min_retries_per_second=0))


def test_retryable_failure_is_retried_after_the_jittered_backoff() -> None:
    decision = POLICY.decide(UNAVAILABLE, 2, None, roomy_budget(), random.Random(7))
    # Attempt 2 failed: the bound is 0.1 x 2 = 0.2 s, drawn from the same generator.
    assert decision == RetryAfter(random.Random(7).uniform(0, 0.2))


def test_last_attempt_gives_up_even_with_time_and_budget() -> None:
    assert POLICY.decide(UNAVAILABLE, 3, None, roomy_budget()) is GiveUp.ATTEMPTS_SPENT


def test_status_outside_the_retryable_codes_is_not_retried() -> None:
    unknown = ModelNotFound("no such model")
    assert POLICY.decide(unknown, 1, None, roomy_budget()) is GiveUp.NOT_RETRYABLE


def test_backend_at_its_concurrency_limit_is_never_retried_on_it() -> None:
    limited = ConcurrencyLimited("at the limit", retry_after_seconds=0.05)
    assert POLICY.decide(limited, 1, None, roomy_budget()) is GiveUp.BACKEND_AT_LIMIT
    # Another overload of the same code is retried: only the limit stops it.
    full = QueueFull("queue full", retry_after_seconds=0.05)
    assert isinstance(POLICY.decide(full, 1, None, roomy_budget()), RetryAfter)


def test_backoff_that_would_end_past_the_deadline_gives_up_without_spending_budget() -> None:
    budget = RetryBudget(RetryBudgetSettings(ratio=0, min_retries_per_second=0.1))
    # Any backoff drawn is >= 0, so no time left means no retry.
    assert POLICY.decide(UNAVAILABLE, 1, 0.0, budget) is GiveUp.DEADLINE_TOO_NEAR
    assert budget.try_spend()  # the one token of the floor is still there


def test_empty_retry_budget_gives_up() -> None:
    assert POLICY.decide(UNAVAILABLE, 1, 10.0, empty_budget()) is GiveUp.BUDGET_EXHAUSTED


def test_retry_takes_its_token_from_the_budget() -> None:
    budget = RetryBudget(RetryBudgetSettings(ratio=0, min_retries_per_second=0.1))
    assert isinstance(POLICY.decide(UNAVAILABLE, 1, None, budget), RetryAfter)
    assert not budget.try_spend()


def test_a_lone_replica_without_room_for_longer_than_is_left_is_not_asked_again() -> None:
    """No room on its device for 1 s, 0.2 s before the caller's deadline: asked again in
    time, the replica refuses again, and the route's fallback would get no time."""
    no_room = DeviceMemoryPressure("no room", retry_after_seconds=1.0)
    assert (
        POLICY.decide(no_room, 1, 0.2, roomy_budget(), untried_replica=False)
        is GiveUp.NO_ROOM_IN_TIME
    )
    # Another replica may have room; with more time left, so may this one.
    assert isinstance(POLICY.decide(no_room, 1, 0.2, roomy_budget()), RetryAfter)
    assert isinstance(
        POLICY.decide(no_room, 1, 5.0, roomy_budget(), untried_replica=False), RetryAfter
    )
    # A full queue's hint is its whole drain: a place frees sooner, so it is retried.
    full = QueueFull("queue full", retry_after_seconds=1.0)
    assert isinstance(
        POLICY.decide(full, 1, 0.2, roomy_budget(), untried_replica=False), RetryAfter
    )


def test_a_lone_replica_that_refused_for_its_queue_is_not_asked_again() -> None:
    """DEADLINE_UNREACHABLE is refused before any work: the replica's queue is longer
    than the time left. On a route that retries DEADLINE_EXCEEDED, the same replica
    was asked again after each backoff (five times, 0.8 s, before the fallback
    answered), refusing every time and counting each refusal as overload."""
    retrying = RetryPolicy(
        max_attempts=5,
        initial_backoff_seconds=0.1,
        max_backoff_seconds=0.4,
        retryable_codes=frozenset({grpc.StatusCode.DEADLINE_EXCEEDED}),
    )
    unreachable = DeadlineUnreachable("the queue is longer than the time left")
    assert (
        retrying.decide(unreachable, 1, 2.0, roomy_budget(), untried_replica=False)
        is GiveUp.NO_REPLICA_IN_TIME
    )
    # Another replica's queue may be shorter.
    assert isinstance(retrying.decide(unreachable, 1, 2.0, roomy_budget()), RetryAfter)


def test_a_backoff_that_would_end_inside_the_answer_margin_gives_up_without_a_token() -> None:
    """The orchestrator keeps the margin to answer: a retry due inside it was refused
    unsent (DEADLINE_UNREACHABLE, in place of the failure a fallback might have taken),
    after spending a token of the budget."""
    wait = random.Random(7).uniform(0, 0.1)  # attempt 1's bound: the initial backoff
    budget = RetryBudget(RetryBudgetSettings(ratio=0, min_retries_per_second=0.1))
    inside = wait + DEADLINE_SAFETY_MARGIN_SECONDS / 2
    assert POLICY.decide(UNAVAILABLE, 1, inside, budget, random.Random(7)) is (
        GiveUp.DEADLINE_TOO_NEAR
    )
    assert budget.try_spend()  # the one token of the floor is still there
    roomy = wait + DEADLINE_SAFETY_MARGIN_SECONDS * 2
    assert POLICY.decide(UNAVAILABLE, 1, roomy, roomy_budget(), random.Random(7)) == (
        RetryAfter(wait)
    )

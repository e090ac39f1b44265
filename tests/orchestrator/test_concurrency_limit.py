"""The adaptive concurrency limit: grows while latency holds, shrinks when it climbs,
re-measures its minimum, and spreads refused callers with its retry-after hint."""

from __future__ import annotations

import random

import pytest

from orchestrator.policy.concurrency import (
    MAX_RETRY_AFTER_SECONDS,
    AdaptiveConcurrencyLimit,
    ConcurrencySettings,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limiter(clock: Clock, **overrides: object) -> AdaptiveConcurrencyLimit:
    settings = ConcurrencySettings(**overrides)  # type: ignore[arg-type]
    return AdaptiveConcurrencyLimit(settings, clock=clock, rng=random.Random(7))


def probing(limit: AdaptiveConcurrencyLimit) -> bool:
    """Read afresh each time (a property mypy would narrow across calls)."""
    return limit.probing


def answer_window(
    limit: AdaptiveConcurrencyLimit, clock: Clock, latency: float, *, busy: bool = True
) -> None:
    """One window's worth of answered calls at `latency`, then the window closes.
    `busy`: the callers fill the limit (else one call at a time)."""
    if busy:
        held = 0
        while held < max(int(limit.limit), 10) and limit.try_acquire():
            held += 1
        for _ in range(held):
            limit.release(latency)
    else:
        for _ in range(10):
            assert limit.try_acquire()
            limit.release(latency)
    clock.now += limit.settings.window_seconds
    assert limit.try_acquire()
    limit.release(latency)


def test_refuses_past_the_limit_and_frees_slots_on_release() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=2, initial_limit=3)
    assert [limit.try_acquire() for _ in range(4)] == [True, True, True, False]
    limit.release(None)
    assert limit.try_acquire()
    assert limit.in_flight == 3


def test_grows_while_latency_stays_near_its_minimum() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8, initial_limit=16)
    for _ in range(5):
        answer_window(limit, clock, 0.010)
    # Each window adds about √limit: 16 → 20 → 24.5 → 29.4 → 34.8 → 40.7.
    assert limit.limit == pytest.approx(40.7, abs=0.5)
    assert limit.min_latency == pytest.approx(0.010)


def test_shrinks_at_most_by_half_when_latency_climbs() -> None:
    clock = Clock()
    limit = limiter(clock, initial_limit=64, latency_tolerance=2.0)
    answer_window(limit, clock, 0.010)
    grown = limit.limit
    answer_window(limit, clock, 0.100)  # 10x the minimum: gradient clamps at 0.5
    assert limit.limit == pytest.approx(grown * 0.5 + grown**0.5)
    for _ in range(20):
        answer_window(limit, clock, 0.100)
    assert limit.limit == limit.settings.min_limit


def test_latency_within_tolerance_does_not_shrink_it() -> None:
    clock = Clock()
    limit = limiter(clock, initial_limit=32, latency_tolerance=2.0)
    answer_window(limit, clock, 0.010)
    before = limit.limit
    answer_window(limit, clock, 0.019)  # under 2x the minimum
    assert limit.limit > before


def test_an_idle_backend_does_not_grow_it() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8, initial_limit=16)
    for _ in range(10):
        answer_window(limit, clock, 0.010, busy=False)
    assert limit.limit == 16


def test_calls_that_run_out_of_time_cut_it_whatever_their_latency() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8, initial_limit=64)
    for _ in range(20):
        assert limit.try_acquire()
    for _ in range(20):
        limit.release(None, missed_deadline=True)
    clock.now += limit.settings.window_seconds
    assert limit.try_acquire()
    limit.release(None, missed_deadline=True)
    # The misses also start a probe; once it has measured, the cut limit is back.
    assert probing(limit)
    clock.now += 0.02
    for _ in range(limit.settings.probe_samples):
        assert limit.try_acquire()
        limit.release(0.010)
    assert not probing(limit)
    assert limit.limit == pytest.approx(48)


def test_failures_do_not_move_it() -> None:
    clock = Clock()
    limit = limiter(clock, initial_limit=32)
    for _ in range(50):
        assert limit.try_acquire()
        limit.release(None)
        clock.now += 0.01
    assert limit.limit == 32
    assert limit.min_latency is None


def test_probe_holds_the_minimum_limit_and_remeasures_the_minimum() -> None:
    clock = Clock()
    limit = limiter(clock, initial_limit=32, probe_interval_seconds=1.0, probe_samples=5)
    answer_window(limit, clock, 0.050)  # a minimum measured under load
    clock.now += 2.0
    answer_window(limit, clock, 0.050)
    assert not probing(limit)  # nothing refused: no probe
    while limit.try_acquire():  # the limit is reached: a caller is refused
        pass
    clock.now += limit.settings.window_seconds
    for _ in range(int(limit.limit)):
        limit.release(0.050)  # the window closes: the refusal starts a probe
    assert probing(limit)
    assert limit.limit == limit.settings.min_limit
    held = [limit.try_acquire() for _ in range(limit.settings.min_limit + 1)]
    assert held.count(True) == limit.settings.min_limit
    clock.now += 0.010
    for _ in range(limit.settings.min_limit):
        limit.release(0.008)  # what the backend does when little is in flight
    assert not probing(limit)
    assert limit.min_latency == pytest.approx(0.008)
    assert limit.limit > limit.settings.min_limit  # back to where it was


def test_retry_after_spreads_refused_callers_over_the_answer_rate() -> None:
    clock = Clock()
    limit = limiter(clock, initial_limit=8, min_limit=8)
    # A second in which 100 calls are answered at 20 ms.
    for _ in range(10):
        for _ in range(10):
            assert limit.try_acquire()
            limit.release(0.020)
        clock.now += 0.1
    assert limit.try_acquire()
    limit.release(0.020)  # closes the hint window: 100 answers a second
    hints = [limit.retry_after_seconds() for _ in range(200)]
    # The k-th refused caller comes back after about k answers: k / 100 s, ±20%.
    assert hints[0] == pytest.approx(0.020, rel=0.25)  # at least one median latency
    assert hints[99] == pytest.approx(0.99, rel=0.25)
    assert hints[199] == pytest.approx(1.99, rel=0.25)
    # Once their hints have run out, the next refused caller waits little again.
    clock.now += 3.0
    assert limit.retry_after_seconds() <= 0.05


def test_retry_after_is_capped() -> None:
    clock = Clock()
    limit = limiter(clock)
    answer_window(limit, clock, 0.020)
    hints = [limit.retry_after_seconds() for _ in range(5000)]
    assert max(hints) <= MAX_RETRY_AFTER_SECONDS * 1.2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("latency_tolerance", 0.5),
        ("min_limit", 0),
        ("max_limit", 4),
        ("initial_limit", 2000),
        ("window_seconds", 0.001),
        ("probe_samples", 0),
    ],
)
def test_settings_out_of_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ConcurrencySettings(**{field: value})  # type: ignore[arg-type]

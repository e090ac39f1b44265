"""The adaptive concurrency limit: off until calls run out of time, then it grows
while latency holds, shrinks when it climbs, re-measures its minimum, disengages
when calm, and spreads refused callers with its retry-after hint."""

from __future__ import annotations

import random

import pytest

from orchestrator.policy.concurrency import (
    CALM_SECONDS,
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


def engaged(limit: AdaptiveConcurrencyLimit) -> bool:
    return limit.engaged


def hold(limit: AdaptiveConcurrencyLimit, calls: int) -> int:
    """Take up to `calls` slots; how many were taken."""
    held = 0
    while held < calls and limit.try_acquire():
        held += 1
    return held


def answer_window(
    limit: AdaptiveConcurrencyLimit, clock: Clock, latency: float, *, busy: bool = True
) -> None:
    """One window's worth of answered calls at `latency`, then the window closes.
    `busy`: the callers fill the limit (else one call at a time)."""
    if busy:
        for _ in range(hold(limit, max(int(limit.limit), 10))):
            limit.release(latency)
    else:
        for _ in range(10):
            assert limit.try_acquire()
            limit.release(latency)
    clock.now += limit.settings.window_seconds
    assert limit.try_acquire()
    limit.release(latency)


def run_out_of_time(limit: AdaptiveConcurrencyLimit, clock: Clock, calls: int) -> None:
    """`calls` calls in flight at once, all out of time; the window closes."""
    assert hold(limit, calls) == calls
    clock.now += limit.settings.window_seconds
    for _ in range(calls):
        limit.release(None, overloaded=True)


def engage_and_measure(
    limit: AdaptiveConcurrencyLimit, clock: Clock, calls: int, minimum: float
) -> None:
    """Overload engages the limit; its probe measures `minimum` and hands back."""
    run_out_of_time(limit, clock, calls)
    assert engaged(limit)
    assert probing(limit)
    clock.now += minimum * 2
    for _ in range(limit.settings.probe_samples):
        assert limit.try_acquire()
        limit.release(minimum)
    assert not probing(limit)


def test_not_engaged_it_refuses_nothing_below_the_maximum() -> None:
    clock = Clock()
    limit = limiter(clock, max_limit=1000)
    # A burst (a ClassifyBatch of 1,000 items) and slow answers: nobody ran out of time.
    assert hold(limit, 1000) == 1000
    assert not limit.try_acquire()
    for _ in range(1000):
        limit.release(2.0)
    for _ in range(20):
        answer_window(limit, clock, 2.0)
    assert not engaged(limit)
    assert limit.limit == 1000


def test_calls_out_of_time_engage_it_below_what_was_in_flight() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8)
    run_out_of_time(limit, clock, 200)
    assert engaged(limit)
    # It engaged at 3/4 of the 200 in flight, and its first probe holds it at the floor.
    assert probing(limit)
    assert limit.limit == 8
    clock.now += 0.02
    for _ in range(limit.settings.probe_samples):
        assert limit.try_acquire()
        limit.release(0.010)
    assert limit.limit == pytest.approx(150)
    assert limit.min_latency == pytest.approx(0.010)


def test_refuses_past_the_limit_and_frees_slots_on_release() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=2, max_limit=3)
    assert [limit.try_acquire() for _ in range(4)] == [True, True, True, False]
    limit.release(None)
    assert limit.try_acquire()
    assert limit.in_flight == 3


def test_engaged_it_grows_while_latency_stays_near_its_minimum() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8)
    engage_and_measure(limit, clock, 22, 0.010)  # engaged at 16.5
    for _ in range(5):
        answer_window(limit, clock, 0.010)
    # Each window adds about √limit: 16.5 → 20.6 → 25.1 → 30.1 → 35.6 → 41.6.
    assert limit.limit == pytest.approx(41.6, abs=0.5)


def test_engaged_it_shrinks_at_most_by_half_when_latency_climbs() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8, latency_tolerance=2.0)
    engage_and_measure(limit, clock, 100, 0.010)
    before = limit.limit
    answer_window(limit, clock, 0.100)  # 10x the minimum: the gradient clamps at 0.5
    assert limit.limit == pytest.approx(before * 0.5 + before**0.5)
    for _ in range(20):
        answer_window(limit, clock, 0.100)
    assert limit.limit == limit.settings.min_limit


def test_latency_within_tolerance_does_not_shrink_it() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8, latency_tolerance=2.0)
    engage_and_measure(limit, clock, 40, 0.010)
    before = limit.limit
    answer_window(limit, clock, 0.019)  # under 2x the minimum
    assert limit.limit > before


def test_an_idle_backend_does_not_grow_it() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8)
    engage_and_measure(limit, clock, 40, 0.010)
    before = limit.limit
    for _ in range(10):
        answer_window(limit, clock, 0.010, busy=False)
    assert limit.limit == before


def test_calls_out_of_time_cut_it_by_a_quarter_whatever_their_latency() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8, probe_interval_seconds=3600)
    engage_and_measure(limit, clock, 80, 0.010)  # engaged at 60
    run_out_of_time(limit, clock, 20)
    assert limit.limit == pytest.approx(45)


def test_calm_disengages_it() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8, max_limit=500)
    engage_and_measure(limit, clock, 40, 0.010)
    answer_window(limit, clock, 0.010)
    assert engaged(limit)
    clock.now += CALM_SECONDS
    answer_window(limit, clock, 0.010)
    assert not engaged(limit)
    assert limit.limit == 500


def test_a_burst_after_a_calm_idle_spell_meets_no_limit() -> None:
    """No answers come back while nobody calls, so no window updates it: the first
    call it would refuse after CALM_SECONDS finds it calm and disengages it."""
    clock = Clock()
    limit = limiter(clock, min_limit=8, max_limit=500)
    engage_and_measure(limit, clock, 40, 0.010)
    engaged_limit = int(limit.limit)
    assert engaged_limit < 200
    clock.now += CALM_SECONDS / 2
    # Still within the calm period: the limit holds, and the refusal is a new sign.
    assert hold(limit, 200) == engaged_limit
    for _ in range(engaged_limit):
        limit.release(0.010)
    assert engaged(limit)
    clock.now += CALM_SECONDS
    assert hold(limit, 200) == 200
    assert not engaged(limit)
    assert limit.limit == 500


def test_failures_do_not_move_it() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8)
    engage_and_measure(limit, clock, 40, 0.010)
    before = limit.limit
    for _ in range(50):
        assert limit.try_acquire()
        limit.release(None)
        clock.now += 0.01
    assert limit.limit == before


def test_probe_samples_only_calls_sent_during_it() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8, probe_samples=5)
    assert hold(limit, 40) == 40  # sent before the probe
    run_out_of_time(limit, clock, 20)
    assert probing(limit)
    clock.now += 0.010
    for _ in range(40):
        limit.release(0.500)  # the old calls come back slowly: not the minimum
    assert probing(limit)
    for _ in range(5):
        assert limit.try_acquire()
        limit.release(0.008)
    assert not probing(limit)
    assert limit.min_latency == pytest.approx(0.008)


def test_retry_after_spreads_refused_callers_over_the_answer_rate() -> None:
    clock = Clock()
    limit = limiter(clock, min_limit=8, max_limit=8)
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
        ("window_seconds", 0.001),
        ("probe_samples", 0),
    ],
)
def test_settings_out_of_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ConcurrencySettings(**{field: value})  # type: ignore[arg-type]

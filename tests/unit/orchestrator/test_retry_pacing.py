"""Retry-after hints: refused callers get return times one after another at the rate
calls get through, spaced wider while the refused outnumber the retry budget (callers
who were answered take the freed slots first, so the plain spacing only sends the
refused back to be refused), and drawn from the cap's second half once every return
time up to the cap is taken."""

from __future__ import annotations

import random

import pytest

from orchestrator.policy.pacing import MAX_STRETCH, STRETCH_DECAY, STRETCH_STEP, RetryPacer

MAX_SECONDS = 5.0
FLOOR = 0.02


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pacer(clock: Clock, budget: float | None) -> RetryPacer:
    return RetryPacer(
        clock=clock,
        rng=random.Random(3),
        jitter=0.0,  # exact hints
        max_seconds=MAX_SECONDS,
        min_elapsed_seconds=0.1,
        max_refused_per_pass=budget,
    )


def window(pacers: list[RetryPacer], clock: Clock, passed: int, refused: int) -> list[list[float]]:
    """One second in which `passed` calls get through, then `refused` callers are
    refused (the same for every pacer); the hints each pacer gave, in order."""
    for _ in range(passed):
        for p in pacers:
            p.count()
        clock.now += 0.9 / passed
    hints: list[list[float]] = [[] for _ in pacers]
    for _ in range(refused):
        for p, given in zip(pacers, hints, strict=True):
            given.append(p.hint(FLOOR))
    clock.now += 0.1
    return hints


def gap(hints: list[float]) -> float:
    """Seconds between the return times of the last two callers refused in a row."""
    return hints[-1] - hints[-2]


def test_refused_callers_come_back_one_after_another_at_the_rate_of_calls() -> None:
    clock = Clock()
    plain = pacer(clock, None)
    window([plain], clock, 100, 0)
    [hints] = window([plain], clock, 100, 50)
    assert hints[0] == pytest.approx(FLOOR)
    assert gap(hints) == pytest.approx(1 / 100)  # 100 calls a second got through
    # Once the return times given have passed, the next refused caller waits the floor.
    clock.now += 2.0
    [[hint]] = window([plain], clock, 100, 1)
    assert hint == pytest.approx(FLOOR)


def test_the_spacing_doubles_a_window_while_refusals_exceed_the_budget() -> None:
    clock = Clock()
    budgeted, plain = pacer(clock, 0.2), pacer(clock, None)
    # Closed-loop overload: 50 refused for every 100 that get through, 0.5 > 0.2.
    window([budgeted, plain], clock, 100, 50)
    for stretch in (STRETCH_STEP, STRETCH_STEP**2, STRETCH_STEP**3):
        with_budget, without = window([budgeted, plain], clock, 100, 50)
        assert budgeted.stretch == stretch
        assert gap(with_budget) == pytest.approx(stretch / 100)
        assert gap(without) == pytest.approx(1 / 100)
        assert plain.stretch == 1.0


def test_past_the_cap_return_times_are_drawn_from_its_second_half() -> None:
    clock = Clock()
    budgeted = pacer(clock, 0.2)
    hints = [h for _ in range(12) for h in window([budgeted], clock, 100, 400)[0]]
    assert budgeted.stretch == MAX_STRETCH
    assert max(hints) <= MAX_SECONDS
    full = [h for h in hints[-400:] if h >= MAX_SECONDS / 2]
    assert len(full) > 350  # nearly all of the last window's callers found no time free
    # Spread over the second half, not piled at the cap.
    assert min(full) < 0.6 * MAX_SECONDS
    assert max(full) > 0.9 * MAX_SECONDS


def test_a_slow_spell_books_no_return_times_far_past_the_cap() -> None:
    """One call a second gets through while callers are refused: stretched 64 times,
    each refused caller would book 64 s of return times. Booked that far ahead,
    refused callers would be sent to the cap's second half for a minute after calls
    came back; a caller's spacing is at most the cap, so 11 s after the slow spell a
    refused caller waits the floor again."""
    clock = Clock()
    budgeted = pacer(clock, 0.2)
    for _ in range(8):
        window([budgeted], clock, 1, 50)
    assert budgeted.stretch == MAX_STRETCH
    for _ in range(12):  # a refusal a second, until one books a time past the cap
        window([budgeted], clock, 1, 1)
    for _ in range(11):
        window([budgeted], clock, 100, 0)
    [[hint]] = window([budgeted], clock, 100, 1)
    assert hint == pytest.approx(FLOOR)


def test_within_the_budget_the_stretch_shrinks_back_to_the_spacing() -> None:
    clock = Clock()
    budgeted, plain = pacer(clock, 0.2), pacer(clock, None)
    for _ in range(4):
        window([budgeted, plain], clock, 100, 50)
    # 10 refused per 100 that get through, within a budget of 20 (the first of these
    # windows still closes the last overloaded one).
    window([budgeted, plain], clock, 100, 10)
    stretched = budgeted.stretch
    assert stretched == STRETCH_STEP**4
    window([budgeted, plain], clock, 100, 10)
    assert budgeted.stretch == pytest.approx(stretched * STRETCH_DECAY)
    for _ in range(30):
        with_budget, without = window([budgeted, plain], clock, 100, 10)
    assert budgeted.stretch == 1.0
    assert with_budget == pytest.approx(without)


def test_an_idle_window_forgets_the_stretch() -> None:
    clock = Clock()
    budgeted = pacer(clock, 0.2)
    for _ in range(4):
        window([budgeted], clock, 100, 50)
    assert budgeted.stretch > 1.0
    clock.now += 10.0  # the overload is over: nothing for ten seconds
    window([budgeted], clock, 100, 0)
    assert budgeted.stretch == 1.0


@pytest.mark.parametrize("budget", [0.0, -1.0])
def test_a_budget_must_be_positive(budget: float) -> None:
    with pytest.raises(ValueError, match="max_refused_per_pass"):
        pacer(Clock(), budget)


def test_jittered_hints_stay_within_the_cap() -> None:
    """Jittered after the cap, hints said up to 1.2 times the documented longest."""
    clock = Clock()
    jittered = RetryPacer(
        clock=clock,
        rng=random.Random(5),
        jitter=0.2,
        max_seconds=MAX_SECONDS,
        min_elapsed_seconds=0.1,
        max_refused_per_pass=0.2,
    )
    # No call has got through: the wait asked for is past the cap.
    idle = [jittered.hint(FLOOR, without_rate=30.0) for _ in range(200)]
    assert max(idle) <= MAX_SECONDS
    # Spread below it, not piled at it: callers told one time come back together.
    assert min(idle) < 0.9 * MAX_SECONDS
    assert sum(hint == MAX_SECONDS for hint in idle) < 5
    hints = [h for _ in range(12) for h in window([jittered], clock, 100, 400)[0]]
    assert max(hints) <= MAX_SECONDS
    assert max(hints) > 0.9 * MAX_SECONDS

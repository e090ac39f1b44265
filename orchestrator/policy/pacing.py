"""Retry-after hints that spread refused callers over the rate calls get through.

The adaptive concurrency limit and the front door's backlog both refuse callers
who will come back, and told the same delay they would come back together. A
pacer counts the calls that get through (over the last whole window, else the
current one) and the refused callers still waiting out their hints, and tells
the next refused caller to come back after about as many calls as wait ahead of
it: waiting / rate seconds, within a floor and a cap, jittered.

All methods run on the event loop thread.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

# Seconds over which calls that got through are counted.
WINDOW_SECONDS = 1.0


class RetryPacer:
    def __init__(
        self,
        *,
        clock: Callable[[], float],
        rng: random.Random,
        jitter: float,
        max_seconds: float,
        min_elapsed_seconds: float,
    ) -> None:
        """`jitter`: hints are drawn from ±this share around their value;
        `min_elapsed_seconds`: the shortest span a first window's rate is taken over."""
        self._clock = clock
        self._rng = rng
        self._jitter = jitter
        self._max_seconds = max_seconds
        self._min_elapsed = min_elapsed_seconds
        # When each refused caller's hint runs out (a heap).
        self._waiting_out: list[float] = []
        self._window_ends = clock() + WINDOW_SECONDS
        self._counted_now = self._counted_last = 0

    def count(self) -> None:
        """One call got through."""
        self._roll(self._clock())
        self._counted_now += 1

    def hint(self, floor: float, *, without_rate: float | None = None) -> float:
        """Seconds the caller refused now should wait: at least `floor`; `without_rate`
        (default `floor`) while no call has got through lately."""
        now = self._clock()
        self._roll(now)
        waiting = self._waiting_out
        while waiting and waiting[0] <= now:
            heapq.heappop(waiting)
        rate = self._rate(now)
        if rate > 0:
            spread = len(waiting) / rate
        else:
            spread = floor if without_rate is None else without_rate
        hint = min(max(spread, floor), self._max_seconds)
        hint *= self._rng.uniform(1 - self._jitter, 1 + self._jitter)
        heapq.heappush(waiting, now + hint)
        return hint

    def _roll(self, now: float) -> None:
        if now < self._window_ends:
            return
        stale = now - self._window_ends >= WINDOW_SECONDS
        self._counted_last = 0 if stale else self._counted_now
        self._counted_now = 0
        self._window_ends = now + WINDOW_SECONDS

    def _rate(self, now: float) -> float:
        """Calls a second: over the last window, else the current one."""
        if self._counted_last:
            return self._counted_last / WINDOW_SECONDS
        elapsed = now - (self._window_ends - WINDOW_SECONDS)
        return self._counted_now / max(elapsed, self._min_elapsed)

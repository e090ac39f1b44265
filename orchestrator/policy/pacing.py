"""Retry-after hints that spread refused callers over the rate calls get through.

The adaptive concurrency limit and the front door's backlog both refuse callers
who will come back, and told the same delay they would come back together. A
pacer counts the calls that get through (over the last whole window, else the
current one) and gives refused callers return times one after another at that
rate: the k-th caller refused in a row comes back after about k calls got
through, never sooner than a floor. Return times past the cap are full: a
caller refused then comes back at a time drawn from the cap's second half,
jittered like the rest, not all at the cap (a crowd refused in one second would
return in one second).

That spacing assumes a caller who comes back finds the slot an answer freed.
Callers who were answered call again too, and often first: then a returning
caller is refused again, and again, and the refusals (each one CPU on both
sides, taken from the backend on a small machine) run at the rate of answers
however well they are spread. With a retry budget (`max_refused_per_pass`, in
the spirit of Finagle's and Envoy's retry budgets), a window in which more
callers were refused than that share of the calls that got through doubles
the spacing (up to the cap); a window within it lets it shrink by a fifth, back
to the rate of calls; an idle one forgets the stretch.

All methods run on the event loop thread.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# Seconds over which calls that got through are counted.
WINDOW_SECONDS = 1.0
# Over the retry budget, hints grow by this factor a window, at most to
# MAX_STRETCH times the spacing; within it they shrink by STRETCH_DECAY a window.
STRETCH_STEP = 2.0
MAX_STRETCH = 64.0
STRETCH_DECAY = 0.8


class RetryPacer:
    def __init__(
        self,
        *,
        clock: Callable[[], float],
        rng: random.Random,
        jitter: float,
        max_seconds: float,
        min_elapsed_seconds: float,
        max_refused_per_pass: float | None = None,
    ) -> None:
        """`jitter`: hints are drawn from ±this share around their value;
        `min_elapsed_seconds`: the shortest span a first window's rate is taken over;
        `max_refused_per_pass`: the retry budget, refusals per call that got through
        (None: no budget, the spacing alone)."""
        if max_refused_per_pass is not None and not max_refused_per_pass > 0:
            raise ValueError(f"max_refused_per_pass {max_refused_per_pass} is not positive")
        self._clock = clock
        self._rng = rng
        self._jitter = jitter
        self._max_seconds = max_seconds
        self._min_elapsed = min_elapsed_seconds
        # The return time the next refused caller gets, unless it is past.
        self._next_return = 0.0
        self._window_ends = clock() + WINDOW_SECONDS
        self._counted_now = self._counted_last = 0
        self._budget = max_refused_per_pass
        # Refusals this window, and how far the hints are stretched past the spacing.
        self._refused_now = 0
        self.stretch = 1.0

    def count(self) -> None:
        """One call got through."""
        self._roll(self._clock())
        self._counted_now += 1

    def hint(self, floor: float, *, without_rate: float | None = None) -> float:
        """Seconds the caller refused now should wait: at least `floor`; `without_rate`
        (default `floor`) while no call has got through lately."""
        now = self._clock()
        self._roll(now)
        self._refused_now += 1
        rate = self._rate(now)
        jitter = self._rng.uniform(1 - self._jitter, 1 + self._jitter)
        if rate <= 0:
            wait = floor if without_rate is None else without_rate
            return self._jittered_within_cap(max(wait, floor), jitter)
        back = max(self._next_return, now + floor)
        if back - now > self._max_seconds:
            # Every return time up to the cap is taken.
            return self._jittered_within_cap(
                self._max_seconds * self._rng.uniform(0.5, 1.0), jitter
            )
        # One caller's spacing is at most the cap, so a slow spell (a few calls a
        # second, stretched) books return times at most one cap past the cap.
        self._next_return = back + min(self.stretch / rate, self._max_seconds)
        return self._jittered_within_cap(back - now, jitter)

    def _jittered_within_cap(self, seconds: float, jitter: float) -> float:
        """`seconds`, capped, times `jitter`, mirrored below 1 where it would pass the
        cap. Jittered after the cap, hints said up to 12 s where the documented longest
        is 10; clamped after it, half of them said the cap itself, and those callers
        came back together."""
        capped = min(seconds, self._max_seconds)
        if capped * jitter > self._max_seconds:
            jitter = 2.0 - jitter
        return capped * jitter

    def _roll(self, now: float) -> None:
        if now < self._window_ends:
            return
        stale = now - self._window_ends >= WINDOW_SECONDS
        if self._budget is not None:
            if stale:
                self.stretch = 1.0
            elif self._refused_now > self._budget * self._counted_now:
                self.stretch = min(self.stretch * STRETCH_STEP, MAX_STRETCH)
            else:
                self.stretch = max(self.stretch * STRETCH_DECAY, 1.0)
        self._counted_last = 0 if stale else self._counted_now
        self._counted_now = self._refused_now = 0
        self._window_ends = now + WINDOW_SECONDS

    def _rate(self, now: float) -> float:
        """Calls a second: over the last window, else the current one."""
        if self._counted_last:
            return self._counted_last / WINDOW_SECONDS
        elapsed = now - (self._window_ends - WINDOW_SECONDS)
        return self._counted_now / max(elapsed, self._min_elapsed)

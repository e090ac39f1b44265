"""An adaptive concurrency limit per backend: refuse the excess before spending CPU on it.

Under overload the orchestrator must not hold more calls to a backend than the
backend can answer in good time; every call beyond that only waits (in the
capability's queue, or for CPU on either event loop) and spends its caller's
deadline. The limit follows measured latency against its minimum, in the
spirit of Envoy's adaptive concurrency filter and Netflix's gradient limiter.

It engages on overload, not on load. A backend that answers its callers in
time is not limited (the limit stays at `max_limit`): a client that sends many
calls without deadlines, or a ClassifyBatch of a thousand items, has asked to
wait, and refusing part of it would only make it send again. When more than
2% of a window's calls run out of time upstream (their deadline passed, the
caller's own included; a caller that hangs up earlier is no news of the
backend) or are refused by the backend for load, the limit engages at three
quarters of the calls then in flight, and from then on:

- every `window` the median latency of the calls answered in it is compared
  with the minimum latency, and the limit becomes
  `limit · gradient + √limit`, where `gradient = clamp(tolerance · min / median,
  0.5, 1)`: it grows by √limit while latency stays within `tolerance` times the
  minimum (and callers use the limit) and shrinks, at most by half per window,
  when it does not;
- a window with more than 2% of its calls out of time cuts the limit by a
  quarter whatever the latency said: the callers' deadlines say how much
  latency they accept, and that is what decides goodput;
- the minimum is measured by a probe, at once and then every
  `probe_interval` (jittered) while calls are being refused or running out of
  time: the limit is held at `min_limit` until `probe_samples` calls sent
  during the probe have been answered, so a minimum measured under load does
  not stay the reference;
- after `CALM_SECONDS` without a refusal or a call out of time, it disengages:
  at the next window's update, or at the next call it would refuse, whichever
  comes first (after an idle spell no answers come back to update it, and the
  first burst must not meet the limit of the last overload).

A batching server's latency grows with its batch even when nothing queues, so
the minimum is measured at `min_limit` calls in flight (32 by default, enough
to fill batches), and the default tolerance is 2 (Envoy's default allows 25%).

A refused call gets a retry-after hint that spreads the refused callers over
the rate the backend answers: return times one after another, so the k-th
caller refused in a row comes back after about k answers; at least one median
latency, at most `MAX_RETRY_AFTER_SECONDS` (past it, drawn from its second
half), and jittered so refused callers do not return together.
The callers who were answered call again too, and usually take the freed slot
first; so while refusals outnumber `retry_budget` (a fifth) of the answers, the
spacing stretches (orchestrator/policy/pacing.py): on the 2-core machine each
refusal spent about a quarter of a millisecond of the orchestrator's CPU and
more of its caller's, taken from the backend's forwards.

All methods run on the event loop thread.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.policy.pacing import RetryPacer

# The longest hint. Hints this long are given only while the refused callers cannot
# all come back before it, and those who come back sooner are refused again: at
# 1,024 callers on the 2-core machine, about 960 waited; drawn from 2.5-5 s they came
# back 270 times a second, from 5-10 s 155 times, and goodput rose from 0.76-0.79 to
# 0.88-0.89 of capacity (docs/benchmark.md, 2026-12-05). A client with a deadline
# shorter than its hint is told so at once (the Python client does not wait past it).
MAX_RETRY_AFTER_SECONDS = 10.0
# The hint before any latency has been measured.
DEFAULT_RETRY_AFTER_SECONDS = 0.05
# A window's median needs this many answers; fewer, and the window runs on.
MIN_WINDOW_SAMPLES = 8
# More than this share of a window's calls ran out of time upstream: the limit is
# cut to MISSED_DEADLINE_BACKOFF of itself, whatever their latency said.
MISSED_DEADLINE_SHARE = 0.02
MISSED_DEADLINE_BACKOFF = 0.75
# Retry-after hints and probe intervals are drawn from ±this share around their value.
JITTER = 0.2
# Seconds without a refusal or a call out of time after which the limit disengages.
CALM_SECONDS = 10.0


@dataclass(frozen=True)
class ConcurrencySettings:
    """The adaptive limit of every backend (orchestrator flags `--concurrency-*`)."""

    # Off: only routes.yaml's static `max_concurrency` applies.
    adaptive: bool = True
    # Latency allowed before the limit shrinks, as a multiple of the minimum, 1..100.
    latency_tolerance: float = 2.0
    # Fewest calls allowed in flight (and the probe's limit), 1..10000. A batching
    # backend needs calls in flight to fill its batches: on the 2-core development
    # machine 32 give 0.8 of the throughput of 128, 8 only 0.45, so the limit never
    # goes below 32 by default.
    min_limit: int = 32
    # Most calls allowed in flight, min_limit..100000; the limit while not engaged.
    max_limit: int = 1024
    # Seconds between limit updates, 0.01..10.
    window_seconds: float = 0.1
    # Seconds between minimum-latency probes, 1..3600.
    probe_interval_seconds: float = 15.0
    # Answers a probe measures, 1..1000.
    probe_samples: int = 10
    # Refused callers a second per answer, over which retry-after hints stretch,
    # 0.01..100.
    retry_budget: float = 0.2
    # Processes of one --processes set, each holding its share (share_of) of a
    # backend's routes.yaml `max_concurrency`, which is for the set, 1..1024.
    processes: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.latency_tolerance <= 100:
            raise ValueError(f"latency_tolerance {self.latency_tolerance} is outside 1..100")
        if not 1 <= self.min_limit <= 10_000:
            raise ValueError(f"min_limit {self.min_limit} is outside 1..10000")
        if not self.min_limit <= self.max_limit <= 100_000:
            raise ValueError(f"max_limit {self.max_limit} is outside min_limit..100000")
        if not 0.01 <= self.window_seconds <= 10:
            raise ValueError(f"window_seconds {self.window_seconds} is outside 0.01..10")
        if not 1 <= self.probe_interval_seconds <= 3600:
            raise ValueError(
                f"probe_interval_seconds {self.probe_interval_seconds} is outside 1..3600"
            )
        if not 1 <= self.processes <= 1024:
            raise ValueError(f"processes {self.processes} is outside 1..1024")
        if not 1 <= self.probe_samples <= 1000:
            raise ValueError(f"probe_samples {self.probe_samples} is outside 1..1000")
        if not 0.01 <= self.retry_budget <= 100:
            raise ValueError(f"retry_budget {self.retry_budget} is outside 0.01..100")


class AdaptiveConcurrencyLimit:
    """One backend's limit, its calls in flight, and the latencies that move it."""

    def __init__(
        self,
        settings: ConcurrencySettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._rng = rng or random.Random()
        self.limit = float(settings.max_limit)
        # Whether overload has engaged the limit (see the module's docstring).
        self.engaged = False
        self.in_flight = 0
        # Seconds; None until the first window has been measured.
        self.min_latency: float | None = None
        self.median_latency: float | None = None
        self._window: list[float] = []
        # Calls that ran out of time upstream, and the most in flight, this window.
        self._window_misses = 0
        self._peak_in_flight = 0
        now = clock()
        self._window_ends = now + settings.window_seconds
        # The first overload starts a probe at once; the last sign of overload (a call
        # refused, or one out of time).
        self._next_probe = now
        self._last_overload = now
        # A call refused, or one that missed its deadline, since the last update.
        self._overload_seen = False
        # While probing: the limit to return to, and the probe's answers.
        self._probing_from: float | None = None
        self._probe_started = now
        self._probe: list[float] = []
        # Retry-after hints, spread over the rate calls are answered.
        self._pacer = RetryPacer(
            clock=clock,
            rng=self._rng,
            jitter=JITTER,
            max_seconds=MAX_RETRY_AFTER_SECONDS,
            min_elapsed_seconds=settings.window_seconds,
            max_refused_per_pass=settings.retry_budget,
        )

    @property
    def probing(self) -> bool:
        return self._probing_from is not None

    def _jittered(self, seconds: float) -> float:
        return seconds * self._rng.uniform(1 - JITTER, 1 + JITTER)

    def try_acquire(self) -> bool:
        """Take a slot for one call, or False when the limit is reached."""
        if self.in_flight >= int(self.limit):
            now = self._clock()
            if not (self.engaged and now - self._last_overload >= CALM_SECONDS):
                self._overload_seen = True
                self._last_overload = now
                return False
            self._disengage(now)
        self.in_flight += 1
        if self.in_flight > self._peak_in_flight:
            self._peak_in_flight = self.in_flight
        return True

    def release(self, latency: float | None, *, overloaded: bool = False) -> None:
        """Give back a slot; `latency` (seconds) when the backend answered the call,
        None when it failed or was cancelled (no sample: a fast failure is no news
        about the backend's latency). `overloaded`: the call ran out of time upstream,
        its caller's deadline passed while it waited, or the backend refused it for
        load: more calls were admitted than the backend answers in time."""
        self.in_flight -= 1
        now = self._clock()
        if overloaded:
            self._overload_seen = True
            self._last_overload = now
            self._window_misses += 1
        if latency is not None:
            self._pacer.count()
            if self._probing_from is not None:
                if latency > now - self._probe_started:
                    return  # sent before the probe, at the old limit: no news of the minimum
                self._probe.append(latency)
                if len(self._probe) >= self.settings.probe_samples:
                    self._end_probe(now)
                return
            self._window.append(latency)
        if (
            now >= self._window_ends
            and len(self._window) + self._window_misses >= MIN_WINDOW_SAMPLES
            and self._probing_from is None
        ):
            self._update(now)

    def _update(self, now: float) -> None:
        samples, misses = self._window, self._window_misses
        missing_deadlines = misses > MISSED_DEADLINE_SHARE * (len(samples) + misses)
        median = statistics.median(samples) if samples else None
        if median is not None:
            self.median_latency = median
            if self.min_latency is None or median < self.min_latency:
                # Until a probe measures it, the lowest median seen is the reference.
                self.min_latency = median
        overloaded, self._overload_seen = self._overload_seen, False
        if not self.engaged:
            if missing_deadlines:
                self.engaged = True
                self.limit = self._bounded(self._peak_in_flight * MISSED_DEADLINE_BACKOFF)
        elif now - self._last_overload >= CALM_SECONDS:
            self._disengage(now)
            return
        else:
            self.limit = self._bounded(self._next_limit(median, missing_deadlines))
        self._start_window(now)
        if self.engaged and overloaded and now >= self._next_probe:
            self._probing_from, self._probe_started = self.limit, now
            self.limit = self.settings.min_limit

    def _next_limit(self, median: float | None, missing_deadlines: bool) -> float:
        limit = self.limit
        if median is not None and self.min_latency is not None:
            tolerated = self.settings.latency_tolerance * self.min_latency
            gradient = min(max(tolerated / median, 0.5), 1.0)
            # Headroom only while callers use the limit: a limit nobody reaches
            # does not drift up to let the next burst through unmeasured.
            demand = self._peak_in_flight >= limit / 2
            limit = limit * gradient + (math.sqrt(limit) if demand else 0.0)
        if missing_deadlines:
            limit = min(limit, self.limit * MISSED_DEADLINE_BACKOFF)
        return limit

    def _disengage(self, now: float) -> None:
        """Calm again: no limit but `max_limit`, no probe, a fresh window."""
        self.engaged = False
        self.limit = float(self.settings.max_limit)
        self._probing_from = None
        self._probe.clear()
        self._overload_seen = False
        self._start_window(now)

    def _start_window(self, now: float) -> None:
        """A new window of answers, from `now`."""
        self._window.clear()
        self._window_misses = 0
        self._peak_in_flight = self.in_flight
        self._window_ends = now + self.settings.window_seconds

    def _bounded(self, limit: float) -> float:
        return min(max(limit, self.settings.min_limit), self.settings.max_limit)

    def _end_probe(self, now: float) -> None:
        assert self._probing_from is not None
        self.min_latency = statistics.median(self._probe)
        self.limit, self._probing_from = self._probing_from, None
        self._probe.clear()
        # What came back during the probe was sent before it, at the old limit.
        self._start_window(now)
        self._next_probe = now + self._jittered(self.settings.probe_interval_seconds)

    def retry_after_seconds(self) -> float:
        """The hint for a call refused now: the next return time, spaced from the last
        one given by the time between answers (stretched under the retry budget), so
        that refused callers come back about as fast as slots free up."""
        return self._pacer.hint(floor=self.median_latency or DEFAULT_RETRY_AFTER_SECONDS)


def share_of(total: int, processes: int) -> int:
    """One process's part of `total`: total / processes rounded up, at least 1."""
    return max(1, -(-total // processes))

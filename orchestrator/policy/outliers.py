"""Outlier ejection: a replica that keeps failing is taken out of rotation for a while.

After `consecutive_failures` calls in a row that it did not answer (UNAVAILABLE;
NOT_FOUND, the backend's model not served there; or out of time with no status
from it: orchestrator.upstream.coalescer's `_not_answered`), a replica is ejected
for `base_ejection · 2^(times ejected before)`, capped at `max_ejection`, and
readmitted when that time is up; a success resets its count of failures in a
row. The doubling is forgotten one step for each DOUBLING_FORGOTTEN_SECONDS a
replica stays readmitted, not at its first success: a replica that answers a
call between bouts of failures (one that crashes in a loop, or sheds most of
its load) was otherwise ejected for the base time over and over. At most
`max_ejected_percent` of a backend's replicas are out at once, and never all of
them: with every replica failing, ejecting would only turn errors into no
service at all.

A replica is one address: each pod behind a `dns:///` name counts on its own
(orchestrator.upstream.addresses says why this is not gRPC's A50 policy).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_CONSECUTIVE_FAILURES = 3
DEFAULT_BASE_EJECTION_SECONDS = 1.0
DEFAULT_MAX_EJECTION_SECONDS = 30.0
DEFAULT_MAX_EJECTED_PERCENT = 50
# The ejection time stops doubling here, whatever the cap: a replica failing for hours
# is ejected over a thousand times, and 2**1024 does not fit a float (the overflow ended
# every later failure before its ejection, and failed the call that reported it).
MAX_DOUBLINGS = 60
# One doubling forgotten per this many seconds readmitted: the interval at which
# Envoy's outlier detection and gRPC's (A50) decrement a host's ejection multiplier.
DOUBLING_FORGOTTEN_SECONDS = 10.0


@dataclass(frozen=True)
class OutlierSettings:
    # Failures in a row that eject a replica, 1..100.
    consecutive_failures: int = DEFAULT_CONSECUTIVE_FAILURES
    # First ejection, seconds, 0.001..600; doubles with each ejection.
    base_ejection_seconds: float = DEFAULT_BASE_EJECTION_SECONDS
    # Longest ejection, seconds, >= base, <= 3600.
    max_ejection_seconds: float = DEFAULT_MAX_EJECTION_SECONDS
    # Share of a backend's replicas that may be out at once, 0..100 (never all).
    max_ejected_percent: int = DEFAULT_MAX_EJECTED_PERCENT

    def __post_init__(self) -> None:
        if not 1 <= self.consecutive_failures <= 100:
            raise ValueError(f"consecutive_failures {self.consecutive_failures} is outside 1..100")
        if not 0.001 <= self.base_ejection_seconds <= 600:
            raise ValueError(f"base_ejection {self.base_ejection_seconds}s is outside 1ms..600s")
        if not self.base_ejection_seconds <= self.max_ejection_seconds <= 3600:
            raise ValueError("max_ejection must be at least base_ejection and at most 3600s")
        if not 0 <= self.max_ejected_percent <= 100:
            raise ValueError(f"max_ejected_percent {self.max_ejected_percent} is outside 0..100")


@dataclass
class _ReplicaState:
    failures_in_a_row: int = 0
    times_ejected: int = 0
    ejected_until: float = 0.0


class OutlierDetector:
    """Per-backend replica health, one replica per address; call from the event loop."""

    def __init__(
        self,
        targets: Sequence[str],
        settings: OutlierSettings,
        *,
        on_ejected: Callable[[str, float], None] = lambda target, seconds: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._states: dict[str, _ReplicaState] = {}
        self._max_ejected = 0
        self._on_ejected = on_ejected
        self._clock = clock
        self.track(targets)

    def track(self, targets: Sequence[str]) -> None:
        """Follow a new set of replicas (pods come and go behind a name): those that stay
        keep their count and ejection, new ones start clean, gone ones are forgotten."""
        self._states = {target: self._states.get(target) or _ReplicaState() for target in targets}
        # Never all: with one replica, ejection is off.
        self._max_ejected = min(
            len(targets) - 1, math.floor(len(targets) * self.settings.max_ejected_percent / 100)
        )
        # Fewer replicas may allow fewer out: those due back first are readmitted now.
        # (Kept, two of four ejected stayed out once the name held two, and then one.)
        now = self._clock()
        ejected = sorted(
            (state for state in self._states.values() if state.ejected_until > now),
            key=lambda state: state.ejected_until,
        )
        for state in ejected[: max(len(ejected) - self._max_ejected, 0)]:
            state.ejected_until = now  # readmitted now: its doublings fade from here

    def is_ejected(self, target: str) -> bool:
        return self._states[target].ejected_until > self._clock()

    # NOTE: a call to a replica that has just gone reports back after it was
    # forgotten; its outcome no longer matters.
    def record_success(self, target: str) -> None:
        state = self._states.get(target)
        if state is None:
            return
        state.failures_in_a_row = 0

    def record_failure(self, target: str) -> None:
        state = self._states.get(target)
        if state is None:
            return
        state.failures_in_a_row += 1
        if state.failures_in_a_row < self.settings.consecutive_failures or self.is_ejected(target):
            return
        ejected_now = sum(self.is_ejected(t) for t in self._states)
        if ejected_now >= self._max_ejected:
            return
        now = self._clock()
        # Never ejected: ejected_until is 0, and the difference forgets nothing it had.
        forgotten = int((now - state.ejected_until) // DOUBLING_FORGOTTEN_SECONDS)
        doublings = max(state.times_ejected - forgotten, 0)
        seconds = min(
            self.settings.base_ejection_seconds * 2.0 ** min(doublings, MAX_DOUBLINGS),
            self.settings.max_ejection_seconds,
        )
        state.ejected_until = now + seconds
        state.times_ejected = doublings + 1
        state.failures_in_a_row = 0
        self._on_ejected(target, seconds)

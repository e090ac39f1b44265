"""A retry budget, as Linkerd and Envoy define one: retries may not exceed a share
of recent requests plus a small floor, so when every replica fails, retries
cannot multiply the load on them (a retry storm).

Counts are kept in one-second buckets over a sliding window, so memory stays
constant whatever the request rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_RATIO = 0.2
DEFAULT_MIN_RETRIES_PER_SECOND = 10.0
DEFAULT_WINDOW_SECONDS = 10


@dataclass(frozen=True)
class RetryBudgetSettings:
    # Retries allowed per original request in the window, 0..1.
    ratio: float = DEFAULT_RATIO
    # Retries always allowed per second, whatever the traffic, 0..1000.
    min_retries_per_second: float = DEFAULT_MIN_RETRIES_PER_SECOND
    # Seconds of history the budget looks at, 1..300.
    window_seconds: int = DEFAULT_WINDOW_SECONDS

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio {self.ratio} is outside 0..1")
        if not 0 <= self.min_retries_per_second <= 1000:
            raise ValueError(
                f"min_retries_per_second {self.min_retries_per_second} is outside 0..1000"
            )
        if not 1 <= self.window_seconds <= 300:
            raise ValueError(f"window {self.window_seconds}s is outside 1s..300s")


class RetryBudget:
    """Shared by every route of one orchestrator; call from the event loop."""

    def __init__(
        self, settings: RetryBudgetSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self._clock = clock
        size = settings.window_seconds
        self._requests = [0] * size
        self._retries = [0] * size
        self._second = [0] * size  # which second each bucket currently counts

    def _bucket(self) -> int:
        second = int(self._clock())
        index = second % self.settings.window_seconds
        if self._second[index] != second:  # the bucket's second left the window
            self._second[index] = second
            self._requests[index] = 0
            self._retries[index] = 0
        return index

    def _live(self, counts: list[int]) -> int:
        oldest = int(self._clock()) - self.settings.window_seconds
        return sum(c for c, s in zip(counts, self._second, strict=True) if s > oldest)

    def record_request(self) -> None:
        """Count one original (first) attempt."""
        self._requests[self._bucket()] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget, or say no."""
        allowed = (
            self.settings.min_retries_per_second * self.settings.window_seconds
            + self.settings.ratio * self._live(self._requests)
        )
        if self._live(self._retries) + 1 > allowed:
            return False
        self._retries[self._bucket()] += 1
        return True

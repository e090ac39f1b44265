"""How long an upstream call of n items takes, learned from the calls a coalescer sends.

A replica's load report predicts the wait of one short text. A coalesced call
carries tens of items, and under load its answer takes the time of all of
them, so the report alone makes a busy replica look sooner free than it is.
The orchestrator cannot see inside the replica, but it sees every call it sends:
the items it carried and how long the answer took. Call time is modelled as
`a + b·n` (a fixed cost per call, and a cost per item, queueing behind the
replica's other work included), fitted by least squares with exponential
forgetting, so that it follows the replica's load from second to second.

All methods run on the event loop thread.
"""

from __future__ import annotations

# Weight kept by past calls at each new one: about the last 20 calls count.
FORGETTING = 0.95
# Below this variance of the item counts (weighted), the calls do not tell the fixed
# cost from the per-item cost apart.
MIN_COUNT_VARIANCE = 0.25


class CallTimeModel:
    """Seconds from sending a call of n items to its answer, from past calls."""

    def __init__(self) -> None:
        # Decayed sums of 1, n, n², t and n·t over the calls answered.
        self._weight = self._items = self._items_squared = 0.0
        self._seconds = self._items_seconds = 0.0
        self._fixed = self._per_item = 0.0

    def record(self, items: int, seconds: float) -> None:
        n = float(items)
        self._weight = FORGETTING * self._weight + 1.0
        self._items = FORGETTING * self._items + n
        self._items_squared = FORGETTING * self._items_squared + n * n
        self._seconds = FORGETTING * self._seconds + seconds
        self._items_seconds = FORGETTING * self._items_seconds + n * seconds
        determinant = self._weight * self._items_squared - self._items**2
        if determinant < MIN_COUNT_VARIANCE * self._weight**2:
            # The calls remembered all carried about the same count (one client's
            # calls of one item, say): a call of any size is expected to take what they
            # took. Sizes not seen yet are underestimated, which errs towards sending,
            # as the replica's report of one text's wait did; all of it per item would
            # refuse the first calls of a burst for ten times their real cost.
            self._fixed = self._seconds / self._weight
            self._per_item = 0.0
            return
        per_item = (self._weight * self._items_seconds - self._items * self._seconds) / determinant
        # Costs cannot be negative; a negative term is noise in a short history.
        self._per_item = max(per_item, 0.0)
        self._fixed = max((self._seconds - self._per_item * self._items) / self._weight, 0.0)

    def predict(self, items: int) -> float:
        """Seconds a call of `items` items is expected to take (0 before any answer)."""
        return self._fixed + self._per_item * items

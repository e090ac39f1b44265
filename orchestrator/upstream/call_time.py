"""How long an upstream call of n items takes, and how long its answer spends between
the two servers, learned from the calls a coalescer sends.

It also follows how many items the calls it sends carry: an item that
gathers behind a busy call leaves with the items that gather after it too.

A replica's load report predicts the wait of one short text. A coalesced call
carries tens of items, and under load its answer takes the time of all of
them, so the report alone makes a busy replica look sooner free than it is.
The orchestrator cannot see inside the replica, but it sees every call it sends:
the items it carried and how long the answer took. Call time is modelled as
`a + b·n` (a fixed cost per call, and a cost per item, queueing behind the
replica's other work included), fitted by least squares with exponential
forgetting, so that it follows the replica's load from second to second.

A fit ages as a load report does: the queueing it learned drains while none of
our calls is at the replica, so its prediction counts down from when the last
one came back. Without that, a fit learned under load refused every later item
on its own strength, no call went, and nothing corrected it: a fallback replica
whose forward takes a millisecond stayed predicted at 188 ms for one item, and
every call routed to it was refused for the rest of an overload phase
(docs/benchmark.md, 2026-12-05).

The trip (TripTime) is the part of a call's round trip that the replica did
not spend on it: the request's way there, the answer's way back, and the
event loops' delays at both ends. The replica's load report says how long it
spent; the rest is the trip. The coalescer gives the replica each item's time
less the trip, so that the replica does not compute an item whose answer could
only arrive after the item's own time ran out here. Without it, at 256
callers on the 2-core machine, about one computed text in ten reached the
orchestrator 0-50 ms after its item had been answered DEADLINE_EXPIRED
(docs/benchmark.md, 2026-12-02).

All methods run on the event loop thread.
"""

from __future__ import annotations

# Weight kept by past calls at each new one: about the last 20 calls count.
FORGETTING = 0.95
# The trip's smoothing, as TCP smooths round trips (RFC 6298): the weight of a new
# sample in the mean and in the mean deviation, and how many deviations above the
# mean the allowance sits.
TRIP_GAIN = 1 / 8
TRIP_DEVIATION_GAIN = 1 / 4
TRIP_DEVIATIONS = 2
# Below this variance of the item counts (weighted), the calls do not tell the fixed
# cost from the per-item cost apart.
MIN_COUNT_VARIANCE = 0.25
# The weight of each call sent in the smoothed count of items per call: it follows
# the calls of the last second or so under load, as the gathering does (a slower
# mean, over the fit's ~20 calls, did no better in the A/B of docs/benchmark.md,
# 2026-12-03).
ITEMS_PER_CALL_GAIN = 0.2


class CallTimeModel:
    """Seconds from sending a call of n items to its answer, from past calls."""

    def __init__(self) -> None:
        # Decayed sums of 1, n, n², t and n·t over the calls answered.
        self._weight = self._items = self._items_squared = 0.0
        self._seconds = self._items_seconds = 0.0
        self._fixed = self._per_item = 0.0
        self._items_per_call = 1.0

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

    def predict(self, items: int, idle_seconds: float = 0.0) -> float:
        """Seconds a call of `items` items is expected to take (0 before any answer);
        `idle_seconds`: how long no call of ours has been at the replica, counted off."""
        return max(self._fixed + self._per_item * items - idle_seconds, 0.0)

    def sent(self, items: int) -> None:
        """A call of `items` items left."""
        self._items_per_call += ITEMS_PER_CALL_GAIN * (items - self._items_per_call)

    def items_per_call(self) -> float:
        """Items the latest calls sent carried, smoothed over about the last five."""
        return self._items_per_call


class TripTime:
    """Seconds an upstream call spends outside the replica, from past calls."""

    def __init__(self) -> None:
        self._mean: float | None = None
        self._deviation = 0.0

    def record(self, round_trip: float, handled: float, longest: float) -> None:
        """A call answered after `round_trip` seconds, `handled` of them in the replica;
        no sample counts for more than `longest` (the call's own timeout): a stall of
        either process must not hold every later item's time down for long."""
        trip = min(max(round_trip - handled, 0.0), longest)
        if self._mean is None:
            self._mean, self._deviation = trip, trip / 2
            return
        self._deviation += TRIP_DEVIATION_GAIN * (abs(trip - self._mean) - self._deviation)
        self._mean += TRIP_GAIN * (trip - self._mean)

    def allowance(self) -> float:
        """Seconds to keep back from an item's time for its answer's way back (0 before
        any call reported how long it was handled)."""
        if self._mean is None:
            return 0.0
        return self._mean + TRIP_DEVIATIONS * self._deviation

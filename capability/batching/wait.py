"""How long a text admitted to a replica's queue now will wait, and whether it can wait.

Predictions come from the replica's learned service times (service_time.py),
the batches already handed to the device thread (the batcher's `running` and
`following` slots, and those of the other models sharing the device), and its
queue as it stands: the device first finishes what it was handed, the full
batches of the queue ahead of a new text drain, then the text's own batch, which
the queue's remainder joins, runs. They decide the retry-after hint of a full queue, the
refusal of a text whose deadline is shorter than the device's handed-over work
and its own batch, and the load report the capability sends with each answer.

The handed-over work counts in every prediction: nothing queued can start
before it ends, in any order the queue serves. Leaving it out made an empty
queue report no wait while the device had up to two full batches ahead of any
new text, so the orchestrator's check of the reported wait, and admission here,
let through texts that could not make their deadlines; they were left out at
the device instead, after waiting (docs/benchmark.md, 2026-12-02).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

from capability.batching.queue import RequestQueue
from capability.batching.service_time import ServiceTimeModel
from capability.batching.settings import BatchingSettings
from classify_common.errors import DeadlineUnreachable

if TYPE_CHECKING:
    from capability.batching.batcher import SubmittedBatch

# The shortest drain a full queue's retry-after hint names, seconds.
MIN_DRAIN_SECONDS = 0.001


class WaitPredictor:
    """One replica's wait predictions; `queue()` is its queue, `handed_over()` the
    batches it handed to its device thread (both its Batcher's), and `neighbours()` the
    predictors of the other replicas on that device (other models, a retiring version),
    whose handed-over batches are ahead of its texts too."""

    def __init__(
        self,
        settings: BatchingSettings,
        queue: Callable[[], RequestQueue[Any]],
        handed_over: Callable[[], tuple[SubmittedBatch | None, ...]] = tuple,
        neighbours: Callable[[], Iterable[WaitPredictor]] = tuple,
    ):
        self.settings = settings
        self.service_time = ServiceTimeModel()
        self._queue = queue
        self._handed_over = handed_over
        self._neighbours = neighbours

    def device_busy_seconds(self) -> float:
        """Time the device needs to finish the batches already handed to it, by every
        replica on it: what is left of the one computing, then those behind it."""
        now = asyncio.get_running_loop().time()
        busy = self.handed_over_seconds(now)
        for neighbour in self._neighbours():
            if neighbour is not self:
                busy += neighbour.handed_over_seconds(now)
        return busy

    def handed_over_seconds(self, now: float) -> float:
        """Time the device needs to finish this replica's batches handed to it, each by
        its predicted time (less what has passed of the one computing)."""
        busy = 0.0
        for batch in self._handed_over():
            if batch is None:
                continue
            seconds = self.service_time.predict(len(batch.requests), batch.padded_tokens)
            if batch.started_at is not None:
                seconds = max(batch.started_at + seconds - now, 0.0)
            busy += seconds
        return busy

    def drain_seconds(self, depth: int) -> float:
        """Time a queue of `depth` texts takes to drain in batches of short texts (the
        retry-after hint of a full queue)."""
        return max(self._full_batches_seconds(depth, math.ceil), MIN_DRAIN_SECONDS)

    def _full_batches_seconds(self, depth: int, count: Callable[[float], int]) -> float:
        """Time `count(depth / max_batch_size)` full batches of short texts take."""
        per_batch = self.service_time.predict(
            self.settings.max_batch_size, self.settings.length_buckets[0]
        )
        return count(depth / self.settings.max_batch_size) * per_batch

    def queue_wait_seconds(self) -> float:
        """Time a text admitted now is expected to wait before its own batch starts: the
        device's handed-over work, then the full batches of the queue ahead of it (a
        remainder smaller than a batch joins the text's own, service_seconds)."""
        depth = len(self._queue())
        ahead = self._full_batches_seconds(depth, math.floor) if depth else 0.0
        return self.device_busy_seconds() + ahead

    def service_seconds(self, tokens: int) -> float:
        """Time the batch a text of `tokens` tokens would join takes on the device."""
        bucket = self.settings.bucket_of(tokens)
        bound = max(self.settings.length_buckets[bucket], tokens)
        size = min(self._queue().depth_in_bucket(bucket) + 1, self.settings.max_batch_size)
        return self.service_time.predict(size, bound)

    def wait_seconds(self, tokens: int) -> float:
        """Time a text admitted now is expected to wait for its answer: the queue
        ahead of it, then its own batch."""
        return self.queue_wait_seconds() + self.service_seconds(tokens)

    def deadline_refusal(
        self, tokens: int, deadline: float | None, now: float, busy: float | None = None
    ) -> DeadlineUnreachable | None:
        """DeadlineUnreachable when the time left (event-loop time) is less than the
        device's handed-over work (`busy`, device_busy_seconds(), which a caller
        admitting many texts at once passes in) plus the service time predicted for
        the batch the text would join, else None.

        The queue ahead is not counted: while it stands, the queue serves the newest
        first (queue.py), so a text admitted now may go ahead of it. The handed-over
        work is ahead of it whatever happens.
        """
        if deadline is None:
            return None
        remaining = deadline - now
        if busy is None:
            busy = self.device_busy_seconds()
        predicted = busy + self.service_seconds(tokens)
        if remaining >= predicted:
            return None
        if remaining <= 0:
            message = "the deadline passed before the text reached the queue; it was not computed"
        elif busy > 0:
            message = (
                f"{remaining * 1000:.0f} ms left, but the device is busy for about "
                f"{busy * 1000:.0f} ms and the model then needs about "
                f"{(predicted - busy) * 1000:.0f} ms"
            )
        else:
            message = (
                f"{remaining * 1000:.0f} ms left, but the model needs about "
                f"{predicted * 1000:.0f} ms"
            )
        return DeadlineUnreachable(
            message,
            remaining_ms=round(remaining * 1000),
            predicted_ms=round(predicted * 1000),
        )

    def texts_that_fit(
        self, tokens: Sequence[int], deadlines: Sequence[float | None], now: float
    ) -> tuple[tuple[bool, ...], float]:
        """Which texts of a batch starting now (monotonic) go into its forward, and the
        predicted seconds of a forward of all of them.

        All go when the whole batch is predicted to end before every deadline. Else the
        forward takes the most texts it can end in time for: the k texts with the
        latest deadlines, for the largest k whose forward ends before the earliest of
        their deadlines. A batch ends later the more texts it holds, so the texts of
        one coalesced call, which share a deadline, would otherwise be left out all
        together when their batch is a little too slow for them, and the device would
        compute nothing (docs/benchmark.md, 2026-12-02: whole batches of 32 left out at
        256 callers). The texts not taken cannot end in time in any later batch either.
        """
        if not tokens:
            return (), 0.0
        whole = self.service_time.predict(len(tokens), max(tokens))
        if all(deadline is None or deadline >= now + whole for deadline in deadlines):
            return (True,) * len(tokens), whole
        # Latest deadline first; no deadline is the latest of all.
        order = sorted(
            range(len(tokens)),
            key=lambda i: math.inf if deadlines[i] is None else cast(float, deadlines[i]),
            reverse=True,
        )
        taken, padded = 0, 0
        for count, index in enumerate(order, start=1):
            padded = max(padded, tokens[index])
            deadline = deadlines[index]
            if deadline is None or deadline >= now + self.service_time.predict(count, padded):
                taken = count
        chosen = set(order[:taken])
        return tuple(i in chosen for i in range(len(tokens))), whole

"""How long a text admitted to a replica's queue now will wait, and whether it can wait.

Predictions come from the replica's learned service times (service_time.py) and
its queue as it stands: the queue ahead of a new text drains in full batches,
then the text's own batch runs. They decide the retry-after hint of a full
queue, the refusal of a text whose deadline is shorter than its own batch, and
the load report the capability sends with each answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from capability.batching.queue import RequestQueue
from capability.batching.service_time import ServiceTimeModel
from capability.batching.settings import BatchingSettings
from classify_common.errors import DeadlineUnreachable

# The shortest drain a full queue's retry-after hint names, seconds.
MIN_DRAIN_SECONDS = 0.001


class WaitPredictor:
    """One replica's wait predictions; `queue()` is its queue (made by its Batcher)."""

    def __init__(self, settings: BatchingSettings, queue: Callable[[], RequestQueue[Any]]):
        self.settings = settings
        self.service_time = ServiceTimeModel()
        self._queue = queue

    def drain_seconds(self, depth: int) -> float:
        """Time a queue of `depth` texts takes to drain in full batches of short texts."""
        full_batches = math.ceil(depth / self.settings.max_batch_size)
        per_batch = self.service_time.predict(
            self.settings.max_batch_size, self.settings.length_buckets[0]
        )
        return max(full_batches * per_batch, MIN_DRAIN_SECONDS)

    def queue_wait_seconds(self) -> float:
        """Time a text admitted now is expected to wait before its own batch starts."""
        queue = self._queue()
        return self.drain_seconds(len(queue)) if queue else 0.0

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
        self, tokens: int, deadline: float | None, now: float
    ) -> DeadlineUnreachable | None:
        """DeadlineUnreachable when the time left (event-loop time) is less than the
        service time predicted for the batch the text would join, else None."""
        if deadline is None:
            return None
        remaining = deadline - now
        predicted = self.service_seconds(tokens)
        if remaining >= predicted:
            return None
        return DeadlineUnreachable(
            f"{remaining * 1000:.0f} ms left, but the model needs about {predicted * 1000:.0f} ms"
            if remaining > 0
            else "the deadline passed before the text reached the queue; it was not computed",
            remaining_ms=round(remaining * 1000),
            predicted_ms=round(predicted * 1000),
        )

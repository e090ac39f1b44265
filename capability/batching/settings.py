"""Per-model batching settings: validated values with measured defaults."""

from __future__ import annotations

from dataclasses import dataclass

from classify_common.settings import SettingsError

# Defaults measured on a 2-core CPU machine (docs/benchmark.md).
#
# Batches of 64: in-process, a forward of 64 short texts makes about 2% more
# texts/s than one of 32, and through the front door fewer, fuller batches and
# upstream calls left more of the cores to the forwards: ClassifyBatch x64 made
# 4.6% more texts/s and 128 unary clients 4.9% more, with a lower p99; overload
# goodput was no lower (2026-12-03, alternated A/B).
#
# No window: a batch is formed only when the device is free, so under load
# requests pile up during the running forward and batches fill anyway (128
# clients, batches of up to 32: 31 texts per batch with 0 or 5 ms), while a
# 5 ms window only added 5 ms when idle (1 client: p50 24 ms with 5 ms, 17 ms
# with 0).
DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_MAX_WAIT_SECONDS = 0.0
DEFAULT_QUEUE_CAPACITY = 256
# Upper token bounds of the length buckets. A batch is formed from one bucket,
# so a text pads to at most its bucket's bound.
DEFAULT_LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class BatchingSettings:
    # Most texts in one forward pass, 1..1024.
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    # Longest the oldest queued request waits for its batch to fill, seconds, 0..1.
    max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS
    # Requests one worker may hold queued for one model, 1..100000; more are
    # refused with RESOURCE_EXHAUSTED, never buffered.
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY
    # Ascending token bounds; a text longer than the last bound joins the last bucket.
    length_buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= 1024:
            raise SettingsError(f"max_batch_size {self.max_batch_size} is outside 1..1024")
        if not 0 <= self.max_wait_seconds <= 1:
            raise SettingsError(f"max_wait_seconds {self.max_wait_seconds} is outside 0..1")
        if not 1 <= self.queue_capacity <= 100_000:
            raise SettingsError(f"queue_capacity {self.queue_capacity} is outside 1..100000")
        buckets = self.length_buckets
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise SettingsError(f"length_buckets {buckets} must be ascending positive integers")

    def bucket_of(self, tokens: int) -> int:
        """Index of the bucket a text of `tokens` tokens belongs to."""
        for index, bound in enumerate(self.length_buckets):
            if tokens <= bound:
                return index
        return len(self.length_buckets) - 1

"""Wait predictions: the queue ahead drains in full batches, then the text's own batch;
a deadline shorter than that batch is refused before the text is queued."""

from __future__ import annotations

import asyncio

import pytest

from capability.batching import BatchingSettings, RequestQueue, WaitPredictor
from capability.model import EncodedText


def short_text(tokens: int = 10) -> EncodedText:
    return EncodedText(ids=tuple(range(tokens)), truncated=False)


async def test_the_queue_ahead_drains_in_full_batches_then_the_own_batch_runs() -> None:
    settings = BatchingSettings(max_batch_size=4)
    predictor: WaitPredictor
    queue: RequestQueue[object] = RequestQueue(
        settings, retry_after=lambda depth: predictor.drain_seconds(depth)
    )
    predictor = WaitPredictor(settings, lambda: queue)
    # A batch of B short texts takes 10 ms + 1 ms per text (what the device measured).
    for size in (1, 2, 4, 8):
        predictor.service_time.record(size, 16, 0.010 + 0.001 * size)
    assert predictor.queue_wait_seconds() == 0.0
    alone = predictor.service_seconds(10)
    assert alone == pytest.approx(0.011, abs=0.001)
    for n in range(6):
        queue.admit(short_text(), priority=0, request_id=f"r{n}", deadline=None)
    # Six queued: two full batches of four (14 ms each) ahead of a new text.
    assert predictor.queue_wait_seconds() == pytest.approx(0.028, abs=0.002)
    assert predictor.wait_seconds(10) > predictor.queue_wait_seconds()


async def test_a_deadline_shorter_than_the_own_batch_is_refused() -> None:
    settings = BatchingSettings()
    queue: RequestQueue[object] = RequestQueue(settings, retry_after=lambda depth: 0.01)
    predictor = WaitPredictor(settings, lambda: queue)
    predictor.service_time.record(1, 16, 0.050)
    now = asyncio.get_running_loop().time()
    assert predictor.deadline_refusal(10, None, now) is None
    assert predictor.deadline_refusal(10, now + 1.0, now) is None
    refusal = predictor.deadline_refusal(10, now + 0.010, now)
    assert refusal is not None
    assert refusal.reason == "DEADLINE_UNREACHABLE"
    assert "the model needs about 50 ms" in refusal.message
    passed = predictor.deadline_refusal(10, now - 0.001, now)
    assert passed is not None
    assert "passed before the text reached the queue" in passed.message

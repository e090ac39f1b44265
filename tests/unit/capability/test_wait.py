"""Wait predictions: the device finishes the batches handed to it, the queue ahead
drains in full batches, then the text's own batch runs; a deadline shorter than the
handed-over work and that batch is refused before the text is queued; a batch too
slow for some of its texts' deadlines computes the most texts that fit."""

from __future__ import annotations

import asyncio

import pytest

from capability.batching import BatchingSettings, RequestQueue, WaitPredictor
from capability.batching.batcher import SubmittedBatch
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
    queue.admit(short_text(), priority=0, request_id="r0", deadline=None)
    # One queued: no batch is ahead of a new text, which joins the queued one's (it was
    # counted as a whole batch ahead, and again in the text's own batch: 431 ms
    # reported for a 27 ms answer in an audit).
    assert predictor.queue_wait_seconds() == 0.0
    assert predictor.service_seconds(10) == pytest.approx(0.012, abs=0.001)
    for n in range(1, 6):
        queue.admit(short_text(), priority=0, request_id=f"r{n}", deadline=None)
    # Six queued: one full batch of four (14 ms) ahead of a new text, which joins the
    # other two's.
    assert predictor.queue_wait_seconds() == pytest.approx(0.014, abs=0.001)
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


def handed_over_batch(texts: int, started_at: float | None) -> SubmittedBatch:
    """A batch of `texts` short texts on the device thread (computing since `started_at`,
    or waiting behind another when None); only its shape and start are read."""
    return SubmittedBatch(
        requests=[None] * texts,  # type: ignore[list-item]
        computing=asyncio.get_running_loop().create_future(),
        padded_tokens=16,
        started_at=started_at,
    )


async def test_the_batches_on_the_device_count_before_any_queued_text() -> None:
    """The queue is empty, but the device computes one batch of four (started 4 ms ago)
    and has another full one behind it: a new text waits for both, and its deadline
    must leave room for them as well as for its own batch."""
    settings = BatchingSettings(max_batch_size=4)
    queue: RequestQueue[object] = RequestQueue(settings, retry_after=lambda depth: 0.01)
    now = asyncio.get_running_loop().time()
    slots = (handed_over_batch(4, now - 0.004), handed_over_batch(4, None))
    predictor = WaitPredictor(settings, lambda: queue, lambda: slots)
    for size in (1, 2, 4, 8):
        predictor.service_time.record(size, 16, 0.010 + 0.001 * size)
    # 14 ms a batch of four: 10 left of the running one, then 14, less whatever time
    # has passed since `now` (bounded, not assumed: the machine may be busy).
    busy, wait = predictor.device_busy_seconds(), predictor.queue_wait_seconds()
    elapsed = asyncio.get_running_loop().time() - now
    for predicted in (busy, wait):
        assert 0.024 - elapsed - 0.001 <= predicted <= 0.024 + 0.001
    assert busy >= 0.014  # the batch behind the running one, whatever time has passed
    own = predictor.service_seconds(10)
    assert predictor.deadline_refusal(10, now + 0.024 + own + 0.005, now) is None
    refusal = predictor.deadline_refusal(10, now + 0.020, now)
    assert refusal is not None
    assert "but the device is busy for about" in refusal.message
    # Without a device thread's worth of work, the same deadline is met.
    idle = WaitPredictor(settings, lambda: queue)
    idle.service_time.record(1, 16, 0.011)
    assert idle.deadline_refusal(10, now + 0.020, now) is None


async def test_a_batch_too_slow_for_some_deadlines_takes_the_most_texts_that_fit() -> None:
    settings = BatchingSettings()
    queue: RequestQueue[object] = RequestQueue(settings, retry_after=lambda depth: 0.01)
    predictor = WaitPredictor(settings, lambda: queue)
    # 10 ms a text: four texts take 40 ms.
    for size in (1, 2, 4, 8) * 20:
        predictor.service_time.record(size, 16, 0.010 * size)
    now = 100.0
    tokens = [16, 16, 16, 16]
    fits, whole = predictor.texts_that_fit(tokens, [None, now + 0.1, now + 0.035, now + 0.015], now)
    assert whole == pytest.approx(0.040, abs=0.001)
    # Latest first: no deadline, 100 ms, 35 ms (three texts: 30 ms, in time), then 15 ms
    # (four: 40 ms, too late for it).
    assert fits == (True, True, True, False)
    # Texts of one call share a deadline: three of four fit in 35 ms, not none.
    assert sum(predictor.texts_that_fit(tokens, [now + 0.035] * 4, now)[0]) == 3
    # When the whole batch ends in time, all go.
    assert predictor.texts_that_fit(tokens, [now + 0.05] * 4, now)[0] == (True,) * 4
    assert predictor.texts_that_fit([], [], now) == ((), 0.0)


async def test_the_batches_other_models_handed_to_the_same_device_count_too() -> None:
    """Two models share a worker's device thread: a batch of the first's on it is ahead
    of any text of the second's, predicted by the first's own service times (an audit
    saw the second report no wait, admit a 300 ms deadline and let it expire queued
    while the first computed for 2 s)."""
    settings = BatchingSettings(max_batch_size=4)
    queue: RequestQueue[object] = RequestQueue(settings, retry_after=lambda depth: 0.01)
    now = asyncio.get_running_loop().time()
    slots = (handed_over_batch(4, None),)
    slow = WaitPredictor(settings, lambda: queue, lambda: slots)
    for size in (1, 2, 4, 8):
        slow.service_time.record(size, 16, 0.100 * size)  # 400 ms a batch of four
    fast = WaitPredictor(settings, lambda: queue, neighbours=lambda: (slow,))
    for size in (1, 2, 4, 8):
        fast.service_time.record(size, 16, 0.001 * size)
    assert fast.device_busy_seconds() == pytest.approx(0.400, abs=0.001)
    assert fast.queue_wait_seconds() == pytest.approx(0.400, abs=0.001)
    refusal = fast.deadline_refusal(10, now + 0.300, now)
    assert refusal is not None
    assert "the device is busy for about 400 ms" in refusal.message
    # Its own batches are not counted twice by a neighbour that lists it.
    assert slow.device_busy_seconds() == pytest.approx(0.400, abs=0.001)

"""The batching loop of one model replica: it owns the replica's queue, forms batches
when the device is the replica's, hands them to the device thread and answers them.

Two named slots hold the batches handed to the device thread:

    queue ──take_batch──────▶ running     computing now, or next in line on the device
          ──take_full_batch─▶ following   already full: queued on the device thread
                                          behind `running`, so it starts the moment
                                          the device frees, not when this loop next
                                          gets the GIL

`following` is filled only with a full batch (a partial one would stop filling
early) and only while no other model waits for the device (it would starve).
When `running` is answered, `following` moves up and the slot is free again.

Batches are picked to end in time. As a batch is taken, it keeps the texts
that can end before their deadlines if it starts when the device is predicted
to be free (WaitPredictor.texts_that_fit); the others are answered
DeadlineUnreachable then and there, and the batch is topped up from the queue.
Once a batch is handed over, queued texts that cannot end in time even alone
right after it are answered too. Both used to wait for the device thread to
leave them out as their batch started, one forward later, in a batch with
fewer texts to compute (docs/benchmark.md, 2026-12-02).

Every waiter gets exactly one outcome: its result, ModelFault when its batch
fails or the loop dies with its batch handed over, ExpiredInQueue when its
deadline passes before its batch starts, or DeadlineUnreachable when it would
pass before the batch's forward is predicted to end (in both, never computed).
A bug in the loop itself restarts it after a short pause; the queue keeps its
requests.
What a forward returns, and the trace a batch leaves, are in outcome.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from capability.batching.outcome import (
    BatchOutcome,
    Compute,
    TextResult,
    padding_ratio,
    trace_batch,
)
from capability.batching.queue import PendingRequest, RequestQueue
from capability.batching.settings import BatchingSettings
from capability.batching.wait import WaitPredictor
from capability.bundle import LoadedBundle
from capability.metrics import (
    DEADLINE_STAGE_ADMISSION,
    DEADLINE_STAGE_DEVICE,
    DEADLINE_STAGE_QUEUE,
    CapabilityMetrics,
)
from classify_common.errors import (
    DeadlineUnreachable,
    ExpiredInQueue,
    ModelFault,
    ServiceError,
    UnscorableText,
)
from classify_common.nodes import (
    CLASSIFY_WORKER,
    GPU_QUEUE_WAIT,
    TIMEOUT_ATTRIBUTE,
    emit_node,
)

log = logging.getLogger(__name__)

# Scored alone when every text of a batch got non-finite scores, to tell a model that
# works and cannot score those texts from one that is broken (Batcher._non_finite_fault).
PROBE_TEXT = "The committee will meet on Tuesday to discuss the new schedule."

T = TypeVar("T")

# Seconds the batching loop waits before restarting after a crash, so a fault
# that recurs at once does not spin the loop.
RESTART_BACKOFF_SECONDS = 0.1
# The span of time the load report's busy share covers.
BUSY_WINDOW_SECONDS = 1.0


class Device(Protocol):
    """What the loop needs of the worker that owns the device."""

    @property
    def name(self) -> str: ...

    @property
    def others_waiting(self) -> bool:
        """Whether anyone else waits for the device's turn."""
        ...

    def turn(self) -> AbstractAsyncContextManager[None]:
        """Hold the device for the block (FIFO among everyone who wants it)."""
        ...

    async def execute(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the device thread; the caller holds the turn."""
        ...


@dataclass(eq=False)
class SubmittedBatch:
    """A batch handed to the device thread, and the outcome to come."""

    requests: list[PendingRequest[TextResult]]
    computing: asyncio.Future[BatchOutcome]
    # The longest text's tokens: with len(requests), the shape its time is predicted by.
    padded_tokens: int
    # Loop time it began computing, as near as the loop knows: when it was handed to a
    # free device thread, or when the batch ahead of it was answered. None while it
    # waits behind `running`.
    started_at: float | None = None
    # Whether the texts the device thread left out of it have been answered (told
    # before the forward, or with its outcome).
    left_out_answered: bool = False


class Batcher:
    """Owns one replica's queue and the loop that serves it on the replica's device."""

    def __init__(
        self,
        bundle: LoadedBundle,
        settings: BatchingSettings,
        device: Device,
        compute: Compute,
        metrics: CapabilityMetrics,
        *,
        retry_after: Callable[[int], float],
        on_settled: Callable[[], None],
        predictor: WaitPredictor | None = None,
    ) -> None:
        """`retry_after(depth)`: seconds until a queue of `depth` drains (for QueueFull).
        `on_settled()`: called whenever the replica's work may have run out (a device
        turn ended, a request was evicted). `predictor`: the replica's wait predictions,
        by which batches are picked to end in time (without one, they are not)."""
        self.bundle = bundle
        self._predictor = predictor
        self._select = self._keep_those_in_time if predictor is not None else None
        self.queue: RequestQueue[TextResult] = RequestQueue(
            settings, retry_after=retry_after, on_evicted=self._evicted
        )
        self._device = device
        self._compute = compute
        self._on_settled = on_settled
        # Texts handed to the device thread and not yet answered.
        self.in_flight = 0
        # Whether it sets the model's queue-depth series: not once a newer version of
        # the model serves on the device (they share its labels).
        self.reports_depth = True
        self.running: SubmittedBatch | None = None
        self.following: SubmittedBatch | None = None
        self._task: asyncio.Task[None] | None = None
        model, worker = bundle.name, device.name
        # Labelled children, looked up once: `labels()` costs more than the update.
        self._metrics = metrics
        self._forwards = metrics.model_forwards.labels(model, worker)
        self._texts = metrics.model_texts.labels(model, worker)
        self._batch_size = metrics.batch_size.labels(model, worker)
        self._padding = metrics.padding_ratio.labels(model)
        self._busy = metrics.worker_busy_seconds.labels(worker)
        self._evictions = metrics.evictions.labels(model)
        self._newest_first = metrics.newest_first_batches.labels(model)
        self._expired = {
            stage: metrics.deadline_exceeded.labels(model, stage)
            for stage in (DEADLINE_STAGE_QUEUE, DEADLINE_STAGE_DEVICE)
        }
        # Counted by the pool (a refusal at admission), made here with the other two so
        # that all three stages are exported from the model's load, at 0.
        metrics.deadline_exceeded.labels(model, DEADLINE_STAGE_ADMISSION)
        self._batch_failures = metrics.batch_failures.labels(model, worker)
        self._unscorable = metrics.unscorable_texts.labels(model)
        self._restarts = metrics.worker_restarts.labels(worker)
        # Batches finished in the last BUSY_WINDOW_SECONDS: (loop time, seconds computing),
        # and their sum, for the load report's busy share.
        self._recent_batches: collections.deque[tuple[float, float]] = collections.deque()
        self._recent_busy = 0.0

    @property
    def name(self) -> str:
        return self.bundle.name

    def withdraw_gone(self) -> None:
        """Take the texts whose callers have gone out of the queue (see
        RequestQueue.withdraw_cancelled), at once rather than when a batch or a
        deadline comes to them."""
        if self.queue.withdraw_cancelled():
            self.show_queue_depth()
            self._on_settled()

    def show_queue_depth(self) -> None:
        if not self.reports_depth:
            return
        # NOTE: looked up each time, not kept: a version stopped for good (not replaced)
        # removes this series, and a model served again must then create it anew.
        self._metrics.queue_depth.labels(self.name, self._device.name).set(len(self.queue))

    def start(self) -> None:
        # In a context of its own: started by a ReloadModel call, it inherited that
        # call's trace and request ID, and every batch span and log line of the
        # replica's lifetime joined the reload's trace.
        self._task = asyncio.create_task(
            self._supervise(),
            name=f"batcher-{self._device.name}-{self.name}",
            context=contextvars.Context(),
        )

    @property
    def loop_running(self) -> bool:
        """Whether the batching loop runs (started, and not stopped)."""
        return self._task is not None and not self._task.done()

    async def stop(self, error: Exception) -> None:
        """Answer everything queued with `error` and end the loop; batches handed over
        are answered with ModelFault."""
        self.queue.fail_all(error)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _supervise(self) -> None:
        while True:
            try:
                await self._serve_turns()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug in the loop itself, not a model fault (those are answered per
                # batch): every waiter of a lost batch was answered (_abandon_submitted);
                # restart so the queue keeps being served.
                log.exception(
                    "batching loop crashed; restarting", extra={"worker": self._device.name}
                )
                self._restarts.inc()
                await asyncio.sleep(RESTART_BACKOFF_SECONDS)

    async def _serve_turns(self) -> None:
        while True:
            await self.queue.wait_not_empty()
            # The batching window is waited out before the device's turn is taken: held
            # through it, the turn kept the device idle while other models' requests
            # waited (a fallback model behind a primary's 800 ms window missed 300 ms
            # deadlines). The batch is formed only once the device is ours: until then
            # requests keep joining the queue, so a later interactive request still
            # goes first and a busy device yields fuller batches.
            await self.queue.wait_batch_ready()
            async with self._device.turn():
                try:
                    await self._serve_turn()
                finally:
                    self._abandon_submitted()
            self._on_settled()

    async def _serve_turn(self) -> None:
        """Run batches until the queue holds no full one (or another model waits)."""
        # Taken at once: the window was waited out before the turn. The head may have
        # changed meanwhile (a more urgent text came, the head was withdrawn), and its
        # new window, waited out here, kept the device idle and every other model
        # waiting behind the turn.
        self.running = self._submit(self.queue.take_batch(self._select))
        loop = asyncio.get_running_loop()
        while self.running is not None:
            if self.running.started_at is None:
                self.running.started_at = loop.time()
            self.following = self._submit_if_full()
            self._answer_those_out_of_time()
            await self._finish(self.running)
            self.running, self.following = self.following, None

    def _submit_if_full(self) -> SubmittedBatch | None:
        """Hand a full batch to the device thread behind the running one, unless
        another model waits for the device."""
        if self._device.others_waiting:
            return None
        ready = self.queue.take_full_batch(self._select)
        return self._submit(ready) if ready else None

    def _keep_those_in_time(self, batch: list[PendingRequest[TextResult]]) -> list[bool]:
        """The queue's selector: which texts of a batch being taken stay in it. Those
        that cannot end in time in it, if it starts once the batches handed over are
        done (WaitPredictor.texts_that_fit), are answered DeadlineUnreachable now; those
        whose callers went away are dropped."""
        assert self._predictor is not None
        now = asyncio.get_running_loop().time()
        starts_at = now + self._predictor.device_busy_seconds()
        live = [index for index, request in enumerate(batch) if not request.future.done()]
        fits, needed = self._predictor.texts_that_fit(
            [len(batch[i].encoded) for i in live], [batch[i].deadline for i in live], starts_at
        )
        keep = [False] * len(batch)
        for index, fit in zip(live, fits, strict=True):
            if fit:
                keep[index] = True
            else:
                self._answer_out_of_time(batch[index], now, starts_at, needed)
        return keep

    def _answer_those_out_of_time(self) -> None:
        """Answer the queued texts that cannot end in time even alone in a batch right
        after those handed over: nothing queued starts sooner, whatever order the queue
        serves it in."""
        if self._predictor is None or not len(self.queue):
            return
        now = asyncio.get_running_loop().time()
        starts_at = now + self._predictor.device_busy_seconds()
        shortest = self._predictor.service_time.predict(1, self.queue.settings.length_buckets[0])
        taken = self.queue.take_due_before(starts_at + shortest)
        for request in taken:
            self._answer_out_of_time(request, now, starts_at, shortest)
        if taken:
            self.show_queue_depth()

    def _answer_out_of_time(
        self, request: PendingRequest[TextResult], now: float, starts_at: float, needed: float
    ) -> None:
        """A text taken out of the queue because it cannot end in time in a batch that
        starts at `starts_at` (loop time) and needs `needed` seconds; never computed."""
        self._evictions.inc()
        self._expired[DEADLINE_STAGE_QUEUE].inc()
        assert request.deadline is not None  # only a deadline puts a text out of time
        remaining = request.deadline - now
        error: ServiceError
        if remaining <= 0:
            error = ExpiredInQueue(
                "the deadline passed while the request was queued; it was not computed",
                waited_ms=round((now - request.enqueued_at) * 1000),
            )
        else:
            busy = starts_at - now
            waits = (
                f"the device is busy for about {busy * 1000:.0f} ms and its batch then needs"
                if busy > 0
                else "its batch needs"
            )
            error = DeadlineUnreachable(
                f"{remaining * 1000:.0f} ms were left, but {waits} about "
                f"{needed * 1000:.0f} ms; it was not computed",
                remaining_ms=round(remaining * 1000),
                predicted_ms=round((busy + needed) * 1000),
            )
        self._trace_expiry(request, error)
        if not request.future.done():
            request.future.set_exception(error)

    def _abandon_submitted(self) -> None:
        """The loop stopped (cancelled or crashed) with batches handed over: their
        callers still get an answer, and the replica's load drops back."""
        for submitted in (self.running, self.following):
            if submitted is not None:
                submitted.computing.cancel()
                # Answered below; a word from the thread about texts it left out is late.
                submitted.left_out_answered = True
                self._fail(submitted.requests, ModelFault("the batching loop stopped"))
        self.running = self.following = None

    def _submit(self, batch: list[PendingRequest[TextResult]]) -> SubmittedBatch | None:
        """Hand a batch to the device thread; None when every caller in it has gone."""
        if batch and self.queue.newest_first:
            self._newest_first.inc()
        self.show_queue_depth()
        live = [request for request in batch if not request.future.done()]
        if not live:
            return None
        self.in_flight += len(live)
        loop = asyncio.get_running_loop()

        def left_out(outcome: BatchOutcome) -> None:  # on the device thread
            loop.call_soon_threadsafe(self._answer_left_out, submitted, outcome)

        computing = asyncio.ensure_future(
            self._device.execute(
                self._compute,
                [r.encoded for r in live],
                [r.deadline for r in live],
                left_out,
                [r.future for r in live],
            )
        )
        submitted = SubmittedBatch(live, computing, max(len(r.encoded) for r in live))
        return submitted

    def handed_over(self) -> tuple[SubmittedBatch | None, SubmittedBatch | None]:
        """The batches on the device thread, `running` then `following`: nothing queued
        now can start before they end, whatever order the queue serves it in."""
        return self.running, self.following

    async def _finish(self, submitted: SubmittedBatch) -> None:
        """Answer a submitted batch: every waiter in it gets exactly one outcome, whatever
        fails."""
        batch = submitted.requests
        try:
            outcome = await submitted.computing
            computed = [r for i, r in enumerate(batch) if not outcome.left_out(i)]
            if len(computed) < len(batch):
                self._answer_left_out(submitted, outcome)
            if computed:
                self._record(computed, outcome)
                trace_batch(computed, outcome, self.bundle, self._device.name)
            non_finite = outcome.finite_rows.count(False)
            fault = await self._non_finite_fault(non_finite, computed) if non_finite else None
            for row, request in enumerate(computed):
                if request.future.done():
                    continue  # the caller went away; the result has no one to go to
                if not outcome.finite_rows[row]:
                    assert fault is not None
                    request.future.set_exception(fault)
                    continue
                request.future.set_result(
                    TextResult(
                        probabilities=tuple(outcome.probabilities[row]),
                        bundle=self.bundle,
                        token_count=len(request.encoded),
                        truncated=request.encoded.truncated,
                    )
                )
            self.in_flight -= len(batch)
        except Exception as exc:
            log.exception(
                "batch failed",
                extra={
                    "model": self.name,
                    "worker": self._device.name,
                    "request_ids": [request.request_id for request in batch],
                },
            )
            self._batch_failures.inc()
            self._fail(
                batch,
                ModelFault(f"the batch failed on {self._device.name}: {type(exc).__name__}"),
            )

    async def _non_finite_fault(
        self, non_finite: int, computed: list[PendingRequest[TextResult]]
    ) -> ServiceError:
        """What the `non_finite` texts of the `computed` texts of a batch that the model
        gave non-finite scores are answered.

        When it scored the batch's other texts, or scores a probe text alone now (one
        more forward, on this path only), the model works and these texts are what it
        cannot score (an overflow in half precision, say): UnscorableText, which is
        neither retried on another replica nor held against this one, since the text
        fails alike everywhere (an audit saw one text computed 12 times, and a healthy
        replica ejected, when these were retried). Otherwise the model itself is broken
        here: ModelFault, retried elsewhere, and the replica may be ejected."""
        if non_finite < len(computed) or await self._probe_scores():
            self._unscorable.inc(non_finite)
            return UnscorableText(
                "the model gave non-finite scores for this text; it scores others"
            )
        # No exception reached _finish, yet the batch failed as one that raised does:
        # counted and logged alike, so the runbook's device check sees a broken model.
        log.error(
            "batch failed",
            extra={
                "model": self.name,
                "worker": self._device.name,
                "reason": "non-finite scores for every text, a probe text's included",
                "request_ids": [request.request_id for request in computed],
            },
        )
        self._batch_failures.inc()
        return ModelFault("the model produced non-finite scores")

    async def _probe_scores(self) -> bool:
        """Whether the model gives finite scores for PROBE_TEXT alone, now."""
        try:
            probe = self.bundle.classifier.tokenize([PROBE_TEXT])
            outcome: BatchOutcome = await self._device.execute(
                self._compute, probe, [None], None, None
            )
        except Exception:
            log.exception("the probe of a model that gave non-finite scores failed")
            return False
        return all(outcome.finite_rows)

    def _fail(self, batch: list[PendingRequest[TextResult]], error: Exception) -> None:
        """Answer whoever in `batch` has no answer yet with `error`; the batch is done."""
        for request in batch:
            if not request.future.done():
                request.future.set_exception(error)
        self.in_flight -= len(batch)

    def _answer_left_out(self, submitted: SubmittedBatch, outcome: BatchOutcome) -> None:
        """Answer the texts the device thread left out of `submitted`, once: before its
        forward when the thread tells of them then, so that their callers (a fallback,
        or an orchestrator reading early results) need not wait for the forward."""
        if submitted.left_out_answered:
            return
        submitted.left_out_answered = True
        for index, request in enumerate(submitted.requests):
            if outcome.left_out(index):
                self._leave_out(request, outcome, index)

    def _leave_out(
        self, request: PendingRequest[TextResult], outcome: BatchOutcome, index: int
    ) -> None:
        """A request the device thread left out of its forward: its deadline passed after
        it left the queue (answered as if evicted from the queue), or would have passed
        before the forward ended (DeadlineUnreachable, which a route may fall back on),
        or its caller had gone (nobody to answer, no deadline missed)."""
        if outcome.gone and outcome.gone[index]:
            return
        self._evictions.inc()
        self._expired[DEADLINE_STAGE_DEVICE].inc()
        if outcome.expired and outcome.expired[index]:
            error: ServiceError = ExpiredInQueue(
                "the deadline passed while the request waited for the device; it was not computed"
            )
        else:
            assert request.deadline is not None  # only a deadline makes a text unreachable
            remaining = request.deadline - outcome.started_at
            error = DeadlineUnreachable(
                f"{remaining * 1000:.0f} ms were left when its batch reached the device, "
                f"but the batch needs about {outcome.predicted_seconds * 1000:.0f} ms; "
                "it was not computed",
                remaining_ms=round(remaining * 1000),
                predicted_ms=round(outcome.predicted_seconds * 1000),
            )
        self._trace_expiry(request, error)
        if not request.future.done():
            request.future.set_exception(error)

    def _evicted(self, request: PendingRequest[TextResult]) -> None:
        """The queue's timer evicted `request` (already answered ExpiredInQueue)."""
        # While the device is busy elsewhere nothing else refreshes the gauge: it showed
        # texts long gone until the model next had the device.
        self.show_queue_depth()
        self._evictions.inc()
        self._expired[DEADLINE_STAGE_QUEUE].inc()
        self._trace_expiry(
            request, ExpiredInQueue("the deadline passed while the request was queued")
        )
        self._on_settled()

    def _trace_expiry(self, request: PendingRequest[TextResult], error: ServiceError) -> None:
        if request.trace is not None:
            emit_node(
                request.trace,
                GPU_QUEUE_WAIT,
                request.admitted_ns,
                time.time_ns(),
                {CLASSIFY_WORKER: self._device.name, TIMEOUT_ATTRIBUTE: True},
                error=error,
            )

    def _record(self, batch: list[PendingRequest[TextResult]], outcome: BatchOutcome) -> None:
        self._forwards.inc()
        self._texts.inc(len(batch))
        self._batch_size.observe(len(batch))
        self._padding.observe(padding_ratio(batch, outcome))
        self._busy.inc(outcome.seconds)
        self._recent_batches.append((asyncio.get_running_loop().time(), outcome.seconds))
        self._recent_busy += outcome.seconds

    def busy_share(self) -> float:
        """Share of the last second the device spent on this model's batches, 0..1."""
        cutoff = asyncio.get_running_loop().time() - BUSY_WINDOW_SECONDS
        recent = self._recent_batches
        while recent and recent[0][0] < cutoff:
            self._recent_busy -= recent.popleft()[1]
        return min(max(self._recent_busy / BUSY_WINDOW_SECONDS, 0.0), 1.0)

"""One worker per device: it owns the device, its model replicas and their queues.

Every call that touches the device runs on the worker's single device thread,
so nothing else uses the device, and the event loop never blocks on a model.
A worker holds one active ModelReplica per model, each with its own bounded
queue and batching task. A reload installs a new replica beside the old one
and switches new admissions to it; the old replica finishes what it admitted,
then retires.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from opentelemetry.trace import INVALID_SPAN, Link

from capability.batching import BatchingSettings, PendingRequest, RequestQueue, ServiceTimeModel
from capability.bundle import BundleError, LoadedBundle
from capability.metrics import CapabilityMetrics
from capability.model import EncodedText
from capability.model.stages import StageClock
from capability.workers.device_thread import DeviceThread
from classify_common.errors import (
    DeadlineUnreachable,
    DeviceMemoryPressure,
    ExpiredInQueue,
    ModelFault,
    ServerDraining,
)
from classify_common.nodes import BATCH_SPAN_NAME, RequestTrace, emit_node
from classify_common.tracing import get_tracer

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds a worker's batching loop waits before restarting after a crash, so a
# fault that recurs at once does not spin the loop.
RESTART_BACKOFF_SECONDS = 0.1
# Shapes timed at warm-up to seed the service-time fit: (texts, tokens each).
WARM_UP_SHAPES = ((1, 16), (4, 64), (16, 32))


@dataclass(frozen=True)
class TextResult:
    """One text's label probabilities and the exact model version that computed them."""

    probabilities: tuple[float, ...]
    bundle: LoadedBundle
    token_count: int
    truncated: bool


@dataclass(frozen=True)
class BatchOutcome:
    probabilities: list[list[float]]  # (B, L), columns follow the classifier's labels
    finite_rows: tuple[bool, ...]
    padded_tokens: int
    seconds: float
    # Epoch ns at the marks between capability.model.stages.STAGES, and their clock.
    marks_ns: tuple[int, ...]
    clock: str
    # Per submitted text: whether its deadline had passed, so it was left out. The
    # other fields describe the texts that were computed, in order.
    expired: tuple[bool, ...] = ()


def padding_ratio(batch: list[PendingRequest[TextResult]], outcome: BatchOutcome) -> float:
    """Share of the batch's token positions that are padding."""
    real_tokens = sum(len(request.encoded) for request in batch)
    return 1.0 - real_tokens / (len(batch) * outcome.padded_tokens)


# A batch handed to the device thread, and the outcome to come.
RunningBatch = tuple[list["PendingRequest[TextResult]"], "asyncio.Future[BatchOutcome]"]


class ModelReplica:
    """One version of one model on one worker, with its queue and batching task."""

    def __init__(
        self,
        bundle: LoadedBundle,
        worker: DeviceWorker,
        settings: BatchingSettings,
        metrics: CapabilityMetrics,
    ) -> None:
        self.bundle = bundle
        self.worker = worker
        self.settings = settings
        self.service_time = ServiceTimeModel()
        self._metrics = metrics
        self.queue: RequestQueue[TextResult] = RequestQueue(
            settings, retry_after=self._predict_drain_seconds, on_evicted=self._evicted
        )
        self.in_flight = 0
        # Routed here and being tokenized, not yet queued: counted as load so a
        # burst does not all pick the same worker, and waited for before retiring.
        self.arriving = 0
        self.stopped = False
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def name(self) -> str:
        return self.bundle.name

    @property
    def load(self) -> int:
        """Texts arriving, queued or computing: what least-loaded dispatch compares."""
        return self.arriving + len(self.queue) + self.in_flight

    def _predict_drain_seconds(self, depth: int) -> float:
        full_batches = math.ceil(depth / self.settings.max_batch_size)
        per_batch = self.service_time.predict(
            self.settings.max_batch_size, self.settings.length_buckets[0]
        )
        return max(full_batches * per_batch, 0.001)

    def predicted_wait_seconds(self, tokens: int) -> float:
        """Time a text admitted now is expected to wait for its answer: the queue
        ahead of it, then its own batch."""
        ahead = self._predict_drain_seconds(len(self.queue)) if self.queue else 0.0
        return ahead + self.predicted_service_seconds(tokens)

    def predicted_service_seconds(self, tokens: int) -> float:
        """Time the batch this text would join is expected to take on the device."""
        bucket = self.settings.bucket_of(tokens)
        bound = max(self.settings.length_buckets[bucket], tokens)
        size = min(self.queue.depth_in_bucket(bucket) + 1, self.settings.max_batch_size)
        return self.service_time.predict(size, bound)

    def begin_arrival(self) -> None:
        self.arriving += 1
        self._idle.clear()

    def end_arrival(self) -> None:
        self.arriving -= 1
        self._set_idle_if_nothing_left()

    def _set_idle_if_nothing_left(self) -> None:
        if not (self.arriving or self.queue or self.in_flight):
            self._idle.set()

    def admit(
        self,
        encoded: EncodedText,
        *,
        priority: int,
        request_id: str,
        deadline: float | None,
        trace: RequestTrace | None = None,
    ) -> asyncio.Future[TextResult]:
        """Queue a text tokenized by this replica. Requests routed here before a newer
        version took over are still admitted: they finish on the version they started
        with. Only a stopped replica refuses."""
        if self.stopped:
            raise ServerDraining(f"model {self.name} version {self.bundle.version} has stopped")
        if deadline is not None:
            remaining = deadline - asyncio.get_running_loop().time()
            predicted = self.predicted_service_seconds(len(encoded))
            if remaining < predicted:
                raise DeadlineUnreachable(
                    f"{remaining * 1000:.0f} ms left, but the model needs about "
                    f"{predicted * 1000:.0f} ms",
                    remaining_ms=round(remaining * 1000),
                    predicted_ms=round(predicted * 1000),
                )
        future = self.queue.admit(
            encoded, priority=priority, request_id=request_id, deadline=deadline, trace=trace
        )
        self._idle.clear()
        self._metrics.queue_depth.labels(self.name, self.worker.name).set(len(self.queue))
        return future

    def start(self) -> None:
        self._task = asyncio.create_task(
            self._supervise(), name=f"batcher-{self.worker.name}-{self.name}"
        )

    async def warm_up(self) -> None:
        """Time a few batch shapes on the device to seed the service-time fit, and refuse
        a version whose scores are not finite."""
        for texts, tokens in WARM_UP_SHAPES:
            encoded = [EncodedText(ids=(101, *([1000] * (tokens - 2)), 102), truncated=False)]
            outcome = await self.worker.run_on_device(self._compute, encoded * texts)
            if not all(outcome.finite_rows):
                raise BundleError(
                    f"{self.bundle.directory.name}: warm-up on {self.worker.name} produced "
                    "non-finite scores"
                )

    async def _supervise(self) -> None:
        while True:
            try:
                await self._run_batches()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug in the loop itself, not a model fault (those are answered per
                # batch): every waiter of a lost batch was answered (_finish, _fail);
                # restart so the queue keeps being served.
                log.exception(
                    "batching loop crashed; restarting", extra={"worker": self.worker.name}
                )
                self._metrics.worker_restarts.labels(self.worker.name).inc()
                await asyncio.sleep(RESTART_BACKOFF_SECONDS)

    async def _run_batches(self) -> None:
        while True:
            await self.queue.wait_not_empty()
            # The batch is formed only once the device is ours: until then requests
            # keep joining the queue, so a later interactive request still goes
            # first and a busy device yields fuller batches.
            async with self.worker.turn():
                submitted: list[RunningBatch] = []
                try:
                    first = self._submit(await self.queue.next_batch())
                    submitted += [first] if first else []
                    while submitted:
                        # A full batch already waiting goes to the device thread at once,
                        # behind the running one, so it starts the moment the device
                        # frees, not when this loop next gets the GIL. Only a full one
                        # (a partial batch would stop filling early), and only while no
                        # other model waits for the device, which would starve it.
                        others = self.worker.others_waiting
                        ready = None if others else self.queue.take_full_batch()
                        following = self._submit(ready) if ready else None
                        submitted += [following] if following else []
                        await self._finish(*submitted[0])
                        submitted.pop(0)
                finally:
                    # Cancelled or crashed with batches handed over: their callers still
                    # get an answer, and the replica's load drops back.
                    for batch, computing in submitted:
                        computing.cancel()
                        self._fail(batch, ModelFault("the batching loop stopped"))
            self._set_idle_if_nothing_left()

    def _submit(self, batch: list[PendingRequest[TextResult]]) -> RunningBatch | None:
        """Hand a batch to the device thread; None when every caller in it has gone."""
        self._metrics.queue_depth.labels(self.name, self.worker.name).set(len(self.queue))
        live = [request for request in batch if not request.future.done()]
        if not live:
            return None
        self.in_flight += len(live)
        computing = asyncio.ensure_future(
            self.worker.execute(
                self._compute, [r.encoded for r in live], [r.deadline for r in live]
            )
        )
        return live, computing

    async def _finish(
        self, batch: list[PendingRequest[TextResult]], computing: asyncio.Future[BatchOutcome]
    ) -> None:
        """Answer a submitted batch: every waiter in it gets exactly one outcome, whatever
        fails."""
        try:
            outcome = await computing
            computed = [r for r, gone in zip(batch, outcome.expired, strict=True) if not gone]
            for request in batch:
                if request not in computed:
                    self._expire_unqueued(request)
            if computed:
                self._record(computed, outcome)
                self._trace(computed, outcome)
            for row, request in enumerate(computed):
                if request.future.done():
                    continue  # the caller went away; the result has no one to go to
                if not outcome.finite_rows[row]:
                    request.future.set_exception(ModelFault("the model produced non-finite scores"))
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
                    "worker": self.worker.name,
                    "request_ids": [request.request_id for request in batch],
                },
            )
            self._metrics.batch_failures.labels(self.name, self.worker.name).inc()
            self._fail(
                batch, ModelFault(f"the batch failed on {self.worker.name}: {type(exc).__name__}")
            )

    def _fail(self, batch: list[PendingRequest[TextResult]], error: Exception) -> None:
        """Answer whoever in `batch` has no answer yet with `error`; the batch is done."""
        for request in batch:
            if not request.future.done():
                request.future.set_exception(error)
        self.in_flight -= len(batch)

    def _expire_unqueued(self, request: PendingRequest[TextResult]) -> None:
        """A request whose deadline passed after it left the queue, before its batch ran:
        it was not computed, and is answered as if evicted from the queue."""
        self._evicted(request)
        if not request.future.done():
            request.future.set_exception(
                ExpiredInQueue(
                    "the deadline passed while the request waited for the device; "
                    "it was not computed"
                )
            )

    def _record(self, batch: list[PendingRequest[TextResult]], outcome: BatchOutcome) -> None:
        worker = self.worker.name
        self._metrics.model_forwards.labels(self.name, worker).inc()
        self._metrics.model_texts.labels(self.name, worker).inc(len(batch))
        self._metrics.batch_size.labels(self.name, worker).observe(len(batch))
        self._metrics.padding_ratio.labels(self.name).observe(padding_ratio(batch, outcome))
        self._metrics.worker_busy_seconds.labels(worker).inc(outcome.seconds)

    def _trace(self, batch: list[PendingRequest[TextResult]], outcome: BatchOutcome) -> None:
        """The batch's device nodes for every traced request in it, and the batch's own
        span, which each request's `batch_assemble` links to (and it links back)."""
        traced = [(request, request.trace) for request in batch if request.trace is not None]
        if not traced or len(outcome.marks_ns) != 5:
            return
        started, assembled, copied, forwarded, done = outcome.marks_ns
        version = self.bundle.version
        batch_attributes = {
            "classify.batch_size": len(batch),
            "classify.bucket": batch[0].bucket,
            "classify.padding_ratio": round(padding_ratio(batch, outcome), 4),
        }
        spanned = [trace for _, trace in traced if trace.makes_spans]
        batch_span = (
            get_tracer().start_span(
                BATCH_SPAN_NAME,
                start_time=started,
                attributes={
                    **batch_attributes,
                    "classify.worker": self.worker.name,
                    "classify.model": self.name,
                    "classify.model_version": version,
                    "classify.clock": outcome.clock,
                },
                links=[Link(trace.server_span.get_span_context()) for trace in spanned],
            )
            if spanned
            else INVALID_SPAN
        )
        to_batch = [Link(batch_span.get_span_context())]
        clock = {"classify.clock": outcome.clock}
        for request, trace in traced:
            worker = {"classify.worker": self.worker.name}
            emit_node(trace, "gpu_queue_wait", request.admitted_ns, started, worker)
            emit_node(trace, "batch_assemble", started, assembled, batch_attributes, to_batch)
            emit_node(trace, "h2d_copy", assembled, copied, clock)
            model = {"classify.model": self.name, "classify.model_version": version}
            emit_node(trace, "cuda_launch", copied, forwarded, {**clock, **model})
            emit_node(trace, "postprocess", forwarded, done, clock)
            trace.log_fields.update(
                model=self.name,
                model_version=version,
                worker=self.worker.name,
                batch_size=len(batch),
                tokens=len(request.encoded),
            )
        batch_span.end(end_time=done)

    def _evicted(self, request: PendingRequest[TextResult]) -> None:
        self._metrics.evictions.labels(self.name).inc()
        if request.trace is not None:
            emit_node(
                request.trace,
                "gpu_queue_wait",
                request.admitted_ns,
                time.time_ns(),
                {"classify.worker": self.worker.name, "timeout": True},
                error=ExpiredInQueue("the deadline passed while the request was queued"),
            )

    def _compute(
        self, encoded: list[EncodedText], deadlines: list[float | None] | None = None
    ) -> BatchOutcome:
        """On the device thread: one forward pass, timed for the service-time fit.

        Texts whose deadline (event-loop time, which is time.monotonic) has passed
        are left out, never computed; `expired` says which.
        """
        now = time.monotonic()
        expired = tuple(d is not None and d <= now for d in deadlines or [None] * len(encoded))
        encoded = [text for text, gone in zip(encoded, expired, strict=True) if not gone]
        if not encoded:
            return BatchOutcome([], (), 0, 0.0, (), "monotonic", expired)
        clock = StageClock(self.worker.device)
        started = time.perf_counter()
        result = self.bundle.classifier.run(encoded, clock)
        seconds = time.perf_counter() - started
        padded = max(len(text) for text in encoded)
        self.service_time.record(len(encoded), padded, seconds)
        # One call to leave torch: checks on the tensor would each give up the GIL and
        # wait to win it back from the serving loop; these are plain Python floats.
        rows = result.probabilities.tolist()
        return BatchOutcome(
            probabilities=rows,
            finite_rows=tuple(all(map(math.isfinite, row)) for row in rows),
            padded_tokens=padded,
            seconds=seconds,
            marks_ns=clock.epoch_ns(),
            clock=clock.kind,
            expired=expired,
        )

    async def wait_idle(self) -> None:
        """Return once nothing is arriving, queued or computing."""
        while self.arriving or self.queue or self.in_flight:
            self._idle.clear()
            await self._idle.wait()

    async def stop(self, error: Exception) -> None:
        self.stopped = True
        self.queue.fail_all(error)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(KeyError):  # never set when nothing was admitted
            self._metrics.queue_depth.remove(self.name, self.worker.name)


class DeviceWorker:
    """Owns one device: its thread, its replicas, and admission to them."""

    def __init__(
        self,
        device: torch.device,
        name: str,
        metrics: CapabilityMetrics,
        *,
        memory_threshold: float,
    ) -> None:
        self.device = device
        self.name = name
        self._metrics = metrics
        self._memory_threshold = memory_threshold
        self._device_thread = DeviceThread(f"device-{name}")
        # Whoever holds this may use the device next (FIFO): batches of every
        # replica, warm-ups and maintenance take turns through it (see `turn`).
        self._device_turn = asyncio.Lock()
        self._waiting_for_turn = 0
        self.replicas: dict[str, ModelReplica] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold the device: wait for the turn (FIFO), keep it for the block."""
        self._waiting_for_turn += 1
        try:
            await self._device_turn.acquire()
        finally:
            self._waiting_for_turn -= 1
        try:
            yield
        finally:
            self._device_turn.release()

    @property
    def others_waiting(self) -> bool:
        """Whether anyone waits for the device's turn (another model, a warm-up)."""
        return self._waiting_for_turn > 0

    async def run_on_device(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on this worker's device thread when it is its turn."""
        async with self.turn():
            return await self.execute(fn, *args)

    async def execute(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the device thread; the caller holds the turn."""
        return await self._device_thread.submit(fn, *args)

    def memory_in_use(self) -> float | None:
        """Share of device memory in use (CUDA), or None where it is not measured."""
        if self.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return 1.0 - free / total

    def check_memory(self, model: str) -> None:
        in_use = self.memory_in_use()
        if in_use is not None and in_use > self._memory_threshold:
            raise DeviceMemoryPressure(
                f"{self.name} memory is {in_use:.0%} used (threshold {self._memory_threshold:.0%})",
                retry_after_seconds=0.5,
                worker=self.name,
            )

    async def prepare(self, bundle: LoadedBundle, settings: BatchingSettings) -> ModelReplica:
        """A warmed-up replica of `bundle` on this device, not yet serving."""
        replica = ModelReplica(bundle, self, settings, self._metrics)
        await replica.warm_up()
        return replica

    async def activate(self, replica: ModelReplica) -> None:
        """Make `replica` the one new requests join; the previous version retires."""
        bundle = replica.bundle
        replica.start()
        previous = self.replicas.get(bundle.name)
        self.replicas[bundle.name] = replica
        self._metrics.model_info.labels(
            bundle.name, bundle.version, self.name, bundle.precision
        ).set(1)
        self._metrics.model_load_seconds.labels(bundle.name, self.name).set(bundle.load_seconds)
        if previous is not None:
            task = asyncio.create_task(self._retire(previous))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _retire(self, replica: ModelReplica) -> None:
        """Finish what the old version admitted (and what was on its way), then let it go."""
        await replica.wait_idle()
        await replica.stop(ServerDraining("the model version was replaced"))
        bundle = replica.bundle
        if self.replicas.get(bundle.name) is not replica:
            # Only drop the info series if the new version does not share its labels.
            current = self.replicas.get(bundle.name)
            if current is None or current.bundle.version != bundle.version:
                self._metrics.model_info.remove(
                    bundle.name, bundle.version, self.name, bundle.precision
                )
        log.info(
            "model version retired",
            extra={"model": bundle.name, "version": bundle.version, "worker": self.name},
        )

    async def drain(self) -> None:
        """Wait until every request routed here is answered (the pool admits no new ones)."""
        await asyncio.gather(*(replica.wait_idle() for replica in self.replicas.values()))
        if self._retiring:
            await asyncio.gather(*self._retiring)

    async def close(self) -> None:
        for replica in self.replicas.values():
            await replica.stop(ServerDraining("the server is shutting down"))
        self._device_thread.close()

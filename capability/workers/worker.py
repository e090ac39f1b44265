"""One worker per device: it owns the device, its model replicas and their queues.

Every call that touches the device runs on the worker's single device thread,
so nothing else uses the device, and the event loop never blocks on a model.
A worker holds one active ModelReplica per model, each with its own bounded
queue and batching loop (capability.batching.batcher). A reload installs a new
replica beside the old one and switches new admissions to it; the old replica
finishes what it admitted, then retires, and the device's cached blocks are
released (`empty_cache`, or its CPU stand-in) on the device thread.

Every replica keeps a ledger entry (capability.memory.MemoryLedger): memory around
each load stage and around a warm-up at its largest batch of its longest texts. The
worker refuses a version whose predicted (before its weights are read) or measured
(after that warm-up) footprint, with what the versions resident on it already
hold, would exceed its device memory budget once idle on_demand versions have left
to make room; the serving version stays.

That warm-up holds the device for one forward of the measured shape (seconds for
the MiniLM's 64 x 256 tokens on a CPU), and every model on the worker waits for it.
So a live reload measures it only when the version computes unlike the one it
replaces (LoadedBundle.compute_shape, the batch size, the residency): a version
that computes alike needs the same memory beyond its weights, so its ledger carries
that measured overhead over (`carried_from`), and serving goes on meanwhile.

An on_demand replica (capability/workers/residency.py) is loaded and measured like
any other, then its weights wait in host memory: the first request copies them onto
the device (after evicting idle on_demand models, least recently used first, if the
budget needs room), and the worker's evictor takes them off again once it has not
used the device for the model's `idle_seconds` (a result-cache hit does not). A
request gives up waiting for room while a cold start could still answer it in
time, so that its caller can still fall back. Residency changes are serialised by
one lock per worker and run on the device thread in its turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar, overload

import torch

from capability.batching import (
    Admission,
    Batcher,
    BatchingSettings,
    BatchOutcome,
    LeftOut,
    RequestQueue,
    TextResult,
    WaitPredictor,
)
from capability.batching.probe import (
    MAX_GAP_SECONDS,
    MAX_STALE_PROBES_IN_A_ROW,
    PROBE_FAILED,
    STALE,
    FitProbe,
)
from capability.bundle import BundleError, LoadedBundle, MemoryBudgetExceeded
from capability.memory import (
    PEAK_WINDOW,
    MemoryLedger,
    MemoryReading,
    format_bytes,
    memory_source,
    read_memory,
    read_peak,
    release_cached,
    reset_peak,
)
from capability.metrics import (
    CACHE_RELEASE_EVICTED,
    CACHE_RELEASE_RETIRED,
    MODEL_MEMORY_KINDS,
    CapabilityMetrics,
)
from capability.model import EncodedText
from capability.model.stages import StageClock
from capability.workers.device_thread import DeviceThread
from capability.workers.residency import (
    EVICTED_FOR_ROOM,
    EVICTED_IDLE,
    ON_DEMAND,
    RESIDENT,
    SHARDED,
    OnDemandWeights,
    shard_layers,
)
from capability.workers.threads import CpuLanes
from classify_common.errors import (
    DeadlineUnreachable,
    DeviceMemoryPressure,
    ServerDraining,
    ServiceError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Shapes timed at warm-up to seed the service-time fit: (texts, tokens each), the
# tokens capped at what the model reads (warm_up_shapes).
WARM_UP_SHAPES = ((1, 16), (4, 64), (16, 32))
# The ledger's measured warm-up (--memory-warm-up): the largest batch of the longest
# texts the model reads (its max_seq_length, whatever the length buckets), or (faster
# starts) the last of the model's warm_up_shapes.
MEMORY_WARM_UPS = ("largest", "small")
# The evictor looks this often, at most, for on_demand models idle long enough (and
# a quarter of the shortest idle_seconds, when that is less).
EVICTION_POLL_SECONDS = 1.0
# How long a cold start without a deadline waits for a busy resident model to go
# idle so that it can be evicted for room; with a deadline, until the deadline.
ROOM_WAIT_SECONDS = 10.0


def warm_up_shapes(max_seq_length: int) -> tuple[tuple[int, int], ...]:
    """WARM_UP_SHAPES for a model that reads at most `max_seq_length` tokens a text:
    a longer stand-in text would be refused before it reached the model."""
    return tuple((texts, min(tokens, max_seq_length)) for texts, tokens in WARM_UP_SHAPES)


class LoadAbandoned(Exception):
    """The load was given up (the server stops); raised on the loader thread at the
    next stage boundary, to a caller that has already gone."""


class BudgetedLoad:
    """A LoadWatch for one version on one worker: readings of its device, and the
    budget check of the footprint predicted from the weights' bytes, made before
    any weight is read. The loader thread reads no worker state: `overhead` is taken
    on the event loop when the load starts, and room for the weights is made there
    (DeviceWorker.make_room_for_load) while the loader thread waits. Once `abandon`ed,
    the next reading (a stage boundary) raises LoadAbandoned, as does a wait for room."""

    def __init__(self, worker: DeviceWorker, model: str, version: str) -> None:
        self._worker = worker
        self._model = model
        self._version = version
        self._loop = asyncio.get_running_loop()
        # The event loop's making room for the weights, once admit_weights asks.
        self._room: concurrent.futures.Future[int] | None = None
        # What the serving version of this model needed beyond its weights
        # (activations, workspaces), measured: the best guess for the next one.
        serving = worker.replicas.get(model)
        self._overhead = 0
        if serving is not None and serving.ledger is not None:
            self._overhead = serving.ledger.footprint_bytes - serving.ledger.weights_bytes
        self.predicted_bytes = 0
        self._abandoned = threading.Event()

    def abandon(self) -> None:
        """From the event loop: end the load at its next stage boundary, or its wait
        for room."""
        self._abandoned.set()
        if self._room is not None:
            self._room.cancel()

    def read(self) -> MemoryReading:
        if self._abandoned.is_set():
            raise LoadAbandoned(f"load of version {self._version} of {self._model} abandoned")
        return read_memory(self._worker.device)

    def admit_weights(self, weights_bytes: int) -> None:
        """On the loader thread: wait while the event loop makes room for the predicted
        footprint, then refuse it if it still does not fit."""
        if self._abandoned.is_set():
            raise LoadAbandoned(f"load of version {self._version} of {self._model} abandoned")
        self.predicted_bytes = weights_bytes + self._overhead
        how = f"predicted: {format_bytes(weights_bytes)} of weights"
        if self._overhead:
            how += f" + {format_bytes(self._overhead)} measured beyond the serving version's"
        self._room = asyncio.run_coroutine_threadsafe(self._room_for_weights(), self._loop)
        # NOTE: `abandon` may have run before `_room` was set, and then cancelled nothing.
        if self._abandoned.is_set():
            self._room.cancel()
        try:
            held = self._room.result()
        except concurrent.futures.CancelledError:
            raise LoadAbandoned(
                f"load of version {self._version} of {self._model} abandoned"
            ) from None
        self._worker.refuse_over_budget(self._model, self._version, self.predicted_bytes, how, held)

    async def _room_for_weights(self) -> int:
        """On the event loop: make room for the predicted footprint, held for this load
        (DeviceWorker.make_room_for_load), unless it has been abandoned meanwhile."""
        held = await self._worker.make_room_for_load(self.predicted_bytes, self._model)
        if self._abandoned.is_set():
            # NOTE: the load's end (WorkerPool.load's finally) may already have released
            # its room: the caller left (the server stops, a ReloadModel caller's
            # deadline) while this ran, or before it began (`abandon`'s cancel reaches a
            # task only at its next step, and this one may finish in its first). Held
            # now, no one would release it, and the room stayed taken until the model's
            # next load. Set on the event loop before that release, so checked here,
            # in the same step as the holding, it cannot be missed.
            self._worker.release_room(self._model)
        return held


class ModelReplica:
    """One version of one model on one worker: admission to its queue, its forward on
    the device, and its lifecycle (warm-up, start, wait for idle, stop). Its Batcher
    owns the queue and the loop that serves it."""

    def __init__(
        self,
        bundle: LoadedBundle,
        worker: DeviceWorker,
        settings: BatchingSettings,
        metrics: CapabilityMetrics,
        residency: str = RESIDENT,
        idle_seconds: float = 0.0,
    ) -> None:
        self.bundle = bundle
        self.worker = worker
        self.settings = settings
        self._metrics = metrics
        self.residency = residency
        self.idle_seconds = idle_seconds
        # The host copy of an on_demand replica's weights, once it is serving.
        self.on_demand: OnDemandWeights | None = None
        # When the model last used the device (time.monotonic, the loop's clock): its
        # cold start, or its queue settling (texts answered, or evicted unseen). What
        # its idle_seconds count from; a result-cache hit does no device work and
        # keeps no model on the device.
        self.last_used = time.monotonic()
        # The latest cold start's seconds: the wait predicted for the next one.
        self.cold_start_seconds: float | None = None
        # Sharded: the devices holding the encoder's layers, and which layers each.
        self.shards: list[tuple[torch.device, range]] = []
        self.batcher: Batcher
        # Built before the Batcher, which takes its drain estimate for retry hints; it
        # reads the Batcher's queue and device slots, and those of the other replicas
        # on this device, when asked.
        self.predictor = WaitPredictor(
            settings,
            lambda: self.batcher.queue,
            lambda: self.batcher.handed_over(),
            worker.wait_predictors,
        )
        self.batcher = Batcher(
            bundle,
            settings,
            worker,
            self._compute,
            metrics,
            retry_after=self.predictor.drain_seconds,
            on_settled=self._settle,
            predictor=self.predictor,
        )
        # What this version costs on the device; set by DeviceWorker.prepare.
        self.ledger: MemoryLedger | None = None
        # Routed here and being tokenized, not yet queued: counted as load so a
        # burst does not all pick the same worker, and waited for before retiring.
        self.arriving = 0
        self.stopped = False
        self._idle = asyncio.Event()
        self._idle.set()
        # Checks of the service-time fit when it alone refuses texts (probe.py).
        self._fit_probe = FitProbe()
        self._fit_probe_task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.bundle.name

    @property
    def queue(self) -> RequestQueue[TextResult]:
        return self.batcher.queue

    @property
    def in_flight(self) -> int:
        """Texts handed to the device thread and not yet answered."""
        return self.batcher.in_flight

    @property
    def load(self) -> int:
        """Texts arriving, queued or computing: what least-loaded dispatch compares."""
        return self.arriving + len(self.queue) + self.in_flight

    def begin_arrival(self, texts: int = 1) -> None:
        self.arriving += texts
        self._idle.clear()

    def end_arrival(self, texts: int = 1) -> None:
        self.arriving -= texts
        self._set_idle_if_nothing_left()

    @property
    def is_resident(self) -> bool:
        """Whether the weights are on the device (always, unless on_demand)."""
        return self.on_demand is None or self.on_demand.resident

    def predicted_cold_start_seconds(self) -> float:
        """How long copying the weights onto the device will take: the latest cold start,
        else the load's own weight and graph stages."""
        if self.cold_start_seconds is not None:
            return self.cold_start_seconds
        stages = self.bundle.stage_seconds
        return stages.get("load_weights", 0.0) + stages.get("trace_graph", 0.0)

    def predicted_cold_answer_seconds(self, tokens: int) -> float:
        """How long a text of `tokens` takes from the start of a cold start: copying the
        weights onto the device, then its computation."""
        return self.predicted_cold_start_seconds() + self.predictor.service_seconds(tokens)

    def latest_cold_start(self, tokens: int, deadline: float | None) -> float | None:
        """The last moment (event-loop time) a cold start may begin and still answer a
        text of `tokens` by `deadline`; None without a deadline."""
        if deadline is None:
            return None
        return deadline - self.predicted_cold_answer_seconds(tokens)

    def cold_start_refusal(
        self, tokens: int, deadline: float | None, now: float
    ) -> DeadlineUnreachable | None:
        """DeadlineUnreachable when the weights are off the device and the time left is
        less than the cold start plus the computation predicted for the text."""
        if deadline is None or self.is_resident:
            return None
        remaining = deadline - now
        needed = self.predicted_cold_answer_seconds(tokens)
        if remaining >= needed:
            return None
        if remaining >= self.predicted_cold_start_seconds():
            # Time for the copy, not for the forward the fit predicts after it: the
            # refusal rests on the fit, which no text refused here could ever correct
            # (none is computed, and the model stays off the device).
            self._probe_fit(tokens, now)
        return DeadlineUnreachable(
            f"{remaining * 1000:.0f} ms left, but model {self.name} is not on "
            f"{self.worker.name}: copying it there and computing takes about "
            f"{needed * 1000:.0f} ms",
            remaining_ms=round(remaining * 1000),
            predicted_ms=round(needed * 1000),
        )

    def shard(self, devices: list[torch.device]) -> None:
        """On the device thread: split the encoder's layers across `devices` and trace
        the graph again over them."""
        classifier = self.bundle.classifier
        runs = shard_layers(classifier, devices)
        classifier.use_graph(self.bundle.graph)
        self.shards = list(zip(devices, runs, strict=True))

    def keep_on_host(self) -> None:
        """On the device thread: keep a host copy of the weights, and take them off the
        device until a request needs them."""
        self.on_demand = OnDemandWeights(self.bundle.classifier, self.bundle.graph)
        self.on_demand.evict()

    def _settle(self) -> None:
        """Told by the batcher whenever its work may have run out (a device turn ended,
        a text was evicted from the queue): mark the device used until now (what
        idle_seconds count from), and the replica idle if nothing is left."""
        self.last_used = time.monotonic()
        self._set_idle_if_nothing_left()

    def _set_idle_if_nothing_left(self) -> None:
        if not (self.arriving or self.queue or self.in_flight):
            self._idle.set()

    def _check_running(self) -> None:
        """Requests routed here before a newer version took over are still admitted:
        they finish on the version they started with. Only a stopped replica refuses."""
        if self.stopped:
            raise ServerDraining(f"model {self.name} version {self.bundle.version} has stopped")

    @overload
    def admit(self, admissions: Admission) -> asyncio.Future[TextResult]: ...

    @overload
    def admit(
        self, admissions: Sequence[Admission]
    ) -> list[asyncio.Future[TextResult] | ServiceError]: ...

    def admit(
        self, admissions: Admission | Sequence[Admission]
    ) -> asyncio.Future[TextResult] | list[asyncio.Future[TextResult] | ServiceError]:
        """Queue texts tokenized by this replica in one step, in order.

        Given many, each gets the future of its result, or the ServiceError that
        refused it alone (its deadline cannot be met, the queue has no room left).
        Given one, its future, or the refusal raised. A stopped replica refuses all
        (raised).
        """
        self._check_running()
        single = isinstance(admissions, Admission)
        batch = (admissions,) if isinstance(admissions, Admission) else admissions
        now = asyncio.get_running_loop().time()
        busy = self.predictor.device_busy_seconds()
        refusals = [
            self.predictor.deadline_refusal(len(a.encoded), a.deadline, now, busy) for a in batch
        ]
        if busy == 0 and not self.queue and not self.in_flight:
            # Nothing ahead of these texts: a refusal of one with time left rests on the
            # fit's predicted forward alone, which only a computed forward can correct.
            refused_on_the_fit = [
                len(a.encoded)
                for a, refusal in zip(batch, refusals, strict=True)
                if refusal is not None and a.deadline is not None and a.deadline > now
            ]
            if refused_on_the_fit:
                self._probe_fit(min(refused_on_the_fit), now)
        accepted = [a for a, refusal in zip(batch, refusals, strict=True) if refusal is None]
        queued = iter(self.queue.admit_many(accepted))
        outcomes: list[asyncio.Future[TextResult] | ServiceError] = [
            next(queued) if refusal is None else refusal for refusal in refusals
        ]
        if any(isinstance(outcome, asyncio.Future) for outcome in outcomes):
            self._idle.clear()
            self.batcher.show_queue_depth()
        if not single:
            return outcomes
        (outcome,) = outcomes
        if isinstance(outcome, ServiceError):
            raise outcome
        return outcome

    def start(self) -> None:
        self.batcher.start()

    async def warm_up(self) -> None:
        """Time a few batch shapes on the device to seed the service-time fit, and refuse
        a version whose scores are not finite.

        Each shape runs once untimed first. A traced model's first forwards of a shape
        are many times slower than the rest (the JIT profiles, then optimises, and
        memory is first touched): timed, topic-minilm's first 1 x 16 took 517 ms
        against about 15 ms, the fit predicted some 200 ms for any text, and a fresh
        replica refused every text with a shorter deadline (never computed, so the
        fit never learnt better)."""
        shapes = warm_up_shapes(self.bundle.classifier.max_seq_length)
        for timed in (False, True):
            for texts, tokens in shapes:
                outcome = await self.worker.run_on_device(
                    functools.partial(self._compute, timed=timed), self._stand_ins(texts, tokens)
                )
                self._require_finite(outcome)

    def _probe_fit(self, tokens: int, now: float) -> None:
        """Time one stand-in text of `tokens` tokens on the device, soon, if a probe of
        the service-time fit is due (probe.py): the fit has just refused a text on
        its own word. An on_demand replica off the device is brought onto it first,
        as the texts it refused would have been."""
        if self.stopped or not self._fit_probe.due(now):
            return
        self._fit_probe.running = True
        self._fit_probe_task = asyncio.ensure_future(self._run_fit_probe(tokens))

    async def _run_fit_probe(self, tokens: int) -> None:
        """Probe, and probe again while the probes find the fit stale (each as soon as
        the schedule allows, at most MAX_STALE_PROBES_IN_A_ROW): the fit learns on its
        own, not one probe per text refused. Behind a front door, which holds calls
        back from a replica that reported a long wait for a second at a time, one probe
        a call took 6 s to bring a fit from 1.7 s back to the truth."""
        loop = asyncio.get_running_loop()
        bucket_bound = self.settings.length_buckets[self.settings.bucket_of(tokens)]
        bound = min(max(bucket_bound, tokens), self.bundle.classifier.max_seq_length)
        fit = self.predictor.service_time
        # Off the device: held as a text on its way (in `load`), so that no other
        # model's cold start takes it off again between its copy and the first probe.
        arriving = not self.is_resident
        if arriving:
            self.begin_arrival()
        try:
            if arriving:
                await self.worker.ensure_resident(self, loop.time() + MAX_GAP_SECONDS)
            stand_in = self._stand_ins(1, bound)
            for _ in range(MAX_STALE_PROBES_IN_A_ROW):
                async with self.worker.turn():
                    # Checked in the turn, where an eviction takes the weights off:
                    # between probes, an idle on_demand model may have left the
                    # device, and a forward on it failed on tensors no longer there.
                    if self.stopped or not self.is_resident:
                        return
                    predicted = fit.predict(1, bound)
                    outcome = await self.worker.execute(
                        functools.partial(self._compute, timed=False), stand_in
                    )
                if arriving:
                    arriving = False
                    self.end_arrival()
                verdict = self._fit_probe.judge(predicted, outcome.seconds, loop.time())
                fit.record(1, bound, outcome.seconds, past_weight=verdict.past_weight)
                self._metrics.fit_probes.labels(self.name, self.worker.name, verdict.outcome).inc()
                if verdict.outcome != STALE or self.stopped:
                    return
                log.info(
                    "service-time fit found stale by a probe: learning again",
                    extra={
                        "model": self.name,
                        "worker": self.worker.name,
                        "tokens": bound,
                        "predicted_ms": round(predicted * 1000, 1),
                        "took_ms": round(outcome.seconds * 1000, 1),
                        "now_predicted_ms": round(fit.predict(1, bound) * 1000, 1),
                    },
                )
                await asyncio.sleep(max(self._fit_probe.next_at - loop.time(), 0.0))
        except Exception as error:  # the device's failures are the batches' to report
            self._fit_probe.failed(loop.time())
            self._metrics.fit_probes.labels(self.name, self.worker.name, PROBE_FAILED).inc()
            log.warning(
                "service-time fit probe failed",
                extra={"model": self.name, "worker": self.worker.name, "error": repr(error)},
            )
        finally:
            if arriving:
                self.end_arrival()
            self._fit_probe.running = False

    def _stand_ins(self, texts: int, tokens: int) -> list[EncodedText]:
        """`texts` texts of `tokens` ids each, from the model's own tokenizer: another
        vocabulary's ids may lie past this model's embedding table."""
        return [self.bundle.classifier.tokenizer.stand_in(tokens)] * texts

    def _require_finite(self, outcome: BatchOutcome) -> None:
        if not all(outcome.finite_rows):
            raise BundleError(
                f"{self.bundle.version}: warm-up on {self.worker.name} produced non-finite scores"
            )

    def measured_shape(self, memory_warm_up: str) -> tuple[int, int]:
        """(texts, tokens) of the warm-up the ledger measures (see MEMORY_WARM_UPS)."""
        if memory_warm_up == "small":
            return warm_up_shapes(self.bundle.classifier.max_seq_length)[-1]
        # NOTE: not the last length bucket's bound: a text longer than it still joins
        # that bucket (BatchingSettings.bucket_of), padded up to the model's own limit,
        # so with `length_buckets: [8]` a batch of max_seq_length texts still runs,
        # and a ledger measured at 8 tokens would let it past the budget.
        return self.settings.max_batch_size, self.bundle.classifier.max_seq_length

    async def measure_warm_up(self, memory_warm_up: str) -> tuple[MemoryReading, int]:
        """Warm up at the measured shape; memory after it, and the peak during it."""
        texts, tokens = self.measured_shape(memory_warm_up)
        outcome, after, peak = await self.worker.run_on_device(
            self._measure, self._stand_ins(texts, tokens)
        )
        self._require_finite(outcome)
        return after, peak

    def _measure(self, encoded: list[EncodedText]) -> tuple[BatchOutcome, MemoryReading, int]:
        """On the device thread: one forward in a peak window of its own."""
        device = self.worker.device
        with PEAK_WINDOW:
            reset_peak(device)
            # Untimed: the first forward of its shape, slow for the same reason as
            # warm_up's first ones.
            outcome = self._compute(encoded, timed=False)
            peak = read_peak(device)
        return outcome, read_memory(device), peak

    def _compute(
        self,
        encoded: list[EncodedText],
        deadlines: list[float | None] | None = None,
        on_left_out: LeftOut | None = None,
        callers: Sequence[asyncio.Future[Any]] | None = None,
        *,
        timed: bool = True,
    ) -> BatchOutcome:
        """On the device thread: one forward pass, timed for the service-time fit
        (unless not `timed`).

        Texts are left out, never computed, when their deadline (event-loop time,
        which is time.monotonic) has passed (`expired`), or would pass before the
        forward is predicted to end (`unreachable`): an answer after the deadline
        reaches no one, and its share of the forward is taken from texts that can
        still be answered in time. When the whole batch would end too late for some,
        the forward holds the most texts it can end in time for
        (WaitPredictor.texts_that_fit). The batcher picks batches that way as it
        forms them, by the predicted start (batcher.py); this is the last check,
        for when the device frees later than predicted. So are texts whose callers
        have gone since the batch was handed over (`callers`' futures cancelled: a
        hedged call's loser), and a batch all of whose callers have gone does not
        run. `on_left_out` hears of them before the forward begins.
        """
        now = time.monotonic()
        deadlines = deadlines or [None] * len(encoded)
        # Read across threads, so possibly stale: at worst a caller that has just gone
        # has its text computed, as before it went.
        gone = tuple(c.cancelled() for c in callers) if callers else (False,) * len(encoded)
        expired = tuple(
            not away and d is not None and d <= now for d, away in zip(deadlines, gone, strict=True)
        )
        live = [i for i in range(len(encoded)) if not expired[i] and not gone[i]]
        fits, predicted = self.predictor.texts_that_fit(
            [len(encoded[i]) for i in live], [deadlines[i] for i in live], now
        )
        taken = {index for index, fit in zip(live, fits, strict=True) if fit}
        unreachable = tuple(
            not expired[i] and not gone[i] and i not in taken for i in range(len(encoded))
        )
        if not taken or len(taken) < len(encoded):
            left_out = BatchOutcome(
                [], (), 0, 0.0, None, "monotonic", expired, unreachable, predicted, now, gone
            )
            if not taken:
                return left_out
            if on_left_out is not None:
                on_left_out(left_out)
        encoded = [text for i, text in enumerate(encoded) if i in taken]
        clock = StageClock(self.worker.device)
        padded = max(len(text) for text in encoded)
        lanes = self.worker.lanes
        if lanes is not None and not lanes.worth_splitting(
            self.predictor.service_time.predict(len(encoded), padded)
        ):
            lanes = None
        started = time.perf_counter()
        result = self.bundle.classifier.run(encoded, clock, lanes)
        seconds = time.perf_counter() - started
        if timed:
            self.predictor.service_time.record(len(encoded), padded, seconds)
        # One call to leave torch: checks on the tensor would each give up the GIL and
        # wait to win it back from the serving loop; these are plain Python floats.
        rows = result.probabilities.tolist()
        return BatchOutcome(
            probabilities=rows,
            finite_rows=tuple(all(map(math.isfinite, row)) for row in rows),
            padded_tokens=padded,
            seconds=seconds,
            marks=clock.marks(),
            clock=clock.kind,
            expired=expired,
            unreachable=unreachable,
            predicted_seconds=predicted,
            started_at=now,
            gone=gone,
        )

    async def wait_idle(self) -> None:
        """Return once nothing is arriving, queued or computing."""
        while self.arriving or self.queue or self.in_flight:
            self._idle.clear()
            await self._idle.wait()

    async def stop(self, error: Exception) -> None:
        self.stopped = True
        if self._fit_probe_task is not None:
            self._fit_probe_task.cancel()
        await self.batcher.stop(error)
        if self.worker.replicas.get(self.name) not in (None, self):
            # Retired by a swap: the series is the serving version's now (same labels).
            return
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
        memory_budget_bytes: int,
        memory_warm_up: str = "largest",
        cpu_compute_nice: int = 0,
        cpu_threads: int = 1,
        on_cold_start: Callable[[ModelReplica], None] = lambda replica: None,
    ) -> None:
        """`cpu_threads`: torch intra-op threads of a CPU worker's device thread (a CUDA
        worker's runs on one: capability.workers.threads); `on_cold_start(replica)`:
        told once an on_demand replica has been copied onto the device."""
        self.device = device
        self.name = name
        self._metrics = metrics
        self._memory_threshold = memory_threshold
        # What the model versions resident here may hold together, in bytes.
        self.memory_budget_bytes = memory_budget_bytes
        self._memory_warm_up = memory_warm_up
        metrics.device_memory_budget.labels(name).set(memory_budget_bytes)
        # On a GPU the thread only launches kernels: it must not wait for the CPU.
        on_cpu = device.type == "cpu"
        nice = cpu_compute_nice if on_cpu else 0
        self._device_thread = DeviceThread(
            f"device-{name}", nice=nice, intra_op_threads=cpu_threads if on_cpu else 1
        )
        # A CPU worker's forwards of several texts run one part per core (threads.py).
        self.lanes = (
            CpuLanes(f"device-{name}", cpu_threads, nice) if on_cpu and cpu_threads > 1 else None
        )
        # Whoever holds this may use the device next (FIFO): batches of every
        # replica, warm-ups and maintenance take turns through it (see `turn`).
        self._device_turn = asyncio.Lock()
        self._waiting_for_turn = 0
        self.replicas: dict[str, ModelReplica] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        # Replaced versions still finishing their work: resident until released.
        self._retiring_replicas: set[ModelReplica] = set()
        # Bytes promised to the versions loading here, by model, from the room made
        # for their weights until they serve or are refused (make_room_for_load). Not
        # in `replicas` yet, their weights were on the device uncounted: a cold start
        # of an on_demand model found room in what a load had just made for itself,
        # and two loads each made room for one of them.
        self._reserved: dict[str, int] = {}
        # Held while an on_demand replica's weights move on or off the device.
        self._residency = asyncio.Lock()
        # Takes idle on_demand replicas off the device; started with the first one.
        self._evictor: asyncio.Task[None] | None = None
        # Evictions and cold starts under way, each run to its end even when its caller
        # is cancelled (_evict, _copy_on); close waits for them before the device
        # thread stops.
        self._evictions: set[asyncio.Task[None]] = set()
        # Resolved (and replaced) whenever a cold start's copy ends: wakes the texts
        # waiting for the residency lock to see whether their model is on now. A
        # future taken before the wait, not an event set and cleared at once: a waiter
        # whose wait had not started yet missed that.
        self._next_copy: asyncio.Future[None] | None = None
        self._on_cold_start = on_cold_start
        # Cold starts and loads waiting for an on_demand replica here to go idle, and
        # set whenever none is.
        self.room_wanted = 0
        self._no_room_wanted = asyncio.Event()
        self._no_room_wanted.set()

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

    def wait_predictors(self) -> Iterator[WaitPredictor]:
        """The wait predictors of the replicas whose batches this device computes:
        serving and retiring versions."""
        for replica in self.replicas.values():
            yield replica.predictor
        for replica in self._retiring_replicas:
            yield replica.predictor

    def held_bytes(self) -> int:
        """Footprints of the versions whose weights are on the device: serving, and
        retiring ones (an on_demand one only while it is there); and the room promised
        to the versions loading here."""
        here = [*self.replicas.values(), *self._retiring_replicas]
        on_device = sum(
            r.ledger.footprint_bytes for r in here if r.ledger is not None and r.is_resident
        )
        return on_device + sum(self._reserved.values())

    def release_room(self, model: str) -> None:
        """The load of `model` here has ended (serving, or refused): its promised room
        is no longer held for it."""
        self._reserved.pop(model, None)

    def load_watch(self, model: str, version: str) -> BudgetedLoad:
        """The LoadWatch for loading `version` of `model` onto this worker now."""
        return BudgetedLoad(self, model, version)

    async def make_room_for_load(self, needed: int, model: str) -> int:
        """Make room for a version of `model` loading here that needs `needed` bytes, as a
        cold start does (`_make_room`), and hold it for that version (release_room ends
        that); the bytes held then by all else, which the caller refuses the version
        against (refuse_over_budget) if they still leave no room."""
        loop = asyncio.get_running_loop()
        async with self._residency:
            # Made again (the measured footprint after the predicted one): what was held
            # for this version before is not held against it.
            self._reserved.pop(model, None)
            held = await self._evict_for_room(needed, loop.time() + ROOM_WAIT_SECONDS)
            if held + needed <= self.memory_budget_bytes:
                self._reserved[model] = needed
            return held

    def refuse_over_budget(
        self, model: str, version: str, needed: int, how: str, held: int
    ) -> None:
        """Raise MemoryBudgetExceeded, naming the numbers, if `needed` bytes beside
        `held` ones would exceed the budget."""
        budget = self.memory_budget_bytes
        if held + needed <= budget:
            return
        loading = sum(bytes_ for other, bytes_ in self._reserved.items() if other != model)
        others = (
            f", {format_bytes(loading)} of it held for other versions loading" if loading else ""
        )
        raise MemoryBudgetExceeded(
            f"version {version} of {model} needs {format_bytes(needed)} ({needed} bytes; "
            f"{how}) on {self.name}, where the resident versions hold {format_bytes(held)} "
            f"({held} bytes{others}): {held + needed} bytes exceed the device memory budget of "
            f"{format_bytes(budget)} ({budget} bytes, --device-memory-budget)"
        )

    async def prepare(
        self,
        bundle: LoadedBundle,
        settings: BatchingSettings,
        predicted_bytes: int = 0,
        *,
        residency: str = RESIDENT,
        idle_seconds: float = 0.0,
        shard_devices: list[torch.device] | None = None,
        room_for: str | None = None,
    ) -> ModelReplica:
        """A warmed-up replica of `bundle` on this device, with its ledger entry, not
        yet serving; refused (MemoryBudgetExceeded) when its measured footprint does
        not fit beside the resident versions, once idle on_demand ones have left to
        make room. An on_demand one then waits in host memory; a sharded one has its
        layers split across `shard_devices` first. `room_for`: the model its load's room
        is held for (make_room_for_load; default the bundle's name), until the caller
        releases it once the version serves or is refused."""
        room_for = room_for or bundle.name
        replica = ModelReplica(bundle, self, settings, self._metrics, residency, idle_seconds)
        if residency == SHARDED:
            await self.run_on_device(replica.shard, shard_devices or [self.device])
        await replica.warm_up()
        texts, tokens = replica.measured_shape(self._memory_warm_up)
        serving = self.replicas.get(bundle.name)
        measured = None if serving is None else self._measured_alike(replica, serving)
        if serving is None or measured is None:
            after, peak = await replica.measure_warm_up(self._memory_warm_up)
            how = f"measured: warm-up peak at {texts} texts x {tokens} tokens"
            ledger = MemoryLedger(
                source=memory_source(self.device),
                weights_bytes=bundle.memory_bytes,
                predicted_bytes=predicted_bytes or bundle.memory_bytes,
                stages=bundle.stage_memory,
                after_warm_up=after,
                warm_up_peak_bytes=peak,
                warm_up_batch_size=texts,
                warm_up_tokens=tokens,
            )
        else:
            ledger = carry_ledger(
                measured, serving.bundle.version, bundle, predicted_bytes, read_memory(self.device)
            )
            how = (
                f"measured on version {ledger.carried_from}: warm-up peak at {texts} texts "
                f"x {tokens} tokens, beyond its weights"
            )
            log.info(
                "memory measurement carried over: the version computes alike",
                extra={
                    "model": bundle.name,
                    "version": bundle.version,
                    "worker": self.name,
                    "carried_from": ledger.carried_from,
                    "footprint_bytes": ledger.footprint_bytes,
                },
            )
        replica.ledger = ledger
        if residency == ON_DEMAND:
            # Its weights leave the device next, and its cold starts make their own room:
            # it need only fit beside what cannot leave (evicting now would be for nothing).
            own = self._reserved.get(room_for, 0)
            held = self.held_bytes() - own - self._movable_bytes(replica)
        else:
            held = await self.make_room_for_load(ledger.footprint_bytes, room_for)
        self.refuse_over_budget(room_for, bundle.version, ledger.footprint_bytes, how, held)
        if residency == ON_DEMAND:
            await self.run_on_device(replica.keep_on_host)
            # Its weights are off the device: nothing is held for it until a cold start.
            self.release_room(room_for)
            await self.release_cached(CACHE_RELEASE_EVICTED)
        return replica

    def _measured_alike(self, replica: ModelReplica, serving: ModelReplica) -> MemoryLedger | None:
        """The serving version's ledger entry when `replica` would measure the same
        overhead beyond its weights: the same compute shape (dimensions, precision,
        graph), measured at the same batch and length, kept the same way. None: it
        must be measured itself."""
        ledger = serving.ledger
        if ledger is None or not replica.bundle.compute_shape:
            return None
        alike = (
            replica.bundle.compute_shape == serving.bundle.compute_shape
            and replica.residency == serving.residency
            and replica.measured_shape(self._memory_warm_up)
            == (ledger.warm_up_batch_size, ledger.warm_up_tokens)
        )
        return ledger if alike else None

    async def ensure_resident(self, replica: ModelReplica, give_up_at: float | None = None) -> None:
        """Copy an on_demand replica's weights onto the device if they are not there
        (a cold start, counted and timed), making room first by evicting idle on_demand
        replicas, least recently used first; when every one is busy, waiting for one to
        go idle until `give_up_at` (event-loop time: the latest the cold start may begin
        and still answer in time, ModelReplica.latest_cold_start; None:
        ROOM_WAIT_SECONDS from now). DeviceMemoryPressure when none can go by then, or
        when the cold starts and loads ahead of this one hold the residency lock until
        then: refused while the caller still has time to fall back."""
        if replica.is_resident:
            return
        loop = asyncio.get_running_loop()
        if give_up_at is None:
            give_up_at = loop.time() + ROOM_WAIT_SECONDS
        # The lock is waited for until then too: behind a cold start that waits for room,
        # this one would otherwise wait past its caller's deadline.
        try:
            async with asyncio.timeout_at(give_up_at):
                locked = await self._lock_unless_copied(replica)
        except TimeoutError:
            raise DeviceMemoryPressure(
                f"model {replica.name} is not on {self.name}, and the cold starts and loads "
                "making room there ahead of it left no time to copy it there and answer "
                "in time",
                retry_after_seconds=1.0,
                worker=self.name,
            ) from None
        if not locked:
            return  # another text's cold start brought it on meanwhile
        copying: asyncio.Task[None] | None = None
        try:
            weights = replica.on_demand
            if weights is None or weights.resident:
                return
            if self.replicas.get(replica.name) is not replica:
                # A swap replaced it while the text was on its way here: its copy would
                # serve this text alone, cost a cold start and room, and leave the
                # model reported on the device while its serving version is not. As
                # for the texts a retiring version leaves: the caller sends it again.
                raise ServerDraining("the model version was replaced", worker=self.name)
            await self._make_room(replica, give_up_at)
            # Runs to its end, the lock held and its bookkeeping done, even when the
            # caller is cancelled: cancelled with it, the device thread still finished
            # the copy, and the weights sat on the device with no cold start counted
            # or timed (a slow copy never taught the prediction), the model reported
            # off it, and its result-cache refill parked for good.
            copying = self._run_to_its_end(
                self._copy_on(replica, weights),
                replica,
                "model could not be copied onto the device",
            )
        finally:
            if copying is None:
                self._residency.release()
        await asyncio.shield(copying)

    async def _lock_unless_copied(self, replica: ModelReplica) -> bool:
        """Take the residency lock (True), unless `replica` is copied onto the device
        first, by another text's cold start (False, the lock not held). Waiting for the
        lock alone, a text of a model that came on meanwhile counted as that model's
        load, while the cold start holding the lock waited for that model to go idle
        to make room: each waited for the other until one gave up (10 s without a
        deadline), and the model on the device answered nothing meanwhile."""
        acquiring = asyncio.ensure_future(self._residency.acquire())
        try:
            while not acquiring.done() and not replica.is_resident:
                if self._next_copy is None:
                    self._next_copy = asyncio.get_running_loop().create_future()
                await asyncio.wait(
                    (acquiring, self._next_copy), return_when=asyncio.FIRST_COMPLETED
                )
        except BaseException:
            self._give_up_lock(acquiring)
            raise
        if not acquiring.done() or replica.is_resident:
            self._give_up_lock(acquiring)
            return False
        return True

    def _give_up_lock(self, acquiring: asyncio.Task[Any]) -> None:
        """Stop waiting for the residency lock; release it if it was taken meanwhile.
        Not awaited: awaiting the cancelled wait swallowed a cancellation of the
        caller's own that arrived meanwhile."""
        if not acquiring.done():
            acquiring.cancel()  # the lock hands itself on if it was granted meanwhile
        elif not acquiring.cancelled() and acquiring.exception() is None:
            self._residency.release()

    async def _copy_on(self, replica: ModelReplica, weights: OnDemandWeights) -> None:
        """The copy of a cold start, under the residency lock (released here), and its
        count, time and state."""
        try:
            started = time.perf_counter()
            try:
                await self.run_on_device(weights.restore)
            except torch.OutOfMemoryError as exc:
                raise DeviceMemoryPressure(
                    f"{self.name} ran out of memory copying model {replica.name} onto it",
                    retry_after_seconds=1.0,
                    worker=self.name,
                ) from exc
            seconds = time.perf_counter() - started
        finally:
            self._residency.release()
            copied, self._next_copy = self._next_copy, None
            if copied is not None:
                copied.set_result(None)
        replica.cold_start_seconds = seconds
        replica.last_used = time.monotonic()
        self._metrics.model_cold_starts.labels(replica.name, self.name).inc()
        self._metrics.model_cold_start_seconds.labels(replica.name).observe(seconds)
        self._show_resident(replica, 1)
        log.info(
            "model copied onto the device",
            extra={"model": replica.name, "worker": self.name, "seconds": round(seconds, 3)},
        )
        self._on_cold_start(replica)

    def _show_resident(self, replica: ModelReplica, resident: int) -> None:
        """Set the model's `model_resident` series, if `replica` is still its serving
        version: the series is the model's, and a retired version's copy ending after
        a swap set it to 1 while the serving version was off the device."""
        if self.replicas.get(replica.name) is replica:
            self._metrics.model_resident.labels(replica.name, self.name).set(resident)

    async def _make_room(self, replica: ModelReplica, give_up_at: float) -> None:
        """Make room for `replica`'s footprint (`_evict_for_room`), or raise
        DeviceMemoryPressure. The caller holds the residency lock, so cold starts queue
        behind this one while the resident models keep serving."""
        assert replica.ledger is not None, "a serving replica has its ledger entry"
        needed = replica.ledger.footprint_bytes
        held = await self._evict_for_room(needed, give_up_at, replica)
        if held + needed <= self.memory_budget_bytes:
            return
        staying = held - self._movable_bytes(replica)
        why = (
            f"the models that cannot leave it (resident ones, versions being replaced or "
            f"loaded) "
            f"hold {format_bytes(staying)}: it fits only once they hold less"
            if staying + needed > self.memory_budget_bytes
            else "none went idle in time to make room"
        )
        raise DeviceMemoryPressure(
            f"model {replica.name} needs {format_bytes(needed)} on {self.name}, where "
            f"the models on the device hold {format_bytes(held)} of the "
            f"{format_bytes(self.memory_budget_bytes)} budget and {why}",
            retry_after_seconds=1.0,
            worker=self.name,
        )

    def _evictable(self, keep: ModelReplica | None) -> list[ModelReplica]:
        """The on_demand replicas on the device that could leave it to make room."""
        return [
            other
            for other in self.replicas.values()
            if other.on_demand is not None and other.is_resident and other is not keep
        ]

    def _movable_bytes(self, keep: ModelReplica | None) -> int:
        """What the replicas that could leave the device (`_evictable`) hold on it."""
        return sum(o.ledger.footprint_bytes for o in self._evictable(keep) if o.ledger is not None)

    async def _evict_for_room(
        self, needed: int, give_up_at: float, keep: ModelReplica | None = None
    ) -> int:
        """Evict idle on_demand replicas (but `keep`), least recently used first, until
        `needed` more bytes fit the budget; while every evictable one is busy, wait for
        one to go idle, until `give_up_at` (event-loop time). The bytes held then (with
        `needed`, over the budget when no room was made in time). The caller holds the
        residency lock."""
        loop = asyncio.get_running_loop()
        # Said from the first look to the last eviction, so that a result-cache refill
        # keeping a replica busy pauses at its next chunk (WorkerPool._warm_cache): no
        # caller waits on it. Said only while waiting, the refill's next chunk went in
        # between the replica going idle and its eviction, and kept it busy to the end.
        self.room_wanted += 1
        self._no_room_wanted.clear()
        try:
            while (held := self.held_bytes()) + needed > self.memory_budget_bytes:
                if held - self._movable_bytes(keep) + needed > self.memory_budget_bytes:
                    break  # not even with all of them off: evict none for nothing, nor wait
                evictable = self._evictable(keep)
                idle = [other for other in evictable if not other.load]
                if idle:
                    least_used = min(idle, key=lambda other: other.last_used)
                    await self._evict(least_used, EVICTED_FOR_ROOM)
                    continue
                if not evictable or not await _one_goes_idle(evictable, give_up_at - loop.time()):
                    break
        finally:
            self.room_wanted -= 1
            if not self.room_wanted:
                self._no_room_wanted.set()
        return held

    async def room_made(self) -> None:
        """Return once no cold start or load here waits for room (at once if none)."""
        await self._no_room_wanted.wait()

    async def _evict(self, replica: ModelReplica, reason: str) -> None:
        """Take an idle on_demand replica's weights off the device (`_take_off`); the
        caller holds the residency lock. Runs to its end even when the caller is
        cancelled (a caller's deadline, an abandoned load), then without that lock:
        cancelled once the weights counted as off the device, the device thread
        skipped the job and left them there, uncounted."""
        eviction = self._run_to_its_end(
            self._take_off(replica, reason), replica, "model could not be taken off the device"
        )
        await asyncio.shield(eviction)

    def _run_to_its_end(
        self, moving: Coroutine[Any, Any, None], replica: ModelReplica, failed: str
    ) -> asyncio.Task[None]:
        """`moving` (an eviction or a copy of `replica`) as a task that close() waits
        for, and that logs `failed` if it fails: its caller may have been cancelled,
        and then nothing else reads its exception."""
        task = asyncio.create_task(moving)
        self._evictions.add(task)
        task.add_done_callback(self._evictions.discard)
        task.add_done_callback(functools.partial(_log_if_failed, failed, replica, self.name))
        return task

    async def _take_off(self, replica: ModelReplica, reason: str) -> None:
        """In the device's turn: unless the replica got work meanwhile (it stays), mark
        its weights off the device and have the device thread take them off; then
        count it and hand the device's cached blocks back."""
        weights = replica.on_demand
        async with self.turn():
            if weights is None or not weights.resident or replica.load:
                return
            # NOTE: marked off before the await, in the same step as the load check:
            # until the device thread has run `evict`, `resident` would still say
            # True, and a request arriving meanwhile would be admitted without a cold
            # start and computed on the evicted (meta) weights.
            weights.begin_eviction()
            await self.execute(weights.evict)
        self._metrics.model_evictions.labels(replica.name, self.name, reason).inc()
        self._show_resident(replica, 0)
        await self.release_cached(CACHE_RELEASE_EVICTED)
        log.info(
            "model taken off the device",
            extra={"model": replica.name, "worker": self.name, "reason": reason},
        )

    async def _evict_idle(self) -> None:
        """Forever: take on_demand replicas unused for their idle_seconds off the device."""
        while True:
            shortest = min(
                (r.idle_seconds for r in self.replicas.values() if r.on_demand is not None),
                default=EVICTION_POLL_SECONDS * 4,
            )
            await asyncio.sleep(min(EVICTION_POLL_SECONDS, shortest / 4))
            # Listed after the sleep, and each checked again under the lock: listed
            # before, a version a swap retired meanwhile was evicted as the model's
            # idle one, counted, and the model shown off the device while its new
            # version was on it.
            for replica in [r for r in self.replicas.values() if r.on_demand is not None]:
                if not replica.is_resident or replica.load:
                    continue
                if time.monotonic() - replica.last_used < replica.idle_seconds:
                    continue
                async with self._residency:
                    serving = self.replicas.get(replica.name) is replica
                    if serving and time.monotonic() - replica.last_used >= replica.idle_seconds:
                        # An eviction that fails is logged (_log_if_failed); raised
                        # here, it ended this task, and no idle model left again.
                        with contextlib.suppress(Exception):
                            await self._evict(replica, EVICTED_IDLE)

    async def release_cached(self, reason: str) -> None:
        """Hand the device's unused cached blocks back, on the device thread (counted)."""
        await self.run_on_device(release_cached, self.device)
        self._metrics.cache_releases.labels(self.name, reason).inc()

    async def activate(self, replica: ModelReplica, load_seconds: float) -> None:
        """Make `replica` the one new requests join; the previous version retires.
        `load_seconds`: from the start of its load until now (WorkerPool.load)."""
        bundle = replica.bundle
        replica.start()
        previous = self.replicas.get(bundle.name)
        self.replicas[bundle.name] = replica
        self._metrics.model_info.labels(
            bundle.name, bundle.version, self.name, bundle.precision
        ).set(1)
        self._metrics.model_load_seconds.labels(bundle.name, self.name).set(load_seconds)
        if replica.ledger is not None:
            self._metrics.show_ledger(bundle.name, bundle.version, self.name, replica.ledger)
        self._metrics.model_resident.labels(bundle.name, self.name).set(int(replica.is_resident))
        if replica.on_demand is not None and self._evictor is None:
            self._evictor = asyncio.create_task(self._evict_idle(), name=f"evictor-{self.name}")
        if previous is not None:
            # The queue-depth series (model, worker) is the serving version's from now:
            # the retiring one, draining, wrote its own queue over the new one's.
            previous.batcher.reports_depth = False
            replica.batcher.show_queue_depth()
            self._retiring_replicas.add(previous)
            task = asyncio.create_task(self._retire(previous))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _retire(self, replica: ModelReplica) -> None:
        """Finish what the old version admitted (and what was on its way), let it go,
        then release the device's cached blocks it leaves behind."""
        await replica.wait_idle()
        await replica.stop(ServerDraining("the model version was replaced"))
        name, version, precision = replica.name, replica.bundle.version, replica.bundle.precision
        if self.replicas.get(name) is not replica:
            # Only drop its series if the new version does not share their labels.
            current = self.replicas.get(name)
            if current is None or current.bundle.version != version:
                self._metrics.model_info.remove(name, version, self.name, precision)
                for kind in MODEL_MEMORY_KINDS:
                    with contextlib.suppress(KeyError):
                        self._metrics.model_memory.remove(name, version, self.name, kind)
        self._retiring_replicas.discard(replica)
        # NOTE: the last reference to the old version's tensors goes here, so that
        # the release below finds their blocks free.
        del replica
        await self.release_cached(CACHE_RELEASE_RETIRED)
        log.info(
            "model version retired",
            extra={"model": name, "version": version, "worker": self.name},
        )

    async def drain(self) -> None:
        """Wait until every request routed here is answered (the pool admits no new ones)."""
        await asyncio.gather(*(replica.wait_idle() for replica in self.replicas.values()))
        if self._retiring:
            await asyncio.gather(*self._retiring)

    async def close(self) -> None:
        if self._evictor is not None:
            self._evictor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._evictor
        # An eviction or a copy outlives its cancelled caller, and needs the device
        # thread; shielded, so that a cancelled close does not cancel them halfway.
        await asyncio.gather(*map(asyncio.shield, self._evictions), return_exceptions=True)
        # The retiring versions too: a drain whose grace ran out cancelled their
        # retiring, and their batching loops went on running.
        for replica in [*self.replicas.values(), *self._retiring_replicas]:
            await replica.stop(ServerDraining("the server is shutting down"))
        self._device_thread.close()
        if self.lanes is not None:
            self.lanes.close()


def _log_if_failed(
    message: str, replica: ModelReplica, worker: str, moving: asyncio.Task[None]
) -> None:
    """Log `message` for an eviction or a copy that failed, once it ends."""
    if moving.cancelled() or (error := moving.exception()) is None:
        return
    log.error(message, extra={"model": replica.name, "worker": worker, "error": repr(error)})


def carry_ledger(
    measured: MemoryLedger,
    measured_version: str,
    bundle: LoadedBundle,
    predicted_bytes: int,
    now: MemoryReading,
) -> MemoryLedger:
    """A ledger entry for `bundle` from `measured`, the entry of `measured_version`, a
    version that computes alike: its own weights and load stages, and the overhead
    beyond the weights that `measured`'s warm-up found (footprint = weights + that
    overhead). `now`: memory after `bundle`'s own (small) warm-up."""
    overhead = measured.footprint_bytes - measured.weights_bytes
    before = bundle.stage_memory[0].before if bundle.stage_memory else now
    return MemoryLedger(
        source=measured.source,
        weights_bytes=bundle.memory_bytes,
        predicted_bytes=predicted_bytes or bundle.memory_bytes,
        stages=bundle.stage_memory,
        after_warm_up=now,
        # The peak such a warm-up reaches above this version's start: what
        # footprint_bytes reads.
        warm_up_peak_bytes=before.allocated_bytes + bundle.memory_bytes + overhead,
        warm_up_batch_size=measured.warm_up_batch_size,
        warm_up_tokens=measured.warm_up_tokens,
        carried_from=measured.carried_from or measured_version,
    )


async def _one_goes_idle(replicas: Sequence[ModelReplica], seconds: float) -> bool:
    """Whether any of `replicas` has nothing arriving, queued or computing within
    `seconds`."""
    if seconds <= 0:
        return False
    waits = [asyncio.ensure_future(replica.wait_idle()) for replica in replicas]
    try:
        done, _ = await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return bool(done)

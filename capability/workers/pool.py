"""The workers of one server, and the dispatch of requests to them.

A request is tokenized by the replica it will run on (on the event loop when
short, else on a tokenizer thread), looked up in the result cache (a hit is
answered at once; capability/result_cache.py), then admitted to the least-loaded
worker that holds its model. A batch call's texts are grouped by model: each group
goes to one replica, is tokenized in one tokenizer call per `max_length` and
admitted in one step (capability.workers.admission), and every text is answered
on its own. Loading a model version loads one replica per worker, each on its
own device, and switches all workers only when every replica loaded: a version
that fails anywhere (a bad file, a footprint over a worker's device memory budget)
serves nowhere, and the previous version keeps serving. A load refills the result
cache; an on_demand model's refill waits until a caller brings it onto a device.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

from ai.classify.v1 import classify_service_pb2 as pb
from capability.batching import (
    PRIORITY_BATCH,
    Admission,
    BatchingSettings,
    TextResult,
)
from capability.bundle import BundleError, LoadedBundle, load_bundle
from capability.memory import LoadWatch, MemoryLedger, budget_bytes
from capability.metrics import (
    CACHE_RELEASE_REFUSED,
    CLASSIFY_BATCH_METHOD,
    CLASSIFY_METHOD,
    DEADLINE_STAGE_ADMISSION,
    CapabilityMetrics,
)
from capability.model import DEFAULT_GRAPH
from capability.result_cache import (
    DEFAULT_BYTES,
    DEFAULT_ENTRIES,
    DEFAULT_WARM,
    ResultCache,
    WarmText,
)
from capability.workers.admission import (
    CACHE_BYPASS,
    CACHE_REFRESH,
    CACHE_USE,
    Admitter,
    TextRequest,
    admit_groups,
    answered_from_cache,
    priority_lane,
    record_cache_hit,
    remember_result,
)
from capability.workers.residency import DEFAULT_IDLE_SECONDS, ON_DEMAND, RESIDENT, SHARDED
from capability.workers.threads import compute_inline, cpu_threads_per_worker
from capability.workers.worker import DeviceWorker, ModelReplica
from classify_common.context import new_request_id
from classify_common.errors import (
    DeadlineExpired,
    InternalError,
    ModelNotFound,
    ModelNotReady,
    ServerDraining,
    ServiceError,
    UnreadableText,
)
from classify_common.nodes import (
    CLASSIFY_OUTCOME,
    CLASSIFY_PREDICTED_WAIT_MS,
    CLASSIFY_QUEUE_DEPTH,
    CLASSIFY_TOKENS,
    CLASSIFY_TRUNCATED,
    CLASSIFY_WORKER,
    QUEUE_ADMIT,
    TOKENIZE,
    current_trace,
    node,
)

log = logging.getLogger(__name__)

# The load report predicts the wait of a short text: a headline is 10-20 tokens.
LOAD_REPORT_TOKENS = 16


async def _first_failures(
    waiting: Sequence[tuple[int, asyncio.Future[TextResult]]],
) -> dict[int, ServiceError]:
    """Once one of `waiting` fails while others are still to be computed, those that
    have failed, by index; none when all are done first."""
    futures = [future for _, future in waiting]
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    if not pending:
        return {}
    return {
        index: error
        for index, future in waiting
        if future in done
        and not future.cancelled()
        and isinstance(error := future.exception(), ServiceError)
    }


def _settled(future: asyncio.Future[TextResult]) -> object:
    """A done future's result or error, as gather(return_exceptions=True) gives it."""
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception() or future.result()


def _as_outcome(answer: object, on_bug: Callable[[], None]) -> TextResult | ServiceError:
    """A text's answer as classify_many returns it: anything that is neither a result
    nor a ServiceError is a bug, answered INTERNAL and counted by `on_bug()`."""
    if isinstance(answer, TextResult | ServiceError):
        return answer
    on_bug()
    log.error("a text was left without an answer", extra={"answer": repr(answer)})
    return InternalError("internal error (the text was not answered)")


def discover_devices(setting: str, cpu_workers: int) -> list[torch.device]:
    """`auto`: one worker per CUDA device, else `cpu_workers` CPU workers."""
    if setting == "auto":
        if torch.cuda.is_available():
            return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")] * cpu_workers
    if setting == "cpu":
        return [torch.device("cpu")] * cpu_workers
    return [torch.device(name.strip()) for name in setting.split(",")]


def worker_names(devices: Sequence[torch.device]) -> list[str]:
    """cuda:1 stays "cuda:1"; CPU workers are numbered "cpu:0", "cpu:1", ..."""
    names = []
    cpu_index = 0
    for device in devices:
        if device.type == "cpu":
            names.append(f"cpu:{cpu_index}")
            cpu_index += 1
        else:
            names.append(str(device))
    return names


class WorkerPool:
    def __init__(
        self,
        devices: Sequence[torch.device],
        metrics: CapabilityMetrics,
        *,
        memory_threshold: float,
        memory_budget_bytes: int = 0,
        memory_warm_up: str = "largest",
        cpu_compute_nice: int = 0,
        torch_threads: int = 0,
        trusted_signers: Path | None = None,
        result_cache: tuple[int, int, int] = (DEFAULT_ENTRIES, DEFAULT_BYTES, DEFAULT_WARM),
        on_internal_error: Callable[[], None] = lambda: None,
    ) -> None:
        """`memory_budget_bytes`: each worker's device memory budget (0: a share of its
        device, capability.memory.budget_bytes); `memory_warm_up`: the shape the ledger
        measures (capability.workers.worker.MEMORY_WARM_UPS); `result_cache`: its
        entries (0: off), bytes, and texts recomputed after a swap; `torch_threads`: each
        CPU worker's torch intra-op threads (0: all cores split between them);
        `on_internal_error()` counts a text answered INTERNAL here for a bug (an item of
        a batch call never reaches the interceptor, which counts the call's own)."""
        self._metrics = metrics
        self._on_internal_error = on_internal_error
        # An allowed-signers file every loaded bundle's manifest must be signed by a key
        # of; None loads unsigned bundles too.
        self._trusted_signers = trusted_signers
        self._unary_items = metrics.rpc_items.labels(CLASSIFY_METHOD)
        self._batch_items = metrics.rpc_items.labels(CLASSIFY_BATCH_METHOD)
        cpu_workers = sum(device.type == "cpu" for device in devices)
        self.cpu_threads = cpu_threads_per_worker(cpu_workers, torch_threads)
        self.workers = [
            DeviceWorker(
                device,
                name,
                metrics,
                memory_threshold=memory_threshold,
                memory_budget_bytes=budget_bytes(device, memory_budget_bytes),
                memory_warm_up=memory_warm_up,
                cpu_compute_nice=cpu_compute_nice,
                cpu_threads=self.cpu_threads,
                on_cold_start=self._refill_after_cold_start,
            )
            for device, name in zip(devices, worker_names(devices), strict=True)
        ]
        entries, cache_bytes, warm = result_cache
        self.cache = ResultCache(metrics, max_entries=entries, max_bytes=cache_bytes, warm=warm)
        self._admitter = Admitter(self._count_refusal, self.cache)
        # Refilling the cache after a swap, at batch priority; cancelled at close.
        self._warming: set[asyncio.Task[None]] = set()
        # The texts of an on_demand model's refill, by model, until a caller brings it
        # onto a device: a load copies no model there for the cache's sake.
        self._refill_waiting: dict[str, list[WarmText]] = {}
        # A loader's warm-up computes inline: a loader thread keeping torch threads of
        # its own would slow every forward on the device threads (threads.py).
        self._loaders = ThreadPoolExecutor(
            len(self.workers), thread_name_prefix="load", initializer=compute_inline
        )
        self.draining = False
        # When each model's serving version went live on every worker, and how long
        # from the start of its load until then.
        self._live_since: dict[str, datetime] = {}
        self._load_seconds: dict[str, float] = {}
        # The models the start loads (set by the lifecycle before it loads them): one
        # not live yet is not ready, not unknown.
        self.starting_models: frozenset[str] = frozenset()

    def models(self) -> Mapping[str, LoadedBundle]:
        """The version each model serves now (the same on every worker)."""
        first = self.workers[0]
        return {name: replica.bundle for name, replica in sorted(first.replicas.items())}

    @property
    def trusted_signers(self) -> Path | None:
        """The allowed-signers file a bundle's signature is checked against, if any."""
        return self._trusted_signers

    def serving(self, name: str) -> LoadedBundle:
        bundle = self.models().get(name)
        if bundle is None:
            raise ModelNotFound(f"model {name!r} is not served here", model=name)
        return bundle

    async def load(
        self,
        directory: Path,
        settings: BatchingSettings,
        precision: str | None = None,
        *,
        graph: str = DEFAULT_GRAPH,
        expected_name: str | None = None,
        version: str | None = None,
        residency: str = RESIDENT,
        idle_seconds: float = DEFAULT_IDLE_SECONDS,
        warm_texts: Sequence[WarmText] = (),
    ) -> LoadedBundle:
        """Load the bundle in `directory` on every worker, then switch them all to it,
        and refill the result cache in the background: the previous version's most
        hit texts, and `warm_texts`. It serves as `version` (None: the folder's name;
        see load_bundle).

        What a refused version left on the devices is released before the refusal
        is raised. Its load time runs from here until every worker serves it: reading,
        verifying and warming up (the workers' warm-ups and memory measurement too)."""
        started = time.perf_counter()
        model = expected_name or directory.parent.name
        version = version or directory.name
        try:
            try:
                bundles, replicas = await self._load_everywhere(
                    directory,
                    settings,
                    precision,
                    graph,
                    model,
                    version,
                    expected_name,
                    (residency, idle_seconds),
                )
            except Exception as refused:
                # The traceback's frames hold the refused tensors; drop their locals first.
                traceback.clear_frames(refused.__traceback__)
                for worker in self.workers:
                    await worker.release_cached(CACHE_RELEASE_REFUSED)
                raise
            load_seconds = time.perf_counter() - started
            for replica in replicas:
                await replica.worker.activate(replica, load_seconds)
        finally:
            # Serving (counted as such from here) or refused: the room made for the
            # version is no longer held for it apart.
            for worker in self.workers:
                worker.release_room(model)
        self._live_since[bundles[0].name] = datetime.now(UTC)
        self._load_seconds[bundles[0].name] = load_seconds
        serving = bundles[0]
        carried = self.cache.switch_bundle(serving.name, serving.digest)
        # The old version's most hit texts, those of its refill still waiting for a cold
        # start (an on_demand version never called), then the model's warm_texts file.
        waiting = self._refill_waiting.pop(serving.name, [])
        refill = list(dict.fromkeys([*carried, *waiting, *warm_texts]))
        self._refill_cache(serving.name, refill if self.cache.enabled else [])
        log.info(
            "model version serving",
            extra={
                "model": bundles[0].name,
                "version": bundles[0].version,
                "digest": bundles[0].digest,
                "graph": bundles[0].graph,
                "workers": [w.name for w in self.workers],
                "load_seconds": round(load_seconds, 3),
            },
        )
        return bundles[0]

    async def _load_everywhere(
        self,
        directory: Path,
        settings: BatchingSettings,
        precision: str | None,
        graph: str,
        model: str,
        version: str,
        expected_name: str | None,
        residency: tuple[str, float],
    ) -> tuple[list[LoadedBundle], list[ModelReplica]]:
        """Load and warm up one replica per worker (a sharded model: one, on the first
        worker, its layers across every worker's device), none serving yet; the room
        each worker makes for it is held for `model` (DeviceWorker.make_room_for_load)."""
        loop = asyncio.get_running_loop()
        mode, idle_seconds = residency
        workers = self.workers[:1] if mode == SHARDED else self.workers
        watches = [worker.load_watch(model, version) for worker in workers]
        # Loaded beside the serving version, on loader threads, so serving goes on
        # meanwhile; each worker's replica lives on that worker's device. Every load
        # ends before any refusal is raised, so none is left running.
        loading = asyncio.gather(
            *(
                loop.run_in_executor(
                    self._loaders,
                    _load_on,
                    directory,
                    version,
                    worker.device,
                    precision,
                    graph,
                    self._trusted_signers,
                    watch,
                )
                for worker, watch in zip(workers, watches, strict=True)
            ),
            return_exceptions=True,
        )
        try:
            loaded = await loading
        except asyncio.CancelledError:
            # The server stops: a loader thread ends at its next stage boundary rather
            # than reading and warming up a version nobody will serve (the process
            # waits for its loader threads before it exits).
            for watch in watches:
                watch.abandon()
            raise
        for outcome in loaded:
            if isinstance(outcome, BaseException):
                raise outcome
        bundles = [bundle for bundle in loaded if isinstance(bundle, LoadedBundle)]
        digests = {bundle.digest for bundle in bundles}
        if len(digests) > 1:
            # Each worker reads and verifies the folder on its own: one rewritten while
            # they read it (a re-publish under the same number) served two bundles as
            # one version, and GetModel, the cache and the folder check saw only the
            # first worker's.
            raise BundleError(
                f"manifest.json: the folder changed while the workers read it ({len(digests)} "
                f"different bundles, digests {', '.join(sorted(d[:12] for d in digests))}); "
                "copy a version in whole, then it loads"
            )
        if expected_name is not None and bundles[0].name != expected_name:
            raise BundleError(
                f"config.json: names model {bundles[0].name!r}, but the bundle sits under "
                f"{expected_name!r}"
            )
        # Every replica warms up before any worker switches: a version that fails
        # on one device serves on none.
        replicas = [
            await worker.prepare(
                bundle,
                settings,
                watch.predicted_bytes,
                residency=mode,
                idle_seconds=idle_seconds,
                shard_devices=[each.device for each in self.workers],
                room_for=model,
            )
            for worker, bundle, watch in zip(workers, bundles, watches, strict=True)
        ]
        return bundles, replicas

    def ledgers(self, model: str) -> list[tuple[str, MemoryLedger, int, bool]]:
        """(worker, ledger entry, worker's budget, whether on the device now) of the
        serving version of `model` on each worker."""
        return [
            (worker.name, replica.ledger, worker.memory_budget_bytes, replica.is_resident)
            for worker in self.workers
            if (replica := worker.replicas.get(model)) is not None and replica.ledger is not None
        ]

    def _refill_cache(self, model: str, texts: list[WarmText]) -> None:
        """Compute the old version's most hit texts on the new one, in the background;
        for an on_demand model, once a caller has brought it onto a device (a cold
        start only for the cache would take another model's room, or wait for it)."""
        if not texts:
            return
        if self.residency(model) == ON_DEMAND:
            self._refill_waiting[model] = texts
            log.info(
                "result cache refill waits for the model's next cold start",
                extra={"model": model, "texts": len(texts)},
            )
            return
        self._start_refill(model, texts, None)

    def _refill_after_cold_start(self, replica: ModelReplica) -> None:
        """A worker has brought `replica` onto its device for a caller: refill the
        cache on it with the texts its model's refill left waiting, while it is there."""
        if replica.worker.replicas.get(replica.name) is not replica:
            return  # a version replaced since: the waiting texts are the serving one's
        texts = self._refill_waiting.pop(replica.name, None)
        if texts:
            self._start_refill(replica.name, texts, replica)

    def _start_refill(self, model: str, texts: list[WarmText], onto: ModelReplica | None) -> None:
        """Refill the cache with `texts` in the background (`_warm_cache`), kept until
        done or the pool closes."""
        task = asyncio.create_task(self._warm_cache(model, texts, onto), name=f"warm-cache-{model}")
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _warm_cache(
        self, model: str, texts: list[WarmText], onto: ModelReplica | None
    ) -> None:
        """Compute `texts` into the cache, one chunk at a time, each waited for, on the
        model's least-loaded replica, or all on `onto` (an on_demand replica on its
        device).

        A chunk is at most the free room of the queue it joins, and at most one full
        batch: a warm_texts file may hold 10,000 texts, and admitted all at once all
        but a queue's worth would be refused. One batch at a time leaves the rest of
        the queue to callers. When callers' texts fill the queue, the refill stops
        there: the cache then fills from their texts anyway. When `onto` leaves its
        device, the rest waits for the model's next cold start rather than bringing
        it back. Refusals of refill texts are not counted as admissions refused: no
        caller was refused."""
        computed = 0
        offered = 0
        while offered < len(texts) and not self.draining:
            replica = self._least_loaded(model) if onto is None else onto
            # NOTE: checked in the same step as _classify_many marks the chunk arriving
            # (no await between), and an eviction skips a replica with texts arriving:
            # so a chunk admitted here never needs a cold start.
            # Nor does a refill keep its replica on the device while a cold start or a
            # load there waits for room: it pauses after the chunk in flight, and goes
            # on if the replica is still there once room is made (another model may
            # have left instead); else the rest waits for the model's next cold start.
            if onto is not None and onto.worker.room_wanted:
                await onto.worker.room_made()
                continue
            if onto is not None and (onto.stopped or onto.worker.replicas.get(model) is not onto):
                # A swap retired it: each chunk went on being tokenized and refused
                # (thousands of texts); the new version's refill starts its own.
                break
            if onto is not None and not onto.is_resident:
                if onto.worker.replicas.get(model) is onto:
                    self._refill_waiting.setdefault(model, texts[offered:])
                break
            batching = replica.settings
            room = min(batching.queue_capacity - len(replica.queue), batching.max_batch_size)
            if room <= 0:
                break
            chunk = texts[offered : offered + room]
            offered += len(chunk)
            requests = [
                TextRequest(
                    model=model,
                    text=warm.text,
                    max_length=warm.max_length,
                    priority=PRIORITY_BATCH,
                    request_id=new_request_id(),
                    deadline=None,
                    cache=CACHE_REFRESH,
                    cache_scope=warm.scope,
                    count_refusal=False,
                )
                for warm in chunk
            ]
            outcomes = await self._classify_many(requests, None, replica)
            done = sum(isinstance(outcome, TextResult) for outcome in outcomes)
            computed += done
            self._metrics.result_cache_warmed.labels(model).inc(done)
        log.info(
            "result cache refilled",
            extra={
                "model": model,
                "texts": len(texts),
                "computed": computed,
                "not_offered": len(texts) - offered,
            },
        )

    async def wait_cache_refilled(self) -> None:
        """Return once every refill of the cache after a swap has finished (one waiting
        for an on_demand model's cold start has not begun)."""
        while self._warming:
            await asyncio.gather(*self._warming, return_exceptions=True)

    def residency(self, model: str) -> str:
        """How the serving version of `model` is kept (capability.workers.residency)."""
        return self.workers[0].replicas[model].residency

    def live_since(self, name: str) -> datetime:
        return self._live_since[name]

    def load_seconds(self, name: str) -> float:
        """How long the serving version of `name` took from the start of its load until
        every worker served it."""
        return self._load_seconds[name]

    def _least_loaded(self, model: str) -> ModelReplica:
        replicas = [w.replicas[model] for w in self.workers if model in w.replicas]
        if not replicas:
            # Until a model of the start is live, it is loading: NOT_FOUND would tell an
            # orchestrator this server does not serve it at all, and count against the
            # replica for ejection, while GetModel says LOADING.
            loading = not self._live_since or (
                model in self.starting_models and model not in self._live_since
            )
            if not loading:
                raise ModelNotFound(f"model {model!r} is not served here", model=model)
            raise ModelNotReady(f"model {model!r} is not loaded yet", model=model)
        return min(replicas, key=lambda replica: replica.load)

    def load_report(self, model: str, handled: float = 0.0) -> bytes:
        """How busy this server is for `model` (the serialized LoadReport the capability
        sends with each answer), with the `handled` seconds the call carrying it took
        here; empty when the model is not served here."""
        replicas = [w.replicas[model] for w in self.workers if model in w.replicas]
        if not replicas:
            return b""
        report = pb.LoadReport(
            queue_depth=sum(len(replica.queue) for replica in replicas),
            device_busy_share=sum(r.batcher.busy_share() for r in replicas) / len(replicas),
        )
        least_loaded = min(replicas, key=lambda replica: replica.load)
        report.max_batch_size = least_loaded.settings.max_batch_size
        report.queue_capacity = least_loaded.settings.queue_capacity
        report.predicted_queue_wait.FromNanoseconds(
            int(least_loaded.predictor.queue_wait_seconds() * 1e9)
        )
        report.predicted_service.FromNanoseconds(
            int(least_loaded.predictor.service_seconds(LOAD_REPORT_TOKENS) * 1e9)
        )
        report.handled.FromNanoseconds(int(handled * 1e9))
        return report.SerializeToString()

    async def classify(
        self,
        model: str,
        text: str,
        *,
        max_length: int | None,
        priority: int,
        request_id: str,
        deadline: float | None,
        cache: str = CACHE_USE,
        cache_scope: str = "",
    ) -> TextResult:
        """Tokenize, look up (`cache`: see TextRequest) in `cache_scope`, admit and
        await one text; errors are ServiceErrors."""
        self._unary_items.observe(1)
        if self.draining:
            raise ServerDraining("the server is shutting down; send the request elsewhere")
        replica = self._least_loaded(model)
        request_trace = current_trace()
        if request_trace is not None:  # on every outcome's log line (Admitter.admit_group)
            request_trace.log_fields.update(
                model=replica.bundle.name,
                model_version=replica.bundle.version,
                worker=replica.worker.name,
            )
        replica.begin_arrival()
        try:
            with node(TOKENIZE) as span:
                (encoded,) = await self._admitter.tokenize(replica, [text], max_length)
                span.set_attributes(
                    {CLASSIFY_TOKENS: len(encoded), CLASSIFY_TRUNCATED: encoded.truncated}
                )
                if not encoded.readable:  # as Admitter refuses it in a batch
                    unreadable = UnreadableText.for_model(replica.name)
                    self._count_refusal(model, unreadable)
                    raise unreadable
            cached = (
                answered_from_cache(self.cache, replica, cache_scope, encoded)
                if cache == CACHE_USE
                else None
            )
            if cached is not None:
                record_cache_hit(request_trace, replica)
                return cached
            if not replica.is_resident:
                await self._bring_onto_device(replica, len(encoded), deadline)
            with node(QUEUE_ADMIT, {CLASSIFY_WORKER: replica.worker.name}) as span:
                span.set_attributes(
                    {
                        CLASSIFY_QUEUE_DEPTH: len(replica.queue),
                        CLASSIFY_PREDICTED_WAIT_MS: round(
                            replica.predictor.wait_seconds(len(encoded)) * 1000, 3
                        ),
                    }
                )
                try:
                    replica.worker.check_memory(model)
                    future = replica.admit(
                        Admission(
                            encoded, priority_lane(priority), request_id, deadline, request_trace
                        )
                    )
                except ServiceError as refused:
                    span.set_attribute(CLASSIFY_OUTCOME, refused.reason)
                    self._count_refusal(model, refused)
                    raise
                span.set_attribute(CLASSIFY_OUTCOME, "admitted")
                if self.cache.enabled and cache != CACHE_BYPASS:
                    future.add_done_callback(
                        partial(remember_result, self.cache, cache_scope, encoded, text, max_length)
                    )
        finally:
            replica.end_arrival()
        try:
            return await future
        except asyncio.CancelledError:
            replica.batcher.withdraw_gone()  # the caller went: its place is free now
            raise

    async def classify_many(
        self,
        texts: Sequence[TextRequest],
        on_refused: Callable[[dict[int, ServiceError]], Awaitable[None]] | None = None,
    ) -> list[TextResult | ServiceError]:
        """Classify many texts at once (one ClassifyBatch call): each is answered on its
        own, in order, with its result or the ServiceError a single call for it would
        have ended with. Texts are grouped by model; each group goes to one replica,
        is tokenized in one call per `max_length` and admitted in one step. A text
        refused at intake (`refusal`) is answered with it and never served.

        `on_refused(refusals)`, by index, is awaited at most once, while texts are still
        to be computed: with those refused at intake or admission, once every text is
        admitted or refused; failing that, with those answered first (left out at the
        device, evicted from the queue), as soon as one is."""
        self._batch_items.observe(len(texts))
        return await self._classify_many(texts, on_refused)

    async def _classify_many(
        self,
        texts: Sequence[TextRequest],
        on_refused: Callable[[dict[int, ServiceError]], Awaitable[None]] | None,
        onto: ModelReplica | None = None,
    ) -> list[TextResult | ServiceError]:
        """classify_many, each model's texts sent to its least-loaded replica, or (the
        cache's refill, texts of one model) all to `onto`."""
        outcomes: list[TextResult | ServiceError | None] = [text.refusal for text in texts]
        by_model: dict[str, list[int]] = {}
        for index, text in enumerate(texts):
            if text.refusal is None:
                by_model.setdefault(text.model, []).append(index)
        routed: list[tuple[ModelReplica, list[int]]] = []
        for model, indexes in by_model.items():
            try:
                if self.draining:
                    raise ServerDraining("the server is shutting down; send the request elsewhere")
                routed.append((onto or self._least_loaded(model), indexes))
            except ServiceError as refused:
                for index in indexes:
                    outcomes[index] = refused
        try:
            admitted = await admit_groups(
                [
                    self._admitter.admit_group(replica, [texts[i] for i in indexes])
                    for replica, indexes in routed
                ]
            )
        except BaseException:
            for replica in {replica for replica, _ in routed}:
                replica.batcher.withdraw_gone()  # the places of texts withdrawn are free
            raise
        waiting: list[tuple[int, asyncio.Future[TextResult]]] = []
        for (_, indexes), group in zip(routed, admitted, strict=True):
            for index, admission in zip(indexes, group, strict=True):
                if isinstance(admission, ServiceError):
                    outcomes[index] = admission
                else:
                    waiting.append((index, admission))
        try:
            answers = await self._answers_of(waiting, outcomes, on_refused)
        except BaseException:
            # The caller went, or its early answer could not be sent: the texts still
            # queued are abandoned (their futures cancelled), and their places free now.
            for replica in {replica for replica, _ in routed}:
                replica.batcher.withdraw_gone()
            raise
        for (index, _), answer in zip(waiting, answers, strict=True):
            outcomes[index] = _as_outcome(answer, self._on_internal_error)
        return [_as_outcome(outcome, self._on_internal_error) for outcome in outcomes]

    async def _answers_of(
        self,
        waiting: list[tuple[int, asyncio.Future[TextResult]]],
        outcomes: list[TextResult | ServiceError | None],
        on_refused: Callable[[dict[int, ServiceError]], Awaitable[None]] | None,
    ) -> list[object]:
        """The outcomes of the `waiting` texts' futures, in order; the refusals among
        `outcomes` and those of the waiting texts first told to `on_refused`."""
        if on_refused is not None and waiting:
            refusals = {
                index: outcome
                for index, outcome in enumerate(outcomes)
                if isinstance(outcome, ServiceError)
            }
            try:
                if not refusals:
                    refusals = await _first_failures(waiting)
                if refusals:
                    await on_refused(refusals)
            except BaseException:
                for _, future in waiting:  # as gather would on its way out
                    future.cancel()
                raise
        futures = [future for _, future in waiting]
        # All done when _first_failures found no refusal: read them here, where gather
        # would add a callback to each and take a turn of the loop (about 150 us for 64
        # texts).
        if all(future.done() for future in futures):
            return [_settled(future) for future in futures]
        return await asyncio.gather(*futures, return_exceptions=True)

    async def _bring_onto_device(
        self, replica: ModelReplica, tokens: int, deadline: float | None
    ) -> None:
        """Wait for an on_demand replica's cold start, unless the deadline cannot allow
        it (refused, so the caller's fallback can answer instead); refusals counted."""
        refusal = replica.cold_start_refusal(tokens, deadline, asyncio.get_running_loop().time())
        try:
            if refusal is not None:
                raise refusal
            start_by = replica.latest_cold_start(tokens, deadline)
            await replica.worker.ensure_resident(replica, start_by)
        except ServiceError as refused:
            self._count_refusal(replica.name, refused)
            raise

    def _count_refusal(self, model: str, refused: ServiceError) -> None:
        self._metrics.admissions_refused.labels(model, refused.reason).inc()
        if isinstance(refused, DeadlineExpired):
            self._metrics.deadline_exceeded.labels(model, DEADLINE_STAGE_ADMISSION).inc()

    def has_work(self) -> bool:
        """Whether any request is arriving, queued or computing on any worker."""
        return any(replica.load for worker in self.workers for replica in worker.replicas.values())

    async def drain(self) -> None:
        """Refuse new requests; return when every admitted one has its answer."""
        self.draining = True
        await asyncio.gather(*(worker.drain() for worker in self.workers))

    async def close(self) -> None:
        for task in list(self._warming):
            task.cancel()
        await asyncio.gather(*self._warming, return_exceptions=True)
        for worker in self.workers:
            await worker.close()
        self._admitter.close()
        self._loaders.shutdown(wait=False, cancel_futures=True)


def _load_on(
    directory: Path,
    version: str,
    device: torch.device,
    precision: str | None,
    graph: str,
    trusted_signers: Path | None,
    watch: LoadWatch,
) -> LoadedBundle:
    return load_bundle(
        directory,
        device,
        version=version,
        precision=precision,
        graph=graph,
        trusted_signers=trusted_signers,
        watch=watch,
    )

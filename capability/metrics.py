"""Capability-server metrics beyond the per-RPC ones every server has.

`worker` labels are the worker's name, e.g. "cpu:0" or "cuda:1"; `model` the
model name. Names are module constants so tests and dashboards share them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from capability.memory import MemoryLedger

MODEL_FORWARD_TOTAL = "classify_model_forward_total"
MODEL_TEXTS_TOTAL = "classify_model_texts_total"
MODEL_LOAD_SECONDS = "classify_model_load_seconds"
MODEL_INFO = "classify_model_info"
QUEUE_DEPTH = "classify_queue_depth"
BATCH_SIZE = "classify_batch_size"
BATCH_PADDING_RATIO = "classify_batch_padding_ratio"
ADMISSIONS_REFUSED_TOTAL = "classify_admissions_refused_total"
EVICTIONS_TOTAL = "classify_queue_evictions_total"
NEWEST_FIRST_BATCHES_TOTAL = "classify_queue_newest_first_batches_total"
BATCH_FAILURES_TOTAL = "classify_batch_failures_total"
UNSCORABLE_TEXTS_TOTAL = "classify_unscorable_texts_total"
WORKER_RESTARTS_TOTAL = "classify_worker_restarts_total"
RELOADS_TOTAL = "classify_model_reloads_total"
RELOAD_RETRIES_TOTAL = "classify_model_reload_retries_total"
MODEL_FOLDER_CHANGES_TOTAL = "classify_model_folder_changes_total"
WORKER_BUSY_SECONDS_TOTAL = "classify_worker_busy_seconds_total"
DEVICE_MEMORY_BYTES = "classify_device_memory_bytes"
DEVICE_UTILISATION = "classify_device_utilisation"
DEVICE_FRAGMENTATION_BYTES = "classify_device_fragmentation_bytes"
DEVICE_MEMORY_BUDGET_BYTES = "classify_device_memory_budget_bytes"
DEVICE_CACHE_RELEASES_TOTAL = "classify_device_cache_releases_total"
MODEL_MEMORY_BYTES = "classify_model_memory_bytes"
MODEL_COLD_STARTS_TOTAL = "classify_model_cold_starts_total"
MODEL_COLD_START_SECONDS = "classify_model_cold_start_seconds"
MODEL_EVICTIONS_TOTAL = "classify_model_evictions_total"
MODEL_RESIDENT = "classify_model_resident"
CACHE_REQUESTS_TOTAL = "classify_cache_requests_total"
RESULT_CACHE_WARMED_TOTAL = "classify_result_cache_warmed_total"
RESULT_CACHE_ENTRIES = "classify_result_cache_entries"
RESULT_CACHE_BYTES = "classify_result_cache_bytes"
RESULT_CACHE_HIT_FLOOR = "classify_result_cache_hit_floor"
DEADLINE_EXCEEDED_TOTAL = "classify_deadline_exceeded_total"
RPC_ITEMS = "classify_capability_rpc_items"
FIT_PROBES_TOTAL = "classify_service_time_probes_total"

# The `outcome` of CACHE_REQUESTS_TOTAL.
CACHE_HIT = "hit"
CACHE_MISS = "miss"
# Where a text's time ran out (the `stage` of DEADLINE_EXCEEDED_TOTAL): refused at
# admission (no time left, or less than the predicted service time), taken out of
# the queue (by its timer, or because the batch being formed, or any batch after
# the work handed over, could not end in time for it), or left out by the device
# thread as its batch started (the deadline had passed, or would pass before the
# forward could end).
DEADLINE_STAGE_ADMISSION = "admission"
DEADLINE_STAGE_QUEUE = "queue"
DEADLINE_STAGE_DEVICE = "device"
# The `kind`s of MODEL_MEMORY_BYTES, one model version's ledger entry on one worker:
# weights (parameters and buffers), predicted (footprint foreseen before the weights
# were read), loaded (allocated growth over the load stages), warmed (growth to after
# the warm-up at the largest batch and bucket), warm_up_peak (peak during that
# warm-up above memory before the load), footprint (what the budget counts).
MODEL_MEMORY_KINDS = ("weights", "predicted", "loaded", "warmed", "warm_up_peak", "footprint")
# The `reason` of DEVICE_CACHE_RELEASES_TOTAL: after a replaced version was let go,
# after a version was refused (over budget, non-finite warm-up) and dropped, or after
# an on-demand model left the device.
CACHE_RELEASE_RETIRED = "retired"
CACHE_RELEASE_REFUSED = "refused"
CACHE_RELEASE_EVICTED = "evicted"
# The `method` of RPC_ITEMS: full gRPC method names, as in classify_rpc_requests_total.
CLASSIFY_METHOD = "/ai.classify.v1.ClassifyService/Classify"
CLASSIFY_BATCH_METHOD = "/ai.classify.v1.ClassifyService/ClassifyBatch"


class CapabilityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._add_model_metrics(registry)
        self._add_queue_metrics(registry)
        self._add_worker_metrics(registry)
        self._add_cache_metrics(registry)

    def _add_model_metrics(self, registry: CollectorRegistry) -> None:
        """What the model computed, and which versions are loaded."""
        self.model_forwards = Counter(
            MODEL_FORWARD_TOTAL,
            "Forward passes (batches) the model ran for requests; warm-up excluded.",
            ["model", "worker"],
            registry=registry,
        )
        self.model_texts = Counter(
            MODEL_TEXTS_TOTAL,
            "Texts the model computed for requests; an evicted request never counts.",
            ["model", "worker"],
            registry=registry,
        )
        self.model_load_seconds = Gauge(
            MODEL_LOAD_SECONDS,
            "Seconds the serving version took to verify, load and warm up.",
            ["model", "worker"],
            registry=registry,
        )
        self.model_info = Gauge(
            MODEL_INFO,
            "1 for each model version serving now, with its worker and precision.",
            ["model", "version", "worker", "precision"],
            registry=registry,
        )
        self.model_resident = Gauge(
            MODEL_RESIDENT,
            "1 while a serving version's weights are on the worker's device, 0 while an "
            "on_demand one waits in host memory.",
            ["model", "worker"],
            registry=registry,
        )
        self.model_cold_starts = Counter(
            MODEL_COLD_STARTS_TOTAL,
            "Times an on_demand model was copied onto a device for a request.",
            ["model", "worker"],
            registry=registry,
        )
        self.model_cold_start_seconds = Histogram(
            MODEL_COLD_START_SECONDS,
            "Seconds a cold start took (weights onto the device, graph traced): what the "
            "first request after an eviction waits beyond its own computation.",
            ["model"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.model_evictions = Counter(
            MODEL_EVICTIONS_TOTAL,
            "Times an on_demand model left a device, by reason: idle (unused for its "
            "idle_seconds) or budget (room for another model).",
            ["model", "worker", "reason"],
            registry=registry,
        )
        self.model_memory = Gauge(
            MODEL_MEMORY_BYTES,
            "The model ledger: device memory of a serving version on a worker, by kind "
            "(weights, predicted, loaded, warmed, warm_up_peak, footprint), in bytes; "
            "on the CPU read from the process's resident memory.",
            ["model", "version", "worker", "kind"],
            registry=registry,
        )

    def _add_queue_metrics(self, registry: CollectorRegistry) -> None:
        """Admission, queues and batches: where a text waited and why it was refused."""
        self.queue_depth = Gauge(
            QUEUE_DEPTH,
            "Requests waiting in a worker's queue for a model.",
            ["model", "worker"],
            registry=registry,
        )
        self.batch_size = Histogram(
            BATCH_SIZE,
            "Texts per batch.",
            ["model", "worker"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )
        self.padding_ratio = Histogram(
            BATCH_PADDING_RATIO,
            "Share of a batch's token positions that are padding.",
            ["model"],
            buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0),
            registry=registry,
        )
        self.admissions_refused = Counter(
            ADMISSIONS_REFUSED_TOTAL,
            "Requests refused at admission, by reason (ErrorInfo reason).",
            ["model", "reason"],
            registry=registry,
        )
        self.evictions = Counter(
            EVICTIONS_TOTAL,
            "Requests taken out of a queue uncomputed because their deadline passed or "
            "could no longer be met.",
            ["model"],
            registry=registry,
        )
        self.newest_first_batches = Counter(
            NEWEST_FIRST_BATCHES_TOTAL,
            "Batches taken newest first because the queue stood (adaptive LIFO).",
            ["model"],
            registry=registry,
        )
        self.deadline_exceeded = Counter(
            DEADLINE_EXCEEDED_TOTAL,
            "Texts answered DEADLINE_EXCEEDED and never computed, by where their time ran "
            "out: admission, queue (evicted by its timer, or as batches were formed) or "
            "device (left out of its batch).",
            ["model", "stage"],
            registry=registry,
        )
        self.fit_probes = Counter(
            FIT_PROBES_TOTAL,
            "Stand-in forwards timed to check the service-time fit after it alone refused "
            "a text, by outcome: stale (far faster than predicted: the fit forgets half "
            "its past), confirmed, or failed (the forward, or the cold start of a model "
            "off the device, failed).",
            ["model", "worker", "outcome"],
            registry=registry,
        )
        # Its _count is the RPCs, its _sum the texts they carried: how well the
        # orchestrator merges calls.
        self.rpc_items = Histogram(
            RPC_ITEMS,
            "Texts (items) each Classify or ClassifyBatch RPC carried; Classify carries one.",
            ["method"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=registry,
        )

    def _add_worker_metrics(self, registry: CollectorRegistry) -> None:
        """Failures, restarts, reloads and the time workers spent computing."""
        self.batch_failures = Counter(
            BATCH_FAILURES_TOTAL,
            "Batches whose texts were answered with a model fault.",
            ["model", "worker"],
            registry=registry,
        )
        self.unscorable_texts = Counter(
            UNSCORABLE_TEXTS_TOTAL,
            "Texts the model gave non-finite scores while it scored others "
            "(answered UNSCORABLE_TEXT).",
            ["model"],
            registry=registry,
        )
        self.worker_restarts = Counter(
            WORKER_RESTARTS_TOTAL,
            "Times a worker's batching loop died and was restarted.",
            ["worker"],
            registry=registry,
        )
        self.reloads = Counter(
            RELOADS_TOTAL,
            "Model reloads, by outcome (ok, refused).",
            ["model", "outcome"],
            registry=registry,
        )
        # Each retry's outcome is counted in RELOADS_TOTAL too.
        self.reload_retries = Counter(
            RELOAD_RETRIES_TOTAL,
            "Times the watcher tried a refused version folder again because its files "
            "changed (names, sizes or modification times) since the refusal.",
            ["model"],
            registry=registry,
        )
        # `change`: capability.lifecycle.FOLDER_REMOVED or FOLDER_REPLACED.
        self.model_folder_changes = Counter(
            MODEL_FOLDER_CHANGES_TOTAL,
            "Times the watcher found the serving version's folder removed, or replaced "
            "by another bundle under the same version name, while it served.",
            ["model", "change"],
            registry=registry,
        )
        self.device_memory_budget = Gauge(
            DEVICE_MEMORY_BUDGET_BYTES,
            "Bytes the model versions resident on a worker may hold together "
            "(--device-memory-budget).",
            ["worker"],
            registry=registry,
        )
        self.cache_releases = Counter(
            DEVICE_CACHE_RELEASES_TOTAL,
            "Times a worker handed its allocator's unused cached blocks back (CUDA "
            "empty_cache; CPU malloc_trim), by reason (retired, refused).",
            ["worker", "reason"],
            registry=registry,
        )
        # rate() of it is the worker's utilisation, on the CPU as on a GPU.
        self.worker_busy_seconds = Counter(
            WORKER_BUSY_SECONDS_TOTAL,
            "Seconds a worker's device spent computing batches for requests.",
            ["worker"],
            registry=registry,
        )

    def _add_cache_metrics(self, registry: CollectorRegistry) -> None:
        """The result cache (capability/result_cache.py): how often it answered."""
        # Counted per text looked up; texts of a call that opted out are neither.
        self.cache_requests = Counter(
            CACHE_REQUESTS_TOTAL,
            "Texts looked up in the result cache, by outcome: hit (answered from it: no "
            "queue, no forward) or miss (computed, then stored).",
            ["model", "outcome"],
            registry=registry,
        )
        self.result_cache_warmed = Counter(
            RESULT_CACHE_WARMED_TOTAL,
            "Texts computed on a model's new version to refill the cache after a swap.",
            ["model"],
            registry=registry,
        )
        self.result_cache_entries = Gauge(
            RESULT_CACHE_ENTRIES, "Entries in the result cache.", registry=registry
        )
        self.result_cache_hit_floor = Gauge(
            RESULT_CACHE_HIT_FLOOR,
            "The result cache hit ratio a model is expected to keep (cache_hit_floor in "
            "--model-config); the ClassifyResultCacheHitRatioLow alert compares with it.",
            ["model"],
            registry=registry,
        )
        self.result_cache_bytes = Gauge(
            RESULT_CACHE_BYTES,
            "Estimated bytes the result cache's entries hold.",
            registry=registry,
        )

    def show_ledger(self, model: str, version: str, worker: str, ledger: MemoryLedger) -> None:
        """Export one ledger entry as MODEL_MEMORY_BYTES, one series per kind."""
        values = (
            ledger.weights_bytes,
            ledger.predicted_bytes,
            ledger.loaded.allocated_bytes,
            ledger.warmed.allocated_bytes,
            ledger.warm_up_peak_bytes - ledger.before_load.allocated_bytes,
            ledger.footprint_bytes,
        )
        for kind, value in zip(MODEL_MEMORY_KINDS, values, strict=True):
            self.model_memory.labels(model, version, worker, kind).set(value)

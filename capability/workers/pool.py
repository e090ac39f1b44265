"""The workers of one server, and the dispatch of requests to them.

A request is tokenized off the event loop by the replica it will run on, then
admitted to the least-loaded worker that holds its model. Loading a model
version loads one replica per worker, each on its own device, and switches all
workers only when every replica loaded: a version that fails anywhere serves
nowhere, and the previous version keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import torch

from capability.batching import PRIORITY_BATCH, PRIORITY_INTERACTIVE, BatchingSettings, TextResult
from capability.bundle import BundleError, LoadedBundle, load_bundle
from capability.metrics import CapabilityMetrics
from capability.model import DEFAULT_GRAPH, EncodedText
from capability.workers.worker import DeviceWorker, ModelReplica
from classify_common.errors import (
    ModelFault,
    ModelNotFound,
    ModelNotReady,
    ServerDraining,
    ServiceError,
)
from classify_common.nodes import current_trace, node

log = logging.getLogger(__name__)

# Tokenizing runs in Rust and releases the GIL; a couple of threads keep long
# texts from stalling the event loop without competing with the model for cores.
TOKENIZER_THREADS = 2
# Texts up to this many characters are tokenized on the event loop (tens of
# microseconds), which costs less than the hop to a tokenizer thread and back.
INLINE_TOKENIZE_CHARS = 2_000


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
    ) -> None:
        self._metrics = metrics
        self.workers = [
            DeviceWorker(device, name, metrics, memory_threshold=memory_threshold)
            for device, name in zip(devices, worker_names(devices), strict=True)
        ]
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self._loaders = ThreadPoolExecutor(len(self.workers), thread_name_prefix="load")
        self.draining = False
        # When each model's serving version went live on every worker.
        self._live_since: dict[str, datetime] = {}

    def models(self) -> Mapping[str, LoadedBundle]:
        """The version each model serves now (the same on every worker)."""
        first = self.workers[0]
        return {name: replica.bundle for name, replica in sorted(first.replicas.items())}

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
    ) -> LoadedBundle:
        """Load the bundle in `directory` on every worker, then switch them all to it."""
        loop = asyncio.get_running_loop()
        # Loaded beside the serving version, on loader threads, so serving goes on
        # meanwhile; each worker's replica lives on that worker's device.
        bundles = await asyncio.gather(
            *(
                loop.run_in_executor(
                    self._loaders, _load_on, directory, worker.device, precision, graph
                )
                for worker in self.workers
            )
        )
        if expected_name is not None and bundles[0].name != expected_name:
            raise BundleError(
                f"config.json: names model {bundles[0].name!r}, but the bundle sits under "
                f"{expected_name!r}"
            )
        # Every replica warms up before any worker switches: a version that fails
        # on one device serves on none.
        replicas = [
            await worker.prepare(bundle, settings)
            for worker, bundle in zip(self.workers, bundles, strict=True)
        ]
        for worker, replica in zip(self.workers, replicas, strict=True):
            await worker.activate(replica)
        self._live_since[bundles[0].name] = datetime.now(UTC)
        log.info(
            "model version serving",
            extra={
                "model": bundles[0].name,
                "version": bundles[0].version,
                "digest": bundles[0].digest,
                "graph": bundles[0].graph,
                "workers": [w.name for w in self.workers],
                "load_seconds": round(max(b.load_seconds for b in bundles), 3),
            },
        )
        return bundles[0]

    def live_since(self, name: str) -> datetime:
        return self._live_since[name]

    def _least_loaded(self, model: str) -> ModelReplica:
        replicas = [w.replicas[model] for w in self.workers if model in w.replicas]
        if not replicas:
            if self._live_since:  # warm: the name is simply not served here
                raise ModelNotFound(f"model {model!r} is not served here", model=model)
            raise ModelNotReady(f"model {model!r} is not loaded yet", model=model)
        return min(replicas, key=lambda replica: replica.load)

    async def classify(
        self,
        model: str,
        text: str,
        *,
        max_length: int | None,
        priority: int,
        request_id: str,
        deadline: float | None,
    ) -> TextResult:
        """Tokenize, admit and await one text; errors are ServiceErrors."""
        if self.draining:
            raise ServerDraining("the server is shutting down; send the request elsewhere")
        replica = self._least_loaded(model)
        replica.begin_arrival()
        try:
            with node("tokenize") as span:
                encoded = await self._tokenize(replica, text, max_length)
                span.set_attributes(
                    {"classify.tokens": len(encoded), "classify.truncated": encoded.truncated}
                )
            with node("queue_admit", {"classify.worker": replica.worker.name}) as span:
                span.set_attributes(
                    {
                        "classify.queue_depth": len(replica.queue),
                        "classify.predicted_wait_ms": round(
                            replica.predicted_wait_seconds(len(encoded)) * 1000, 3
                        ),
                    }
                )
                try:
                    replica.worker.check_memory(model)
                    future = replica.admit(
                        encoded,
                        priority=PRIORITY_BATCH
                        if priority == PRIORITY_BATCH
                        else PRIORITY_INTERACTIVE,
                        request_id=request_id,
                        deadline=deadline,
                        trace=current_trace(),
                    )
                except ServiceError as refused:
                    span.set_attribute("classify.outcome", refused.reason)
                    self._metrics.admissions_refused.labels(model, refused.reason).inc()
                    raise
                span.set_attribute("classify.outcome", "admitted")
        finally:
            replica.end_arrival()
        return await future

    async def _tokenize(
        self, replica: ModelReplica, text: str, max_length: int | None
    ) -> EncodedText:
        """The text's tokens for `replica`'s model; a tokenizer failure is a model fault."""
        classifier = replica.bundle.classifier
        try:
            if len(text) <= INLINE_TOKENIZE_CHARS:
                (encoded,) = classifier.tokenize([text], max_length)
            else:
                (encoded,) = await asyncio.get_running_loop().run_in_executor(
                    self._tokenizers, classifier.tokenize, [text], max_length
                )
        except Exception as exc:
            log.exception("tokenizing failed", extra={"model": replica.name})
            raise ModelFault(f"the {replica.name} tokenizer failed: {type(exc).__name__}") from exc
        return encoded

    def has_work(self) -> bool:
        """Whether any request is arriving, queued or computing on any worker."""
        return any(replica.load for worker in self.workers for replica in worker.replicas.values())

    async def drain(self) -> None:
        """Refuse new requests; return when every admitted one has its answer."""
        self.draining = True
        await asyncio.gather(*(worker.drain() for worker in self.workers))

    async def close(self) -> None:
        for worker in self.workers:
            await worker.close()
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
        self._loaders.shutdown(wait=False, cancel_futures=True)


def _load_on(
    directory: Path, device: torch.device, precision: str | None, graph: str
) -> LoadedBundle:
    return load_bundle(directory, device, precision=precision, graph=graph)

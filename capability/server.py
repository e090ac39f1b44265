"""The capability server: wiring, health, warm-up and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from capability.bundle import ModelLoadError
from capability.config import CapabilitySettings
from capability.lifecycle import ModelLifecycle, ModelRoot
from capability.metrics import CapabilityMetrics
from capability.security import InternalTokenGate
from capability.service import ClassifyServicer, ModelServicer
from capability.workers import WorkerPool, discover_devices
from capability.workers.cuda import (
    DeviceMemoryCollector,
    allocator_report,
    configure_cuda_defaults,
)
from capability.workers.pool import worker_names
from capability.workers.threads import compute_inline
from classify_common.errors import ServiceError
from classify_common.serving import (
    GrpcServing,
    freeze_heap,
    run_server,
    serve_until_signal,
    stop_watcher,
    thaw_heap,
)
from classify_common.settings import SettingsError, read_token

log = logging.getLogger(__name__)


def internal_gate(settings: CapabilitySettings) -> InternalTokenGate | None:
    token = read_token(settings, "internal_token_file")
    if token is None:
        log.warning("no internal token: any caller may use this server (development only)")
        return None
    return InternalTokenGate(token)


class CapabilityServer:
    """Owns the workers and the gRPC server. `start` binds and answers NOT_SERVING;
    `warm_up` loads and warms every model, then turns SERVING; `stop` drains."""

    def __init__(self, settings: CapabilitySettings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        metrics = CapabilityMetrics(self.registry)
        devices = discover_devices(settings.device, settings.cpu_workers)
        settings.check_devices(worker_names(devices))
        self.pool = WorkerPool(
            devices,
            metrics,
            memory_threshold=settings.memory_threshold,
            memory_budget_bytes=settings.device_memory_budget,
            memory_warm_up=settings.memory_warm_up,
            cpu_compute_nice=settings.cpu_compute_nice,
            torch_threads=settings.torch_threads,
            trusted_signers=settings.trusted_signers,
            result_cache=(
                settings.result_cache_entries,
                settings.result_cache_bytes,
                settings.result_cache_warm,
            ),
            on_internal_error=lambda: self.serving.rpc_metrics.internal_errors.inc(),
        )
        self.registry.register(
            DeviceMemoryCollector(lambda: [(w.name, w.device) for w in self.pool.workers])
        )
        self.lifecycle = ModelLifecycle(
            ModelRoot(settings.model_root),
            self.pool,
            settings.per_model,
            settings.default_serving(),
            metrics,
        )
        self.serving = GrpcServing.contract_server(
            settings, self.registry, gate=internal_gate(settings), edge=False
        )
        self.serving.add_service(
            classify_service_pb2_grpc.add_ClassifyServiceServicer_to_server,
            ClassifyServicer(self.pool, settings.default_model),
        )
        self.serving.add_service(
            model_service_pb2_grpc.add_ModelServiceServicer_to_server,
            ModelServicer(self.pool, self.lifecycle),
        )
        self._watcher: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def port(self) -> int:
        return self.serving.port

    async def start(self) -> None:
        devices = [worker.device for worker in self.pool.workers]
        log.info("device memory", extra=allocator_report(devices, self.settings.cuda_allocator))
        await self.serving.start()

    async def warm_up(self) -> None:
        # Frozen before any model loads, and not again: a version swapped out must stay
        # collectable (see freeze_heap).
        if self.settings.freezes_heap:
            freeze_heap()
        served = self.lifecycle.models_to_serve(self.settings.models)
        # Before any load: a misspelt --model-config entry or default model fails the
        # start at once.
        self.settings.check_model_config_names(served)
        self.settings.check_default_model(served)
        await self.lifecycle.load_initial(served)
        if self.settings.watch_seconds > 0:
            self._watcher = asyncio.create_task(
                self.lifecycle.watch(self.settings.watch_seconds), name="model-root-watcher"
            )
        await self.serving.set_serving(True, freeze=False)

    async def stop(self, grace_seconds: float | None = None) -> None:
        """NOT_SERVING, refuse new work, let admitted work finish within the grace, exit."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.settings.grace_seconds if grace_seconds is None else grace_seconds
        if self._watcher is not None:
            await stop_watcher(self._watcher, "model-root watcher")
        await self.serving.set_serving(False)
        try:
            await asyncio.wait_for(self.pool.drain(), timeout=grace)
        except TimeoutError:
            if self.pool.has_work():
                log.warning(
                    "grace period over with work still queued", extra={"grace_seconds": grace}
                )
        # Answers that are ready still need a moment to be written to the wire.
        try:
            await self.serving.stop(grace_seconds=min(grace, 1.0))
            await self.pool.close()
        finally:
            if self.settings.freezes_heap:
                thaw_heap()


async def serve(settings: CapabilitySettings) -> None:
    server = CapabilityServer(settings)

    async def start() -> dict[str, object]:
        await server.start()
        log.info("listening, warming up", extra={"port": server.port})
        await server.warm_up()
        return {
            "port": server.port,
            # null with --metrics-port -1: 0 would read as "any free port".
            "metrics_port": server.serving.metrics_port or None,
            "models": {name: b.version for name, b in server.pool.models().items()},
            "workers": [worker.name for worker in server.pool.workers],
            "cpu_threads_per_worker": server.pool.cpu_threads,
        }

    await serve_until_signal(server, start, log)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        settings = CapabilitySettings.from_args(argv)
    except SettingsError as exc:  # one line naming flag and variable, not a traceback
        print(f"{CapabilitySettings.PROG}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    configure_cuda_defaults(settings.cuda_allocator)
    # The event loop computes nothing; torch's CPU threads are the device threads'.
    compute_inline()
    # A start-up failure: no bundles under the root, a refused bundle, a version over
    # the device memory budget, a warm_texts file that is not UTF-8, a port in use, a
    # setting the devices or the served models refuse (a sharded model on one device,
    # a --model-config entry for a model not served).
    start_errors = (ServiceError, ModelLoadError, OSError, SettingsError)
    run_server("capability", settings, lambda: serve(settings), start_errors=start_errors, log=log)

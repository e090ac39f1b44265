"""The capability server: wiring, health, warm-up and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from ai.classify.v1 import (
    classify_service_pb2,
    classify_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
)
from capability.config import CapabilitySettings
from capability.inference import InferenceEngine, resolve_device
from capability.metrics import CapabilityMetrics
from capability.service import ClassifyServicer, ModelServicer
from classify_common.logs import configure_logging
from classify_common.serving import GrpcServing, wait_for_shutdown_signal
from classify_common.tracing import configure_tracing

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    classify_service_pb2.DESCRIPTOR.services_by_name["ClassifyService"].full_name,
    model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
)


class CapabilityServer:
    """Owns the engine and the gRPC server. `start` binds and answers NOT_SERVING;
    `warm_up` loads the model and turns SERVING; `stop` drains."""

    def __init__(self, settings: CapabilitySettings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine = InferenceEngine(
            settings.model_name,
            settings.resolved_model_dir(),
            resolve_device(settings.device),
            CapabilityMetrics(self.registry),
        )
        self.serving = GrpcServing(
            service_names=SERVICE_NAMES,
            host=settings.host,
            port=settings.port,
            metrics_port=settings.metrics_port,
            registry=self.registry,
        )
        classify_service_pb2_grpc.add_ClassifyServiceServicer_to_server(
            ClassifyServicer(self.engine), self.serving.server
        )
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(
            ModelServicer(self.engine), self.serving.server
        )

    @property
    def port(self) -> int:
        return self.serving.port

    async def start(self) -> None:
        await self.serving.start()

    async def warm_up(self) -> None:
        await self.engine.load()
        await self.serving.set_serving(True)

    async def stop(self, grace_seconds: float | None = None) -> None:
        grace = self.settings.grace_seconds if grace_seconds is None else grace_seconds
        await self.serving.stop(grace)
        self.engine.close()


async def serve(settings: CapabilitySettings) -> None:
    server = CapabilityServer(settings)
    try:
        await server.start()
        log.info("listening, warming up", extra={"port": server.port})
        await server.warm_up()
        log.info(
            "serving",
            extra={
                "port": server.port,
                "metrics_port": server.serving.metrics_port,
                "model": settings.model_name,
                "device": str(server.engine.device),
            },
        )
        await wait_for_shutdown_signal()
    finally:
        await server.stop()
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> None:
    settings = CapabilitySettings.from_args(argv)
    configure_logging("capability", settings.log_level)
    configure_tracing("capability")
    try:
        asyncio.run(serve(settings))
    except KeyboardInterrupt:
        sys.exit(130)

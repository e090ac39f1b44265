"""The orchestrator server: wiring, health and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2, classify_service_pb2_grpc
from classify_common.logs import configure_logging
from classify_common.serving import GrpcServing, wait_for_shutdown_signal
from classify_common.tracing import configure_tracing
from orchestrator.config import OrchestratorSettings
from orchestrator.dispatch import Dispatcher
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.routing import Backend, RoutesFileError, load_routes
from orchestrator.service import ClassifyServicer
from orchestrator.upstream import UpstreamPools

log = logging.getLogger(__name__)

SERVICE_NAMES = (classify_service_pb2.DESCRIPTOR.services_by_name["ClassifyService"].full_name,)


class OrchestratorServer:
    """Loads the route table, opens upstream channels, serves ClassifyService."""

    def __init__(self, settings: OrchestratorSettings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        # A bad routes file stops start-up here, with the bad value's path in the message.
        self.routes = load_routes(settings.routes_file)
        metrics = OrchestratorMetrics(self.registry)

        def count_ejection(backend: Backend, target: str, seconds: float) -> None:
            metrics.outlier_ejections.labels(backend.name, target).inc()
            log.warning(
                "replica ejected",
                extra={"backend": backend.name, "target": target, "seconds": seconds},
            )

        self.upstream = UpstreamPools(
            self.routes.backends, self.routes.outlier_ejection, on_ejected=count_ejection
        )
        self.serving = GrpcServing(
            service_names=SERVICE_NAMES,
            host=settings.host,
            port=settings.port,
            metrics_port=settings.metrics_port,
            registry=self.registry,
        )
        classify_service_pb2_grpc.add_ClassifyServiceServicer_to_server(
            ClassifyServicer(Dispatcher(self.routes, self.upstream, metrics)),
            self.serving.server,
        )

    @property
    def port(self) -> int:
        return self.serving.port

    async def start(self) -> None:
        await self.serving.start()
        await self.serving.set_serving(True)

    async def stop(self, grace_seconds: float | None = None) -> None:
        grace = self.settings.grace_seconds if grace_seconds is None else grace_seconds
        await self.serving.stop(grace)
        await self.upstream.close()


async def serve(settings: OrchestratorSettings) -> None:
    server = OrchestratorServer(settings)
    try:
        await server.start()
        log.info(
            "serving",
            extra={
                "port": server.port,
                "metrics_port": server.serving.metrics_port,
                "routes_file": str(settings.routes_file),
                "routes": [route.name for route in server.routes.routes],
            },
        )
        await wait_for_shutdown_signal()
    finally:
        await server.stop()
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> None:
    settings = OrchestratorSettings.from_args(argv)
    configure_logging("orchestrator", settings.log_level)
    configure_tracing("orchestrator")
    try:
        asyncio.run(serve(settings))
    except RoutesFileError as exc:
        log.error("cannot start: bad routes file", extra={"error": str(exc)})
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)

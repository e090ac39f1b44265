"""Spans leave both processes over OTLP to a real receiver on loopback, as one trace."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest_asyncio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from tests.conftest import STRIKER, ServerProcess, closed_port


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP TraceService a collector (Jaeger, the OpenTelemetry Collector) serves."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []

    async def Export(  # noqa: N802
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope_spans in resource_spans.scope_spans:
                self.spans += [(service, span) for span in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[tuple[TraceReceiver, int]]:
    servicer = TraceReceiver()
    server = grpc.aio.server()
    # opentelemetry-proto ships its generated gRPC code without type hints.
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, port
    await server.stop(0)


def start_stack(
    start_process: Callable[..., ServerProcess], model_root: Path, tmp_path: Path, endpoint: str
) -> ServerProcess:
    capability = start_process(
        "capability",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--device",
        "cpu",
        "--model-root",
        str(model_root),
        "--models",
        "topic-static",
        "--watch-seconds",
        "0",
        "--default-model",
        "topic-static",
        "--otlp-endpoint",
        endpoint,
    )
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\nbackends:\n"
        f"  static: {{model: topic-static, targets: ['127.0.0.1:{capability.port}']}}\n"
        "routes:\n  - {name: default, backend: static}\n"
    )
    return start_process(
        "orchestrator",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--routes-file",
        str(routes),
        "--auth",
        "disabled",
        "--otlp-endpoint",
        endpoint,
    )


async def classify(orchestrator: ServerProcess) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        response: pb.ClassifyResponse = await classify_service_pb2_grpc.ClassifyServiceStub(
            channel
        ).Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
        return response


async def test_both_processes_export_one_trace_with_the_parent_link(
    receiver: tuple[TraceReceiver, int],
    start_process: Callable[..., ServerProcess],
    model_root: Path,
    tmp_path: Path,
) -> None:
    collected, port = receiver
    orchestrator = start_stack(start_process, model_root, tmp_path, f"127.0.0.1:{port}")
    response = await classify(orchestrator)

    def spans_of(service: str) -> list[trace_pb2.Span]:
        return [
            s
            for name, s in collected.spans
            if name == service and s.trace_id.hex() == response.trace_id
        ]

    for _ in range(300):  # exported in batches about every second
        if spans_of("orchestrator") and spans_of("capability"):
            break
        await asyncio.sleep(0.05)
    (front,) = spans_of("orchestrator")
    (back,) = spans_of("capability")
    assert front.name == back.name == "ai.classify.v1.ClassifyService/Classify"
    assert back.parent_span_id == front.span_id
    assert front.kind == back.kind == trace_pb2.Span.SPAN_KIND_SERVER


async def test_requests_succeed_while_the_collector_is_unreachable(
    start_process: Callable[..., ServerProcess], model_root: Path, tmp_path: Path
) -> None:
    orchestrator = start_stack(start_process, model_root, tmp_path, f"127.0.0.1:{closed_port()}")
    for _ in range(3):
        response = await classify(orchestrator)
        assert response.labels[0].name == "sports"

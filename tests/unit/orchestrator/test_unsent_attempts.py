"""Attempts answered before they were sent, over real servers: each is counted with
the backend's shed calls (by kind or cause), the backend's limit in force is
exported, and the trace does not claim a call to the capability that never left:
no client span, and an `upstream_call` node that says it was not sent."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.metrics import MODEL_TEXTS_TOTAL
from capability.server import CapabilityServer
from classify_common.errors import DeadlineUnreachable
from orchestrator.metrics import (
    BACKEND_CONCURRENCY_LIMIT,
    CONCURRENCY_LIMITED_TOTAL,
    DEADLINE_UNREACHABLE_TOTAL,
    LIMIT_ADAPTIVE,
    LIMIT_STATIC,
    UNREACHABLE_CAUSES,
    UNREACHABLE_MARGIN,
)
from tests.conftest import STRIKER, StartOrchestrator, metric_sum, wait_until
from tests.flaky_pod import FlakyPod
from tests.status_details import error_info, refusal, trailers_of

CALLERS = 6


def trace_spans(exporter: InMemorySpanExporter, trace_id: str) -> list[ReadableSpan]:
    return [
        span
        for span in exporter.get_finished_spans()
        if span.context is not None and format(span.context.trace_id, "032x") == trace_id
    ]


def attributes_of(spans: Sequence[ReadableSpan], name: str) -> dict[str, object]:
    (span,) = [span for span in spans if span.name == name]
    return dict(span.attributes or {})


def client_spans(spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    return [span for span in spans if span.kind is SpanKind.CLIENT]


async def test_calls_refused_at_max_concurrency_are_counted_and_never_claim_a_client_call(
    capability: CapabilityServer,
    orchestrator_with: StartOrchestrator,
    span_exporter: InMemorySpanExporter,
) -> None:
    """max_concurrency 1 and a stalled replica: one call is sent, the other five are
    refused CONCURRENCY_LIMITED at once. They count as shed (kind static), the limit
    in force reads 1 (not the adaptive limit's 1024), and their traces show an
    `upstream_call` not sent, with no client span; the sent call's has one."""
    pod = FlakyPod(capability.port, failing=False)
    await pod.start()
    pod.answering.clear()
    try:
        server = await orchestrator_with(
            "version: 1\n"
            "backends:\n"
            f"  capped: {{model: topic-minilm, targets: ['{pod.address}'], max_concurrency: 1}}\n"
            "routes:\n"
            "  - name: default\n"
            "    backend: capped\n"
        )
        registry = server.registry
        # Exported at 0 before any refusal, so rate() sees the first one.
        assert metric_sum(registry, CONCURRENCY_LIMITED_TOTAL, backend="capped") == 0
        assert {
            sample.labels["kind"]
            for family in registry.collect()
            for sample in family.samples
            if sample.name == CONCURRENCY_LIMITED_TOTAL and sample.labels["backend"] == "capped"
        } == {LIMIT_STATIC, LIMIT_ADAPTIVE}
        assert metric_sum(registry, BACKEND_CONCURRENCY_LIMIT, backend="capped") == 1
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            sent = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
            )
            await wait_until(lambda: pod.calls == 1, "the first call held by the pod")
            refused = await asyncio.gather(
                *[
                    refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30))
                    for _ in range(CALLERS - 1)
                ]
            )
            pod.answering.set()
            answered = await sent
    finally:
        pod.answering.set()
        await pod.stop()
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_info(error).reason == "CONCURRENCY_LIMITED"
    assert pod.calls == 1
    limited = CALLERS - 1
    assert metric_sum(registry, CONCURRENCY_LIMITED_TOTAL, backend="capped") == limited
    assert (
        metric_sum(registry, CONCURRENCY_LIMITED_TOTAL, backend="capped", kind=LIMIT_STATIC)
        == limited
    )

    refused_trace = trailers_of(refused[0])["x-trace-id"]
    # Its nodes end before its answer: grpc_receive .. upstream_call, and the server span.
    await wait_until(
        lambda: any(s.name == "upstream_call" for s in trace_spans(span_exporter, refused_trace)),
        "the refused call's upstream_call node",
    )
    spans = trace_spans(span_exporter, refused_trace)
    assert client_spans(spans) == []
    node = attributes_of(spans, "upstream_call")
    assert node["classify.sent"] is False
    assert node["classify.error_reason"] == "CONCURRENCY_LIMITED"
    assert node["rpc.response.status_code"] == "RESOURCE_EXHAUSTED"
    assert "classify.gather_ms" not in node  # refused before it reached the coalescer

    # The capability server's spans hang under the sent call's client span.
    await wait_until(
        lambda: len(client_spans(trace_spans(span_exporter, answered.trace_id))) == 1,
        "the sent call's client span",
    )
    spans = trace_spans(span_exporter, answered.trace_id)
    (client,) = client_spans(spans)
    (upstream_call,) = [span for span in spans if span.name == "upstream_call"]
    assert upstream_call.context is not None
    assert client.parent is not None
    assert client.parent.span_id == upstream_call.context.span_id
    assert client.name == "ai.classify.v1.ClassifyService/Classify"
    assert dict(client.attributes or {})["rpc.response.status_code"] == "OK"
    node = dict(upstream_call.attributes or {})
    assert node["classify.sent"] is True
    gathered = node["classify.gather_ms"]
    assert isinstance(gathered, float)
    assert 0 <= gathered < 1000
    # Sent when it left the coalescer: the client span starts within the node.
    assert (upstream_call.start_time or 0) <= (client.start_time or 0)
    assert (client.end_time or 0) <= (upstream_call.end_time or 0)


@pytest.mark.parametrize("remaining_seconds", [0.012, 0.018])
async def test_a_deadline_shorter_than_the_margin_is_counted_as_unreachable(
    capability: CapabilityServer,
    orchestrator_with: StartOrchestrator,
    remaining_seconds: float,
) -> None:
    """A call with less time left than the orchestrator keeps to answer is refused
    DEADLINE_UNREACHABLE unsent, and counted with the backend's shed calls, cause
    margin (every cause is exported at 0 from the start)."""
    server = await orchestrator_with(
        "version: 1\n"
        "backends:\n"
        f"  minilm: {{model: topic-minilm, targets: ['127.0.0.1:{capability.port}']}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: minilm\n"
    )
    registry = server.registry
    assert {
        sample.labels["cause"]
        for family in registry.collect()
        for sample in family.samples
        if sample.name == DEADLINE_UNREACHABLE_TOTAL and sample.labels["backend"] == "minilm"
    } == set(UNREACHABLE_CAUSES)
    (pool,) = server.dispatcher.state.upstream.pools()
    computed_before = metric_sum(capability.registry, MODEL_TEXTS_TOTAL)
    with pytest.raises(DeadlineUnreachable) as refused:
        await pool.classify(
            pb.ClassifyRequest(text=STRIKER, model="topic-minilm"),
            target=pool.pick(),
            client_remaining=remaining_seconds,
        )
    assert "the orchestrator keeps to answer" in str(refused.value)
    assert metric_sum(registry, DEADLINE_UNREACHABLE_TOTAL, backend="minilm") == 1
    assert (
        metric_sum(registry, DEADLINE_UNREACHABLE_TOTAL, backend="minilm", cause=UNREACHABLE_MARGIN)
        == 1
    )
    assert metric_sum(capability.registry, MODEL_TEXTS_TOTAL) == computed_before

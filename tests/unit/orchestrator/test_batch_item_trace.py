"""Each item of a ClassifyBatch call is traced and timed at the orchestrator as a call
of its own, through a real orchestrator and a real capability server: its `batch_item`
span names the item and ends with the item's outcome, and an item its call's deadline
cut off is the DEADLINE_EXCEEDED it was answered in its spans and its latency, not a
caller that went away (CANCELLED)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from google.rpc.error_details_pb2 import ErrorInfo
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common import interceptor, tracing
from orchestrator import batch_items
from orchestrator.batch_items import BATCH_ITEM_SPAN_NAME
from orchestrator.metrics import REQUEST_DURATION_SECONDS
from orchestrator.server import OrchestratorServer
from tests.conftest import (
    STRIKER,
    LineCollector,
    StartOrchestrator,
    closed_port,
    metric_sum,
    wait_until,
)
from tests.flaky_pod import FlakyPod
from tests.status_details import unpack
from tests.unit.capability.test_serving import device_occupied
from tests.unit.test_lifecycle_trace import span_id, trace_spans

# What an item its call's deadline cut off is answered (orchestrator.batch_items).
ANSWER_DUE_MESSAGE = "the call's deadline came before this item was answered"


def routes_with_a_dead_backend(live_target: str) -> str:
    """`default` to topic-minilm at `live_target`; model hint `dead`: nothing listens."""
    return (
        "version: 1\nbackends:\n"
        f"  live: {{model: topic-minilm, targets: ['{live_target}']}}\n"
        f"  dead: {{model: topic-minilm, targets: ['127.0.0.1:{closed_port()}']}}\n"
        "routes:\n"
        "  - {name: dead, match: {model: dead}, backend: dead}\n"
        "  - {name: default, backend: live}\n"
    )


async def classify_batch(
    port: int, items: Sequence[pb.ClassifyRequest], seconds: float = 30
) -> pb.ClassifyBatchResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response: pb.ClassifyBatchResponse = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(items=items), timeout=seconds
        )
        return response


def call_trace_id(response: pb.ClassifyBatchResponse) -> str:
    """The call's trace, which its items without a traceparent of their own are in."""
    (trace_id,) = {
        result.response.trace_id
        if result.HasField("response")
        else unpack(result.error, ErrorInfo)[0].metadata["x-trace-id"]
        for result in response.results
    }
    return trace_id


async def item_spans(
    exporter: InMemorySpanExporter, trace_id: str, count: int
) -> dict[str, ReadableSpan]:
    """The trace's `batch_item` spans, by request ID, once `count` have ended."""

    def spans() -> list[ReadableSpan]:
        return [s for s in trace_spans(exporter, trace_id) if s.name == BATCH_ITEM_SPAN_NAME]

    await wait_until(lambda: len(spans()) >= count, f"{count} item spans")
    return {str(dict(s.attributes or {})["classify.request_id"]): s for s in spans()}


def children(
    exporter: InMemorySpanExporter, trace_id: str, parent: ReadableSpan
) -> list[ReadableSpan]:
    return [
        s
        for s in trace_spans(exporter, trace_id)
        if s.parent is not None and s.parent.span_id == span_id(parent)
    ]


async def test_an_items_span_names_the_item_and_ends_with_its_outcome(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    span_exporter: InMemorySpanExporter,
) -> None:
    """Answered, refused (the caller's fault: no error status) and failed (UNAVAILABLE,
    the server's fault: error status and `error.type`, as a call's server span)."""
    server = await orchestrator_with(routes_with_a_dead_backend(f"127.0.0.1:{capability.port}"))
    response = await classify_batch(
        server.port,
        [
            pb.ClassifyRequest(text=STRIKER, request_id="answered"),
            pb.ClassifyRequest(text=" ", request_id="refused"),
            pb.ClassifyRequest(text=STRIKER, model="dead", request_id="failed"),
        ],
    )
    assert [result.WhichOneof("outcome") for result in response.results] == [
        "response",
        "error",
        "error",
    ]
    spans = await item_spans(span_exporter, call_trace_id(response), 3)

    assert {request_id: dict(span.attributes or {}) for request_id, span in spans.items()} == {
        "answered": {
            "classify.request_id": "answered",
            "classify.batch_index": 0,
            "rpc.response.status_code": "OK",
        },
        "refused": {
            "classify.request_id": "refused",
            "classify.batch_index": 1,
            "rpc.response.status_code": "INVALID_ARGUMENT",
            "classify.error_reason": "INVALID_REQUEST",
        },
        "failed": {
            "classify.request_id": "failed",
            "classify.batch_index": 2,
            "rpc.response.status_code": "UNAVAILABLE",
            "classify.error_reason": "MODEL_UNAVAILABLE",
            "error.type": "UNAVAILABLE",
        },
    }
    assert {request_id: span.status.status_code for request_id, span in spans.items()} == {
        "answered": StatusCode.UNSET,
        "refused": StatusCode.UNSET,
        "failed": StatusCode.ERROR,
    }


async def test_items_cut_off_by_the_calls_deadline_are_deadline_exceeded_in_spans_and_latency(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    span_exporter: InMemorySpanExporter,
) -> None:
    """A stalled replica holds every item until the call's answer is due: each item is
    answered DEADLINE_EXCEEDED with its IDs, and its latency, its span, its attempt and
    the attempt's client span say DEADLINE_EXCEEDED with error status (a time-out, so
    an unsampled trace is kept: classify_common.span_export), never CANCELLED."""
    pod = FlakyPod(capability.port, failing=False)
    pod.answering.clear()
    await pod.start()
    count = 20
    try:
        server = await orchestrator_with(
            "version: 1\n"
            f"backends:\n  pod: {{model: topic-minilm, targets: ['{pod.address}']}}\n"
            "routes:\n  - {name: default, backend: pod}\n"
        )

        def latencies(code: str) -> float:
            return metric_sum(
                server.registry, REQUEST_DURATION_SECONDS + "_count", route="default", code=code
            )

        response = await classify_batch(
            server.port,
            [
                pb.ClassifyRequest(text=f"{STRIKER} {index}", request_id=f"cut-{index}")
                for index in range(count)
            ],
            seconds=1,
        )
    finally:
        pod.answering.set()
        await pod.stop()

    assert {(result.error.code, result.error.message) for result in response.results} == {
        (grpc.StatusCode.DEADLINE_EXCEEDED.value[0], ANSWER_DUE_MESSAGE)
    }
    assert (latencies("DEADLINE_EXCEEDED"), latencies("CANCELLED")) == (count, 0)
    trace_id = call_trace_id(response)
    spans = await item_spans(span_exporter, trace_id, count)
    assert sorted(spans) == sorted(f"cut-{index}" for index in range(count))
    for request_id, item in spans.items():
        assert item.status.status_code == StatusCode.ERROR, request_id
        assert {
            key: value
            for key, value in dict(item.attributes or {}).items()
            if key in ("rpc.response.status_code", "error.type", "classify.error_reason")
        } == {
            "rpc.response.status_code": "DEADLINE_EXCEEDED",
            "error.type": "DEADLINE_EXCEEDED",
            "classify.error_reason": "DEADLINE_EXPIRED",
        }, request_id
        (attempt,) = [
            s for s in children(span_exporter, trace_id, item) if s.name == "upstream_call"
        ]
        (client,) = children(span_exporter, trace_id, attempt)
        assert client.kind == SpanKind.CLIENT
        for span in (attempt, client):
            attributes = dict(span.attributes or {})
            assert span.status.status_code == StatusCode.ERROR, (request_id, span.name)
            assert attributes["rpc.response.status_code"] == "DEADLINE_EXCEEDED", span.name
            assert attributes["error.type"] == "DEADLINE_EXCEEDED", span.name


async def test_without_spans_an_items_own_traceparent_reaches_the_capability(
    orchestrator: OrchestratorServer,
    interceptor_log: LineCollector,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With no span exporter (no --otlp-endpoint, the default), an item that sent its
    own traceparent was answered with that trace ID, but its upstream call carried the
    batch call's: the capability logged it under a trace the caller was never given."""
    monkeypatch.setattr(tracing, "_exporting", False)
    caplog.set_level(logging.INFO, logger=interceptor.__name__)  # the "rpc" lines
    item_trace = "0af7651916cd43dd8448eb211c80319c"
    request = pb.ClassifyBatchRequest(
        items=[pb.ClassifyRequest(text=STRIKER)],
        item_contexts=[pb.ItemContext(traceparent=f"00-{item_trace}-b7ad6b7169203331-01")],
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answer = await stub.ClassifyBatch(request, timeout=30)
    assert answer.results[0].response.trace_id == item_trace

    def capability_lines() -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in interceptor_log.lines]
        return [line for line in lines if line.get("method", "").endswith("/Classify")]

    await wait_until(capability_lines, "the capability's line for the item's call")
    assert [line["trace_id"] for line in capability_lines()] == [item_trace]


async def test_items_due_before_they_start_are_answered_under_their_own_ids(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call whose answer is due at once (its deadline shorter than the time kept to
    answer its items): no item's task ever ran. Each was answered under the call's
    trace ID, not its own traceparent's, with no span and no log line of its own."""
    collector = LineCollector()
    items_log = logging.getLogger(batch_items.__name__)
    items_log.addHandler(collector)
    caplog.set_level(logging.INFO, logger=batch_items.__name__)  # "batch item failed"
    server = await orchestrator_with(
        "version: 1\n"
        f"backends:\n  live: {{model: topic-minilm, targets: ['127.0.0.1:{capability.port}']}}\n"
        "routes:\n  - {name: default, backend: live}\n"
    )
    count = 4
    trace_ids = [f"{index + 1:032x}" for index in range(count)]
    request = pb.ClassifyBatchRequest(
        items=[
            pb.ClassifyRequest(text=STRIKER, request_id=f"unstarted-{index}")
            for index in range(count)
        ],
        item_contexts=[
            pb.ItemContext(traceparent=f"00-{trace_id}-{index + 1:016x}-01")
            for index, trace_id in enumerate(trace_ids)
        ],
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            response = await stub.ClassifyBatch(request, timeout=0.06)
    finally:
        items_log.removeHandler(collector)
    failed_lines = [json.loads(line) for line in collector.lines]
    logged = {(line["request_id"], line["trace_id"]) for line in failed_lines}
    for index, (result, trace_id) in enumerate(zip(response.results, trace_ids, strict=True)):
        assert result.error.message == ANSWER_DUE_MESSAGE
        (info,) = unpack(result.error, ErrorInfo)
        request_id = f"unstarted-{index}"
        assert (info.metadata["x-request-id"], info.metadata["x-trace-id"]) == (
            request_id,
            trace_id,
        )
        assert (request_id, trace_id) in logged
        spans = await item_spans(span_exporter, trace_id, 1)
        assert list(spans) == [request_id]
        attributes = dict(spans[request_id].attributes or {})
        assert attributes["rpc.response.status_code"] == "DEADLINE_EXCEEDED"


async def test_items_whose_caller_went_away_are_logged_cancelled_not_expired(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Their spans and counts said CANCELLED; their log lines said DEADLINE_EXCEEDED
    (DEADLINE_EXPIRED), false deadline misses of the server's, one for each item."""
    collector = LineCollector()
    items_log = logging.getLogger(batch_items.__name__)
    items_log.addHandler(collector)
    caplog.set_level(logging.INFO, logger=batch_items.__name__)  # "batch item failed"
    server = await orchestrator_with(routes_with_a_dead_backend(f"127.0.0.1:{capability.port}"))
    items = [pb.ClassifyRequest(text=STRIKER, request_id=f"gone-{n}") for n in range(2)]

    def logged() -> dict[str, tuple[str, str]]:
        lines = [json.loads(line) for line in collector.lines]
        return {
            line["request_id"]: (line["code"], line["reason"])
            for line in lines
            if line["event"] == "batch item failed"
        }

    try:
        async with (
            device_occupied(capability.pool.workers[0]),
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        ):
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            call = stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), timeout=30)
            await wait_until(capability.pool.has_work, "the items queued")
            call.cancel()
            await wait_until(lambda: len(logged()) == 2, "both items logged")
    finally:
        items_log.removeHandler(collector)
    assert logged() == {"gone-0": ("CANCELLED", ""), "gone-1": ("CANCELLED", "")}


async def test_a_failed_items_line_names_its_route_backend_model_and_attempts(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The runbook finds a failing backend by these, as in a single call's `rpc` line;
    an item's line said only its code, reason and call."""
    collector = LineCollector()
    items_log = logging.getLogger(batch_items.__name__)
    items_log.addHandler(collector)
    caplog.set_level(logging.INFO, logger=batch_items.__name__)  # "batch item failed"
    server = await orchestrator_with(routes_with_a_dead_backend(f"127.0.0.1:{capability.port}"))
    items = [
        pb.ClassifyRequest(text=STRIKER, request_id="to-the-dead", model="dead"),
        pb.ClassifyRequest(text=STRIKER, request_id="to-the-living"),
    ]
    try:
        response = await classify_batch(server.port, items)
    finally:
        items_log.removeHandler(collector)
    assert [result.WhichOneof("outcome") for result in response.results] == ["error", "response"]
    (line,) = [json.loads(line) for line in collector.lines]
    assert line["request_id"] == "to-the-dead"
    assert (line["code"], line["route"], line["backend"], line["model"]) == (
        "UNAVAILABLE",
        "dead",
        "dead",
        "topic-minilm",
    )
    assert line["attempts"] >= 1

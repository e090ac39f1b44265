"""Spans leave both processes over OTLP to a real receiver on loopback, as one trace."""

from __future__ import annotations

import asyncio
import functools
import secrets
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import pytest_asyncio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from classify_common.nodes import BATCH_SPAN_NAME, NODES
from classify_common.span_export import SPANS_DROPPED_TOTAL
from tests.conftest import (
    STATIC_ONLY_FLAGS,
    STRIKER,
    ServerProcess,
    Stack,
    closed_port,
    wait_until,
)
from tests.flaky_pod import FlakyPod
from tests.status_details import refusal, trailers_of

CLASSIFY_SPAN = "ai.classify.v1.ClassifyService/Classify"


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


def trace_routes(target: str) -> str:
    """Routes to topic-static at `target`, plus ones that fail over, miss, fail or overrun."""
    return (
        "version: 1\nbackends:\n"
        f"  static: {{model: topic-static, targets: ['{target}']}}\n"
        f"  missing: {{model: no-such-model, targets: ['{target}']}}\n"
        f"  dead: {{model: topic-static, targets: ['127.0.0.1:{closed_port()}']}}\n"
        "routes:\n"
        "  - {name: missing, match: {model: no-such-model}, backend: missing}\n"
        # A dead backend and no fallback: UNAVAILABLE, the server's fault.
        "  - {name: dead, match: {model: dead}, backend: dead}\n"
        # A dead primary: retried, then answered by the fallback.
        "  - name: failover\n"
        "    match: {model: failover}\n"
        "    backend: dead\n"
        "    fallback: [static]\n"
        "    retry: {max_attempts: 2, initial_backoff: 1ms, max_backoff: 5ms}\n"
        # A budget no call can meet: PROCESSING, and the work goes on.
        "  - {name: budgeted, match: {model: budgeted}, backend: static, budget: 1ms}\n"
        "  - {name: default, backend: static}\n"
    )


def start_exporting_stack(
    start_stack: Callable[..., Stack],
    endpoint: str,
    *extra: str,
    capability_extra: Sequence[str] = (),
) -> ServerProcess:
    """The stack on topic-static, both processes exporting to `endpoint`; `extra`
    flags go to both, `capability_extra` to the capability server. The orchestrator."""
    exporting = ("--otlp-endpoint", endpoint, *extra)
    return start_stack(
        routes=trace_routes,
        capability_flags=(
            *("--models", "topic-static", "--default-model", "topic-static"),
            *exporting,
            *capability_extra,
        ),
        orchestrator_flags=exporting,
    ).orchestrator


async def classify(
    orchestrator: ServerProcess, text: str = STRIKER, model: str = ""
) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        response: pb.ClassifyResponse = await classify_service_pb2_grpc.ClassifyServiceStub(
            channel
        ).Classify(pb.ClassifyRequest(text=text, model=model), timeout=30)
        return response


async def failed_call_trace_id(
    orchestrator: ServerProcess, text: str = STRIKER, model: str = ""
) -> str:
    error = await refusal(classify(orchestrator, text, model))
    return trailers_of(error)["x-trace-id"]


def spans_of(
    collected: TraceReceiver, trace_id: str, service: str | None = None
) -> list[trace_pb2.Span]:
    return [
        span
        for name, span in collected.spans
        if span.trace_id.hex() == trace_id and service in (None, name)
    ]


async def wait_for_spans(collected: TraceReceiver, trace_id: str, count: int) -> None:
    """Exported in batches about every second, so up to a few seconds."""
    await wait_until(
        lambda: len(spans_of(collected, trace_id)) >= count, f"{count} spans of {trace_id}"
    )


def scrape(process: ServerProcess, name: str, **labels: str) -> float:
    """Sum of metric `name`'s samples with `labels`, read from the process's /metrics."""
    url = f"http://127.0.0.1:{process.ready['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as page:
        text = page.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def spans_with_every_node(
    collected: TraceReceiver, trace_id: str, front_service: str, back_service: str
) -> tuple[list[Any], list[Any]]:
    """The trace's spans from each process (by service name), after checking that each
    has its server span and every lifecycle node of its layer, and the orchestrator the
    attempt's client span (named after the method, like the server spans)."""
    front_spans = spans_of(collected, trace_id, front_service)
    back_spans = spans_of(collected, trace_id, back_service)
    for spans, layer, calls in ((front_spans, "orchestrator", 1), (back_spans, "capability", 0)):
        assert sorted(s.name for s in spans) == sorted(
            [*[CLASSIFY_SPAN] * (1 + calls), *(n.name for n in NODES if n.service == layer)]
        )
    return front_spans, back_spans


def server_span(spans: list[Any]) -> Any:
    (found,) = [s for s in spans if s.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    return found


async def test_both_processes_export_one_trace_with_all_nodes_and_links(
    receiver: tuple[TraceReceiver, int],
    start_stack: Callable[..., Stack],
) -> None:
    collected, port = receiver
    orchestrator = start_exporting_stack(start_stack, f"127.0.0.1:{port}")
    response = await classify(orchestrator)
    await wait_for_spans(collected, response.trace_id, len(NODES) + 3)

    front_spans, back_spans = spans_with_every_node(
        collected, response.trace_id, "orchestrator", "capability"
    )
    front, back = server_span(front_spans), server_span(back_spans)
    (upstream,) = [s for s in front_spans if s.name == "upstream_call"]
    (client,) = [s for s in front_spans if s.kind == trace_pb2.Span.SPAN_KIND_CLIENT]
    assert front.name == back.name == client.name == CLASSIFY_SPAN
    assert upstream.kind == trace_pb2.Span.SPAN_KIND_INTERNAL
    assert not front.parent_span_id
    assert client.parent_span_id == upstream.span_id
    assert back.parent_span_id == client.span_id  # across the wire
    nodes = [s for s in front_spans if s not in (front, client)]
    assert all(s.parent_span_id == front.span_id for s in nodes)
    assert all(s.parent_span_id == back.span_id for s in back_spans if s is not back)
    (assemble,) = [s for s in back_spans if s.name == "batch_assemble"]
    (link,) = assemble.links
    batch = [span for _, span in collected.spans if span.span_id == link.span_id]
    assert [span.name for span in batch] == [BATCH_SPAN_NAME]


def attributes(span: trace_pb2.Span) -> dict[str, object]:
    values: dict[str, object] = {}
    for attribute in span.attributes:
        kind = attribute.value.WhichOneof("value")
        values[attribute.key] = getattr(attribute.value, kind) if kind else None
    return values


async def test_retries_fallback_and_timeouts_are_exported_as_such(
    receiver: tuple[TraceReceiver, int],
    start_stack: Callable[..., Stack],
) -> None:
    collected, port = receiver
    # A 100 ms batching window makes every answer slower than the 1 ms budget.
    orchestrator = start_exporting_stack(
        start_stack,
        f"127.0.0.1:{port}",
        capability_extra=("--max-wait-ms", "100"),
    )

    failover = await classify(orchestrator, model="failover")
    assert failover.fallback
    # Two attempts on the dead backend reach no capability server.
    await wait_for_spans(collected, failover.trace_id, len(NODES) + 4 + 2 + 3)
    attempts = sorted(
        (s for s in spans_of(collected, failover.trace_id) if s.name == "upstream_call"),
        key=lambda s: int(str(attributes(s)["classify.attempt"])),
    )
    error, ok = trace_pb2.Status.STATUS_CODE_ERROR, trace_pb2.Status.STATUS_CODE_UNSET
    assert [s.status.code for s in attempts] == [error, error, ok]
    assert [attributes(s).get("classify.backend") for s in attempts] == ["dead", "dead", "static"]
    assert attributes(attempts[0])["rpc.response.status_code"] == "UNAVAILABLE"
    assert attributes(attempts[1])["classify.retry_reason"] == "MODEL_UNAVAILABLE"
    assert attributes(attempts[2])["classify.fallback_reason"] == "MODEL_UNAVAILABLE"

    budgeted = await classify(orchestrator, model="budgeted")
    assert budgeted.status == pb.RESULT_STATUS_PROCESSING
    await wait_for_spans(collected, budgeted.trace_id, len(NODES) + 3)
    front_spans = spans_of(collected, budgeted.trace_id, "orchestrator")
    front = server_span(front_spans)
    (upstream,) = [s for s in front_spans if s.name == "upstream_call"]
    assert attributes(front)["timeout"] is True
    assert attributes(upstream)["timeout"] is True  # ended after the answer, still exported
    assert upstream.end_time_unix_nano > front.end_time_unix_nano


async def test_with_sampling_off_only_server_faults_are_exported(
    receiver: tuple[TraceReceiver, int],
    start_stack: Callable[..., Stack],
) -> None:
    """A good call and a flood of refused ones export nothing; server faults do."""
    collected, port = receiver
    orchestrator = start_exporting_stack(
        start_stack, f"127.0.0.1:{port}", "--trace-sample-ratio", "0"
    )
    good = await classify(orchestrator)
    for _ in range(20):
        await failed_call_trace_id(orchestrator, text="")  # INVALID_ARGUMENT
    # A replica without its backend's model: a fault of the deployment
    # (MODEL_NOT_SERVED, UNAVAILABLE), kept like any server fault.
    not_served = await failed_call_trace_id(orchestrator, model="no-such-model")
    # A server fault after them: once its spans arrive, the spans of the good and the
    # refused calls, queued before it in the same process, would have too.
    failed = await failed_call_trace_id(orchestrator, model="dead")
    await wait_for_spans(collected, failed, len([n for n in NODES if n.service == "orchestrator"]))
    await wait_for_spans(collected, not_served, 1)

    front = server_span(spans_of(collected, failed, "orchestrator"))
    assert front.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert attributes(front)["rpc.response.status_code"] == "UNAVAILABLE"
    assert attributes(front)["error.type"] == "UNAVAILABLE"
    # The capability exports in a process of its own: one more export round there.
    await asyncio.sleep(1.5)
    assert spans_of(collected, good.trace_id) == []
    assert {span.trace_id.hex() for _, span in collected.spans} == {failed, not_served}


async def test_with_sampling_off_batch_items_cut_off_by_the_deadline_are_exported(
    receiver: tuple[TraceReceiver, int],
    start_stack: Callable[..., Stack],
) -> None:
    """Items of a ClassifyBatch, each in an unsampled trace of its own, held by a
    stalled replica until the call's answer is due: each is answered DEADLINE_EXCEEDED,
    a time-out, and the orchestrator's part of its trace is exported, as a single
    call's would be. It was traced as CANCELLED, and none of it was exported."""
    collected, port = receiver
    endpoint = f"127.0.0.1:{port}"
    pod = FlakyPod(closed_port(), failing=False)  # it never answers: the replica stalls
    pod.answering.clear()
    await pod.start()
    trace_ids = [secrets.token_hex(16) for _ in range(4)]
    try:
        orchestrator = start_stack(
            routes=lambda _: (
                "version: 1\n"
                f"backends:\n  pod: {{model: topic-static, targets: ['{pod.address}']}}\n"
                "routes:\n  - {name: default, backend: pod}\n"
            ),
            capability_flags=(*STATIC_ONLY_FLAGS, "--otlp-endpoint", endpoint),
            orchestrator_flags=("--otlp-endpoint", endpoint, "--trace-sample-ratio", "0"),
        ).orchestrator
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            response = await stub.ClassifyBatch(
                pb.ClassifyBatchRequest(
                    items=[pb.ClassifyRequest(text=STRIKER)] * len(trace_ids),
                    item_contexts=[
                        pb.ItemContext(traceparent=f"00-{trace_id}-{secrets.token_hex(8)}-00")
                        for trace_id in trace_ids
                    ],
                ),
                timeout=2,
            )
    finally:
        pod.answering.set()
        await pod.stop()

    assert {result.error.code for result in response.results} == {
        grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    }

    def has_item_and_attempt(trace_id: str) -> bool:
        exported = {span.name for span in spans_of(collected, trace_id, "orchestrator")}
        return {"batch_item", "upstream_call"} <= exported

    for trace_id in trace_ids:
        # By name, not by count: the item's own span ends last (with its answer), and
        # may come in an export after its nodes' spans.
        await wait_until(
            functools.partial(has_item_and_attempt, trace_id),
            f"the item and attempt spans of {trace_id}",
        )
        spans = {span.name: span for span in spans_of(collected, trace_id, "orchestrator")}
        for name in ("batch_item", "upstream_call"):
            assert spans[name].status.code == trace_pb2.Status.STATUS_CODE_ERROR, name
            assert attributes(spans[name])["rpc.response.status_code"] == "DEADLINE_EXCEEDED"


async def test_requests_succeed_while_the_collector_is_unreachable(
    start_stack: Callable[..., Stack],
) -> None:
    orchestrator = start_exporting_stack(start_stack, f"127.0.0.1:{closed_port()}")
    for _ in range(3):
        response = await classify(orchestrator)
        assert response.labels[0].name == "sports"
    # The lost spans are counted once the exporter gives up on its batch.
    await wait_until(
        lambda: scrape(orchestrator, SPANS_DROPPED_TOTAL, reason="export_failed") > 0,
        "spans counted as dropped",
        limit_seconds=30,
    )
    assert scrape(orchestrator, SPANS_DROPPED_TOTAL, reason="export_failed") >= 3 * (
        len([n for n in NODES if n.service == "orchestrator"]) + 1
    )


def start_stack_exporting_by_environment(
    start_stack: Callable[..., Stack], port: int, **variables: str
) -> ServerProcess:
    """The stack on topic-static, told where to export only by the SDK's variables
    (`variables` go to both; each gets its own OTEL_SERVICE_NAME). The orchestrator."""
    shared = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", **variables}
    return start_stack(
        routes=trace_routes,
        capability_flags=("--models", "topic-static", "--default-model", "topic-static"),
        capability_env={**shared, "OTEL_SERVICE_NAME": "env-capability"},
        orchestrator_env={**shared, "OTEL_SERVICE_NAME": "env-orchestrator"},
    ).orchestrator


async def test_the_sdk_variables_alone_export_both_processes_under_their_service_names(
    receiver: tuple[TraceReceiver, int],
    start_stack: Callable[..., Stack],
) -> None:
    collected, port = receiver
    orchestrator = start_stack_exporting_by_environment(start_stack, port)
    response = await classify(orchestrator)
    await wait_for_spans(collected, response.trace_id, len(NODES) + 3)

    spans_with_every_node(collected, response.trace_id, "env-orchestrator", "env-capability")


async def test_the_sampler_variables_at_ratio_0_export_only_failing_traces(
    receiver: tuple[TraceReceiver, int],
    start_stack: Callable[..., Stack],
) -> None:
    collected, port = receiver
    orchestrator = start_stack_exporting_by_environment(
        start_stack, port, OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG="0"
    )
    good = await classify(orchestrator)
    failed = await failed_call_trace_id(orchestrator, model="dead")
    await wait_for_spans(collected, failed, 1)

    assert {name for name, s in collected.spans if s.trace_id.hex() == failed} == {
        "env-orchestrator"
    }
    # Wait one more export round: the good request's spans never come.
    await asyncio.sleep(1.5)
    assert spans_of(collected, good.trace_id) == []

"""Every request's trace has the 17 lifecycle nodes, once per attempt, under the right
parents, through a real orchestrator and a real capability server (in-process, with
an in-memory exporter; tests/system/test_trace_export.py covers OTLP across processes)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import re
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.metrics import NODE_DURATION_SECONDS
from classify_common.nodes import BATCH_SPAN_NAME, DEVICE_NODE_NAMES, NODE_NAMES, NODES
from orchestrator.server import OrchestratorServer
from tests.conftest import (
    REPO_ROOT,
    STRIKER,
    StartCapability,
    StartOrchestrator,
    metric_sum,
    orchestrator_for,
    routes_text,
    static_routes,
    wait_until,
)
from tests.status_details import refusal, trailers_of
from tests.unit.capability.test_serving import device_occupied
from tests.unit.orchestrator.test_policy import (
    dead_primary_with_fallback,
)

CLASSIFY_SPAN = "ai.classify.v1.ClassifyService/Classify"
ORCHESTRATOR_NODES = [n.name for n in NODES if n.service == "orchestrator"]
CAPABILITY_NODES = [n.name for n in NODES if n.service == "capability"]
ATTEMPT_NODES = NODE_NAMES[5:15]  # backend_select .. postprocess


def trace_spans(exporter: InMemorySpanExporter, trace_id: str) -> list[ReadableSpan]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.context is not None and format(s.context.trace_id, "032x") == trace_id
    ]


async def settled_trace(
    exporter: InMemorySpanExporter, trace_id: str, count: int
) -> list[ReadableSpan]:
    """The trace's spans once `count` have ended (server spans end after the answer)."""
    await wait_until(lambda: len(trace_spans(exporter, trace_id)) >= count, f"{count} spans")
    return trace_spans(exporter, trace_id)


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def attempt_of(span: ReadableSpan) -> int:
    attempt = dict(span.attributes or {})["classify.attempt"]
    assert isinstance(attempt, int)
    return attempt


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def only(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    (found,) = [s for s in spans if s.name == name]
    return found


def server_spans(spans: Sequence[ReadableSpan]) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The orchestrator's server span (the root) and the capability's, one per attempt."""
    servers = [s for s in spans if s.kind == SpanKind.SERVER]
    assert all(s.name == CLASSIFY_SPAN for s in servers)
    (front,) = [s for s in servers if s.parent is None]
    return front, [s for s in servers if s is not front]


def client_spans(spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    """The attempts' client spans (named after the method, like the server spans)."""
    return [s for s in spans if s.kind == SpanKind.CLIENT]


def node_count(orchestrator: OrchestratorServer, capability: CapabilityServer, name: str) -> float:
    """Observations of lifecycle node `name` in both servers' histograms."""
    return sum(
        metric_sum(server.registry, NODE_DURATION_SECONDS + "_count", lifecycle_node=name)
        for server in (orchestrator, capability)
    )


async def classify(server_port: int, **fields: object) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server_port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response: pb.ClassifyResponse = await stub.Classify(
            pb.ClassifyRequest(**{"text": STRIKER, **fields}),  # type: ignore[arg-type]
            timeout=30,
        )
        return response


async def test_a_request_has_every_node_once_under_the_right_parent(
    orchestrator: OrchestratorServer,
    capability: CapabilityServer,
    span_exporter: InMemorySpanExporter,
) -> None:
    before = {name: node_count(orchestrator, capability, name) for name in NODE_NAMES}
    response = await classify(orchestrator.port)
    # 17 nodes, the two server spans and the attempt's client span; the batch span
    # has a trace of its own.
    spans = await settled_trace(span_exporter, response.trace_id, len(NODES) + 3)

    names = collections.Counter(s.name for s in spans)
    assert names == collections.Counter([*NODE_NAMES, *[CLASSIFY_SPAN] * 3])
    front, (back,) = server_spans(spans)
    upstream = only(spans, "upstream_call")
    (client,) = client_spans(spans)
    assert upstream.kind == SpanKind.INTERNAL
    assert parent_id(client) == span_id(upstream)
    assert parent_id(back) == span_id(client)
    assert dict(client.attributes or {}) == {
        "rpc.system.name": "grpc",
        "rpc.method": CLASSIFY_SPAN,
        "server.address": "127.0.0.1",
        "server.port": capability.port,
        "rpc.response.status_code": "OK",
    }
    for name in ORCHESTRATOR_NODES:
        assert parent_id(only(spans, name)) == span_id(front), name
    for name in CAPABILITY_NODES:
        assert parent_id(only(spans, name)) == span_id(back), name

    attributes = {s.name: dict(s.attributes or {}) for s in spans if s.name in NODE_NAMES}
    assert attributes["grpc_receive"]["rpc.method"] == CLASSIFY_SPAN
    assert attributes["grpc_receive"]["network.peer.address"] == "127.0.0.1"
    assert attributes["auth_validate"]["classify.outcome"] == "ok"
    assert attributes["input_validate"]["classify.violations"] == 0
    assert attributes["route_match"]["classify.route"] == "default"
    assert attributes["route_match"]["classify.rules_version"] == orchestrator.routes.rules_version
    assert attributes["backend_select"]["classify.replica"] == f"127.0.0.1:{capability.port}"
    assert attributes["backend_select"]["classify.model_version"] == response.model.version
    assert attributes["upstream_call"]["classify.attempt"] == 1
    assert attributes["tokenize"]["classify.tokens"] == len(
        capability.pool.serving("topic-minilm").classifier.tokenize([STRIKER])[0]
    )
    assert attributes["queue_admit"]["classify.outcome"] == "admitted"
    assert attributes["batch_assemble"]["classify.batch_size"] == 1
    assert attributes["cuda_launch"]["classify.clock"] == "monotonic"
    assert attributes["response_send"]["rpc.response.status_code"] == "OK"
    assert all(s.status.status_code != StatusCode.ERROR for s in spans)

    # The device nodes follow each other without a gap: one batch, measured once.
    device = [only(spans, name) for name in CAPABILITY_NODES[3:]]  # gpu_queue_wait ..
    for earlier, later in itertools.pairwise(device):
        assert earlier.end_time == later.start_time

    # The batch span links to the request, and the request's batch_assemble to it.
    (link,) = only(spans, "batch_assemble").links
    (batch,) = [s for s in span_exporter.get_finished_spans() if s.context == link.context]
    assert batch.name == BATCH_SPAN_NAME
    assert any(batch_link.context == back.context for batch_link in batch.links)

    for name in NODE_NAMES:  # each node's histogram counted this request once
        after = node_count(orchestrator, capability, name)
        assert after - before[name] == 1, name


@pytest_asyncio.fixture
async def calls_never_gather(
    capability: CapabilityServer, tmp_path: Path
) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator that sends each of a few concurrent calls upstream on its own
    (one item is a full call, and enough of them may be in flight per replica), so
    they meet in the capability's queue."""
    async with orchestrator_for(
        capability, tmp_path, upstream_batch_max_items=1, upstream_calls_in_flight=8
    ) as server:
        yield server


async def test_requests_batched_together_link_one_batch_span(
    calls_never_gather: OrchestratorServer,
    capability: CapabilityServer,
    span_exporter: InMemorySpanExporter,
) -> None:
    (worker,) = capability.pool.workers
    async with device_occupied(worker):
        calls = [asyncio.ensure_future(classify(calls_never_gather.port)) for _ in range(3)]
        replica = worker.replicas["topic-minilm"]
        await wait_until(lambda: len(replica.queue) == 3, "three calls queued")
    responses = await asyncio.gather(*calls)

    batches = set()
    for response in responses:
        spans = await settled_trace(span_exporter, response.trace_id, len(NODES) + 3)
        assemble = only(spans, "batch_assemble")
        assert dict(assemble.attributes or {})["classify.batch_size"] == 3
        (link,) = assemble.links
        batches.add(link.context.span_id)
    assert len(batches) == 1


async def test_retries_and_fallback_are_attempts_with_their_reasons(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    span_exporter: InMemorySpanExporter,
) -> None:
    server = await orchestrator_with(dead_primary_with_fallback(capability.port))
    response = await classify(server.port)
    assert response.fallback
    # Two failed attempts reach no capability server: 17 + 2 * 2 attempt nodes, 2
    # servers, 3 client spans.
    spans = await settled_trace(span_exporter, response.trace_id, len(NODES) + 4 + 2 + 3)

    attempts = sorted((s for s in spans if s.name == "upstream_call"), key=attempt_of)
    assert [attempt_of(s) for s in attempts] == [1, 2, 3]
    first, retry, fallback = (dict(s.attributes or {}) for s in attempts)
    # A dead replica is the server side's fault: error status on the node too.
    assert [s.status.status_code for s in attempts] == [
        StatusCode.ERROR,
        StatusCode.ERROR,
        StatusCode.UNSET,
    ]
    assert first["rpc.response.status_code"] == "UNAVAILABLE"
    assert first["error.type"] == "UNAVAILABLE"
    clients = sorted(client_spans(spans), key=lambda s: s.start_time or 0)
    assert [s.status.status_code for s in clients] == [
        StatusCode.ERROR,
        StatusCode.ERROR,
        StatusCode.UNSET,
    ]
    assert [dict(s.attributes or {})["rpc.response.status_code"] for s in clients] == [
        "UNAVAILABLE",
        "UNAVAILABLE",
        "OK",
    ]
    assert dict(clients[0].attributes or {})["error.type"] == "UNAVAILABLE"
    assert [parent_id(c) for c in clients] == [span_id(a) for a in attempts]
    assert first["classify.backend"] == retry["classify.backend"] == "minilm"
    assert "classify.retry_reason" not in first
    assert retry["classify.retry_reason"] == "MODEL_UNAVAILABLE"
    assert fallback["classify.backend"] == "static"
    assert fallback["classify.fallback_reason"] == "MODEL_UNAVAILABLE"
    assert "classify.retry_reason" not in fallback  # a fallback, not a retry
    names = collections.Counter(s.name for s in spans)
    assert names["backend_select"] == 3
    assert all(names[name] == 1 for name in CAPABILITY_NODES)


async def test_a_request_past_its_budget_is_marked_timeout_and_still_traced(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    span_exporter: InMemorySpanExporter,
) -> None:
    routes = routes_text([f"127.0.0.1:{capability.port}"])
    server = await orchestrator_with(routes + "    budget: 1ms\n")
    (worker,) = capability.pool.workers
    async with device_occupied(worker):  # the model cannot answer within 1 ms
        response = await classify(server.port)
    assert response.status == pb.RESULT_STATUS_PROCESSING

    spans = await settled_trace(span_exporter, response.trace_id, len(NODES) + 3)
    front, _ = server_spans(spans)
    assert dict(front.attributes or {})["timeout"] is True
    upstream = only(spans, "upstream_call")
    assert dict(upstream.attributes or {})["timeout"] is True
    assert upstream.status.status_code != StatusCode.ERROR  # it finished, just late
    assert upstream.end_time is not None
    assert front.end_time is not None
    assert upstream.end_time > front.end_time  # exported when the work finished
    (client,) = client_spans(spans)  # the attempt's call, ended late too
    assert dict(client.attributes or {})["timeout"] is True


@pytest.mark.parametrize("text", ["", " \n ", "x" * 100_001])
async def test_an_invalid_request_names_its_violations_on_input_validate(
    orchestrator: OrchestratorServer, span_exporter: InMemorySpanExporter, text: str
) -> None:
    error = await refusal(classify(orchestrator.port, text=text))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    trace_id = trailers_of(error)["x-trace-id"]
    spans = await settled_trace(span_exporter, trace_id, 6)
    assert [s.name for s in spans if s.name in NODE_NAMES] == [
        "grpc_receive",
        "auth_validate",
        "rate_limit_check",
        "input_validate",
        "response_send",
    ]
    validate = only(spans, "input_validate")
    # The caller's fault, not the server's: no error status, the code says what it was.
    assert validate.status.status_code == StatusCode.UNSET
    assert dict(validate.attributes or {})["rpc.response.status_code"] == "INVALID_ARGUMENT"
    assert "error.type" not in dict(validate.attributes or {})
    assert dict(validate.attributes or {})["classify.violation_fields"] == ("text",)
    front, _ = server_spans(spans)
    assert front.status.status_code == StatusCode.UNSET
    assert dict(front.attributes or {})["rpc.response.status_code"] == "INVALID_ARGUMENT"


async def test_a_request_whose_bytes_do_not_decode_has_the_nodes_of_an_invalid_one(
    orchestrator: OrchestratorServer, span_exporter: InMemorySpanExporter
) -> None:
    """A text that is not UTF-8 is refused as validation refuses (rule `utf8`), but
    its trace lacked `input_validate`, which every invalid request's has."""
    raw = pb.ClassifyRequest(text="Caf# prices rose").SerializeToString().replace(b"#", b"\xe9")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/ai.classify.v1.ClassifyService/Classify"
        )
        error = await refusal(call(raw, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = await settled_trace(span_exporter, trailers_of(error)["x-trace-id"], 6)
    assert [s.name for s in spans if s.name in NODE_NAMES] == [
        "grpc_receive",
        "auth_validate",
        "rate_limit_check",
        "input_validate",
        "response_send",
    ]
    validate = dict(only(spans, "input_validate").attributes or {})
    assert validate["classify.violation_fields"] == ("text",)
    assert validate["rpc.response.status_code"] == "INVALID_ARGUMENT"


async def test_a_cache_hit_has_every_node_once_and_its_device_nodes_say_they_were_skipped(
    start_capability: StartCapability,
    orchestrator_with: StartOrchestrator,
    span_exporter: InMemorySpanExporter,
) -> None:
    cached = await start_capability(models=("topic-static",), result_cache_entries=100)
    orchestrator = await orchestrator_with(static_routes(f"127.0.0.1:{cached.port}"))
    computed = await classify(orchestrator.port)
    await settled_trace(span_exporter, computed.trace_id, len(NODES) + 3)
    before = {name: node_count(orchestrator, cached, name) for name in NODE_NAMES}
    hit = await classify(orchestrator.port)
    spans = await settled_trace(span_exporter, hit.trace_id, len(NODES) + 3)

    assert (computed.cached, hit.cached) == (False, True)
    names = collections.Counter(s.name for s in spans)
    assert names == collections.Counter([*NODE_NAMES, *[CLASSIFY_SPAN] * 3])
    _, (back,) = server_spans(spans)
    admit = only(spans, "queue_admit")
    assert dict(admit.attributes or {})["classify.cache"] == "hit"
    assert dict(admit.attributes or {})["classify.outcome"] == "cache_hit"
    for name in DEVICE_NODE_NAMES:
        skipped = only(spans, name)
        assert dict(skipped.attributes or {}) == {"classify.skipped": "cache_hit"}, name
        # Zero-length, at the moment of the hit (after its queue_admit).
        assert skipped.start_time == skipped.end_time, name
        assert (skipped.start_time or 0) >= (admit.end_time or 0) > 0, name
        assert parent_id(skipped) == span_id(back), name
        assert skipped.status.status_code == StatusCode.UNSET, name
    # Skipped nodes stay out of the node histogram; the nodes that ran are in it.
    await wait_until(
        lambda: node_count(orchestrator, cached, "response_send") == before["response_send"] + 1,
        "response_send observed",
    )
    after = {name: node_count(orchestrator, cached, name) for name in NODE_NAMES}
    assert {name: after[name] - before[name] for name in NODE_NAMES} == {
        name: 0 if name in DEVICE_NODE_NAMES else 1 for name in NODE_NAMES
    }


def test_observability_doc_lists_the_nodes_defined_in_code() -> None:
    doc = (REPO_ROOT / "docs" / "observability.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (\w+) \| .* \| (.*) \|$", doc, flags=re.MULTILINE)
    assert rows == [
        (str(n.number), n.name, n.service, ", ".join(f"`{key}`" for key in n.attributes))
        for n in NODES
    ]

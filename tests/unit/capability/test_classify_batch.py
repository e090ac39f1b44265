"""ClassifyBatch on a real capability server: many items in one RPC, each answered on
its own, in order, with its own deadline, request ID and trace."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.batching import PRIORITY_INTERACTIVE, Admission
from capability.item_trace import ITEM_SPAN_NAME
from capability.metrics import (
    ADMISSIONS_REFUSED_TOTAL,
    CLASSIFY_BATCH_METHOD,
    CLASSIFY_METHOD,
    DEADLINE_EXCEEDED_TOTAL,
    EVICTIONS_TOTAL,
    MODEL_FORWARD_TOTAL,
    MODEL_TEXTS_TOTAL,
    RPC_ITEMS,
)
from capability.model import EncodedText
from capability.server import CapabilityServer
from capability.workers.admission import TextRequest
from classify_common.context import EARLY_RESULTS_HEADER, EARLY_RESULTS_REQUEST_HEADER
from classify_common.errors import ExpiredInQueue, ModelFault, ServerDraining
from classify_common.metrics import NODE_DURATION_SECONDS
from classify_common.nodes import BATCH_SPAN_NAME, NODES
from tests.conftest import STRIKER, StartCapability, metric_sum, wait_until
from tests.status_details import unpack
from tests.unit.capability.test_residency import copy_under_names, room_for
from tests.unit.capability.test_serving import TEXTS, classify_stub, device_occupied

CAPABILITY_NODES = [node.name for node in NODES if node.service == "capability"]
BATCH_CALL_SPAN = CLASSIFY_BATCH_METHOD.lstrip("/")


def error_info(status: status_pb2.Status) -> error_details_pb2.ErrorInfo:
    (info,) = unpack(status, error_details_pb2.ErrorInfo)
    return info


def outcomes(response: pb.ClassifyBatchResponse) -> list[str | None]:
    """Each result's outcome, in order: "response", "error", or None (not set)."""
    return [result.WhichOneof("outcome") for result in response.results]


def violations(status: status_pb2.Status) -> list[tuple[str, str]]:
    return [
        (v.field, v.reason)
        for bad in unpack(status, error_details_pb2.BadRequest)
        for v in bad.field_violations
    ]


def timeout_of(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def new_traceparent() -> tuple[str, str, int]:
    """A sampled W3C traceparent with fresh IDs: (header, trace ID hex, span ID)."""
    trace_id, span_id = random.getrandbits(128) | 1, random.getrandbits(64) | 1
    return f"00-{trace_id:032x}-{span_id:016x}-01", f"{trace_id:032x}", span_id


async def classify_batch(
    stub: Any, items: Sequence[pb.ClassifyRequest], contexts: Sequence[pb.ItemContext] = ()
) -> tuple[pb.ClassifyBatchResponse, dict[str, str]]:
    """The answer and the call's trailers (its own request and trace IDs)."""
    call = stub.ClassifyBatch(
        pb.ClassifyBatchRequest(items=items, item_contexts=contexts), timeout=30
    )
    response: pb.ClassifyBatchResponse = await call
    trailers = {key: str(value) for key, value in await call.trailing_metadata()}
    return response, trailers


def node_count(server: CapabilityServer, name: str) -> float:
    return metric_sum(server.registry, NODE_DURATION_SECONDS + "_count", lifecycle_node=name)


def spans_of(exporter: InMemorySpanExporter, trace_id: str) -> list[ReadableSpan]:
    return [
        span
        for span in exporter.get_finished_spans()
        if span.context is not None and format(span.context.trace_id, "032x") == trace_id
    ]


async def settled_spans(
    exporter: InMemorySpanExporter, trace_id: str, count: int
) -> list[ReadableSpan]:
    """The trace's spans once `count` of them have ended."""
    await wait_until(lambda: len(spans_of(exporter, trace_id)) >= count)
    return spans_of(exporter, trace_id)


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


async def test_an_invalid_item_is_refused_alone_naming_its_field_and_request_id(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    response, trailers = await classify_batch(
        capability_stub,
        [
            pb.ClassifyRequest(text=STRIKER, request_id="item-0"),
            pb.ClassifyRequest(text="   ", request_id="item-1"),
            pb.ClassifyRequest(text=TEXTS[1], request_id="item-2"),
        ],
    )
    first, bad, last = response.results
    assert first.WhichOneof("outcome") == "response"
    assert first.response.request_id == "item-0"
    assert first.response.labels[0].name == "sports"
    assert last.WhichOneof("outcome") == "response"
    assert last.response.request_id == "item-2"
    assert bad.WhichOneof("outcome") == "error"
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert violations(bad.error) == [("items[1].text", "text.not_blank")]
    info = error_info(bad.error)
    assert info.reason == "INVALID_REQUEST"
    assert info.metadata["x-request-id"] == "item-1"
    # Without a traceparent of its own, an item belongs to the call's trace.
    assert info.metadata["x-trace-id"] == trailers["x-trace-id"]
    assert first.response.trace_id == trailers["x-trace-id"]


async def test_batch_results_equal_unary_results(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    requests = [pb.ClassifyRequest(text=text) for text in TEXTS]
    requests[2].top_k = 2
    requests[3].max_length = 6
    alone = [await capability_stub.Classify(request) for request in requests]
    together, _ = await classify_batch(capability_stub, requests)
    assert len(together.results) == len(requests)
    for single, result in zip(alone, together.results, strict=True):
        batched = result.response
        assert [label.name for label in batched.labels] == [label.name for label in single.labels]
        for a, b in zip(single.labels, batched.labels, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5)
        assert batched.confidence == pytest.approx(single.confidence, abs=1e-5)
        assert batched.model == single.model
        assert batched.status == pb.RESULT_STATUS_DONE
    # Items without a request ID get one each.
    generated = {result.response.request_id for result in together.results}
    assert len(generated) == len(requests)
    assert "" not in generated


async def test_items_per_rpc_are_observed_once_per_call(
    capability: CapabilityServer,
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    def observed(method: str) -> tuple[float, float]:
        return (
            metric_sum(capability.registry, RPC_ITEMS + "_count", method=method),
            metric_sum(capability.registry, RPC_ITEMS + "_sum", method=method),
        )

    unary_before, batch_before = observed(CLASSIFY_METHOD), observed(CLASSIFY_BATCH_METHOD)
    await capability_stub.Classify(pb.ClassifyRequest(text=STRIKER))
    await classify_batch(capability_stub, [pb.ClassifyRequest(text=t) for t in TEXTS[:5]])
    unary_after, batch_after = observed(CLASSIFY_METHOD), observed(CLASSIFY_BATCH_METHOD)
    assert (unary_after[0] - unary_before[0], unary_after[1] - unary_before[1]) == (1, 1)
    assert (batch_after[0] - batch_before[0], batch_after[1] - batch_before[1]) == (1, 5)


async def test_items_for_two_models_and_lengths_are_tokenized_once_per_group(
    capability: CapabilityServer,
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (worker,) = capability.pool.workers
    tokenize_calls: list[tuple[str, int, int | None]] = []
    admit_calls: collections.Counter[str] = collections.Counter()
    for name, replica in worker.replicas.items():
        classifier = replica.bundle.classifier
        tokenize, admit_many = classifier.tokenize, replica.queue.admit_many

        def counting_tokenize(
            texts: Sequence[str],
            max_length: int | None = None,
            *,
            _name: str = name,
            _tokenize: Any = tokenize,
        ) -> list[EncodedText]:
            tokenize_calls.append((_name, len(texts), max_length))
            result: list[EncodedText] = _tokenize(texts, max_length)
            return result

        def counting_admit(admissions: Any, *, _name: str = name, _admit: Any = admit_many) -> Any:
            admit_calls[_name] += 1
            return _admit(admissions)

        monkeypatch.setattr(classifier, "tokenize", counting_tokenize)
        monkeypatch.setattr(replica.queue, "admit_many", counting_admit)

    response, _ = await classify_batch(
        capability_stub,
        [
            pb.ClassifyRequest(text=STRIKER),
            pb.ClassifyRequest(text=STRIKER, model="topic-static"),
            pb.ClassifyRequest(text=TEXTS[1], max_length=6),
            pb.ClassifyRequest(text=TEXTS[1], model="topic-static"),
            pb.ClassifyRequest(text=STRIKER, model="no-such-model", request_id="lost"),
            pb.ClassifyRequest(text=TEXTS[2]),
        ],
    )
    models = [
        result.response.model.name if result.HasField("response") else None
        for result in response.results
    ]
    assert models == [
        "topic-minilm",
        "topic-static",
        "topic-minilm",
        "topic-static",
        None,
        "topic-minilm",
    ]
    assert response.results[0].response.labels[0].name == "sports"
    assert response.results[1].response.labels[0].name == "sports"
    missing = response.results[4].error
    assert missing.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert error_info(missing).reason == "MODEL_NOT_FOUND"
    assert error_info(missing).metadata["x-request-id"] == "lost"
    assert sorted(tokenize_calls, key=repr) == sorted(
        [("topic-minilm", 2, None), ("topic-minilm", 1, 6), ("topic-static", 2, None)], key=repr
    )
    assert admit_calls == {"topic-minilm": 1, "topic-static": 1}
    # The item cut to 6 tokens scores as a single call cut to 6 tokens does.
    alone = await capability_stub.Classify(pb.ClassifyRequest(text=TEXTS[1], max_length=6))
    cut = response.results[2].response
    assert [label.name for label in cut.labels] == [label.name for label in alone.labels]
    assert cut.labels[0].score == pytest.approx(alone.labels[0].score, abs=1e-5)


async def test_an_item_whose_time_is_already_too_short_is_never_computed(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(models=("topic-minilm",))
    registry = server.registry

    def counts() -> tuple[float, float, float]:
        return (
            metric_sum(registry, DEADLINE_EXCEEDED_TOTAL, model="topic-minilm", stage="admission"),
            metric_sum(registry, MODEL_TEXTS_TOTAL, model="topic-minilm"),
            metric_sum(registry, MODEL_FORWARD_TOTAL, model="topic-minilm"),
        )

    expired_before, texts_before, forwards_before = counts()
    async with classify_stub(server) as stub:
        response, _ = await classify_batch(
            stub,
            [
                pb.ClassifyRequest(text=STRIKER),
                pb.ClassifyRequest(text=TEXTS[1], request_id="late"),
                pb.ClassifyRequest(text=TEXTS[2]),
            ],
            [
                pb.ItemContext(),
                pb.ItemContext(timeout=timeout_of(1e-6)),
                pb.ItemContext(timeout=timeout_of(30)),
            ],
        )
    served, late, also_served = response.results
    assert served.response.labels[0].name == "sports"
    assert also_served.WhichOneof("outcome") == "response"
    assert late.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert error_info(late.error).reason == "DEADLINE_UNREACHABLE"
    assert error_info(late.error).metadata["x-request-id"] == "late"
    expired, texts, forwards = counts()
    assert expired - expired_before == 1
    assert texts - texts_before == 2  # the late item never reached the model
    assert forwards - forwards_before == 1  # the other two shared one forward
    assert metric_sum(registry, ADMISSIONS_REFUSED_TOTAL, reason="DEADLINE_UNREACHABLE") == 1


async def test_an_item_whose_time_runs_out_in_the_queue_is_evicted_and_never_computed(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(models=("topic-minilm",))
    worker = server.pool.workers[0]
    registry = server.registry
    texts_before = metric_sum(registry, MODEL_TEXTS_TOTAL, model="topic-minilm")
    async with classify_stub(server) as stub:
        async with device_occupied(worker):
            call = asyncio.ensure_future(
                classify_batch(
                    stub,
                    [pb.ClassifyRequest(text=STRIKER), pb.ClassifyRequest(text=TEXTS[1])],
                    [pb.ItemContext(), pb.ItemContext(timeout=timeout_of(1.0))],
                )
            )
            # Evicted by its timer while the device is still busy.
            await wait_until(
                lambda: metric_sum(registry, EVICTIONS_TOTAL, model="topic-minilm") == 1
            )
            assert len(worker.replicas["topic-minilm"].queue) == 1
        response, _ = await call
    served, evicted = response.results
    assert served.response.labels[0].name == "sports"
    assert evicted.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert error_info(evicted.error).reason == "EXPIRED_IN_QUEUE"
    assert metric_sum(registry, DEADLINE_EXCEEDED_TOTAL, model="topic-minilm", stage="queue") == 1
    assert metric_sum(registry, MODEL_TEXTS_TOTAL, model="topic-minilm") == texts_before + 1


async def test_items_beyond_the_queue_capacity_are_refused_alone(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(models=("topic-minilm",), queue_capacity=2)
    worker = server.pool.workers[0]
    async with classify_stub(server) as stub:
        async with device_occupied(worker):
            call = asyncio.ensure_future(
                classify_batch(stub, [pb.ClassifyRequest(text=text) for text in TEXTS[:4]])
            )
            await wait_until(lambda: len(worker.replicas["topic-minilm"].queue) == 2)
        response, _ = await call
    assert outcomes(response) == ["response", "response", "error", "error"]
    for result in response.results[2:]:
        assert result.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert error_info(result.error).reason == "QUEUE_FULL"
        assert unpack(result.error, error_details_pb2.RetryInfo)
    assert (
        metric_sum(
            server.registry, ADMISSIONS_REFUSED_TOTAL, model="topic-minilm", reason="QUEUE_FULL"
        )
        == 2
    )


async def early_results_while_the_device_is_held(
    server: CapabilityServer, ask: str | None
) -> tuple[pb.ClassifyBatchResponse | None, bool, pb.ClassifyBatchResponse]:
    """Four items into a queue of two while the device is held: (the early results the
    call's initial metadata carried, if any; whether they came while the device was
    still held; the call's answer). `ask`: the early-results header's value, if sent."""
    worker = server.pool.workers[0]
    metadata = () if ask is None else ((EARLY_RESULTS_REQUEST_HEADER, ask),)
    request = pb.ClassifyBatchRequest(
        items=[
            pb.ClassifyRequest(text=text, request_id=f"item-{n}")
            for n, text in enumerate(TEXTS[:4])
        ]
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        # As the orchestrator calls it: a stream's initial metadata comes when sent.
        call = channel.unary_stream(
            CLASSIFY_BATCH_METHOD,
            request_serializer=pb.ClassifyBatchRequest.SerializeToString,
            response_deserializer=pb.ClassifyBatchResponse.FromString,
        )(request, timeout=30, metadata=metadata)
        async with device_occupied(worker):
            await wait_until(lambda: len(worker.replicas["topic-minilm"].queue) == 2)
            try:
                # Asked, they come at once (a loaded machine gets time); not asked,
                # a second shows that nothing comes before the answer.
                waited = 10.0 if ask is not None else 1.0
                initial = await asyncio.wait_for(call.initial_metadata(), timeout=waited)
                while_held = True
            except TimeoutError:
                initial, while_held = None, False
        if initial is None:
            initial = await call.initial_metadata()
        answer = await call.read()
    assert isinstance(answer, pb.ClassifyBatchResponse)
    early = dict(initial).get(EARLY_RESULTS_HEADER)
    assert early is None or isinstance(early, bytes)
    parsed = None if early is None else pb.ClassifyBatchResponse.FromString(early)
    return parsed, while_held, answer


async def test_items_refused_at_admission_are_answered_before_the_others_are_computed(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(models=("topic-minilm",), queue_capacity=2)
    early, while_held, answer = await early_results_while_the_device_is_held(server, "65536")
    assert early is not None
    assert while_held
    assert outcomes(early) == [None, None, "error", "error"]
    for index in (2, 3):
        assert error_info(early.results[index].error).reason == "QUEUE_FULL"
        assert error_info(early.results[index].error).metadata["x-request-id"] == f"item-{index}"
        # The answer repeats them, beside the two computed once the device was free.
        assert answer.results[index] == early.results[index]
    assert outcomes(answer)[:2] == ["response"] * 2


async def test_early_results_fit_the_bytes_asked_for_and_come_only_when_asked(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(models=("topic-minilm",), queue_capacity=2)
    everything, _, _ = await early_results_while_the_device_is_held(server, "65536")
    assert everything is not None
    # Room for the first refusal's status (with a length prefix of at most 4 bytes)
    # and half the second's: only the first goes early.
    room = (
        pb.ClassifyBatchResponse(results=[pb.ClassifyBatchResult()] * 4).ByteSize()
        + everything.results[2].error.ByteSize()
        + 4
        + everything.results[3].error.ByteSize() // 2
    )
    early, _, answer = await early_results_while_the_device_is_held(server, str(room))
    assert early is not None
    assert outcomes(early) == [None, None, "error", None]
    assert answer.results[3].WhichOneof("outcome") == "error"
    # Not asked: initial metadata comes with the answer, and no early results in it.
    early, while_held, answer = await early_results_while_the_device_is_held(server, None)
    assert early is None
    assert not while_held
    assert outcomes(answer) == ["response", "response", "error", "error"]


async def test_an_item_left_out_at_the_device_is_answered_before_the_forward_ends(
    start_capability: StartCapability, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two items handed to the device thread behind a hold; the first's time runs out
    there. When the hold ends, the thread leaves it out and the call's early results
    carry it while the other's forward is still running (held here until the early
    results have come)."""
    server = await start_capability(models=("topic-minilm",))
    worker = server.pool.workers[0]
    replica = worker.replicas["topic-minilm"]
    forward_may_end = threading.Event()
    run = replica.bundle.classifier.run

    def held_run(*args: Any, **kwargs: Any) -> Any:
        forward_may_end.wait(30)
        return run(*args, **kwargs)

    monkeypatch.setattr(replica.bundle.classifier, "run", held_run)
    # Long enough for both to be handed over first on a loaded machine (as in
    # test_serving: a 0.3 s deadline once passed while they were still being handed
    # over, and the first then expired in the queue instead).
    first_seconds = 1.5
    request = pb.ClassifyBatchRequest(
        items=[pb.ClassifyRequest(text=TEXTS[1]), pb.ClassifyRequest(text=STRIKER)],
        item_contexts=[pb.ItemContext(timeout=timeout_of(first_seconds)), pb.ItemContext()],
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_stream(
            CLASSIFY_BATCH_METHOD,
            request_serializer=pb.ClassifyBatchRequest.SerializeToString,
            response_deserializer=pb.ClassifyBatchResponse.FromString,
        )(request, timeout=30, metadata=((EARLY_RESULTS_REQUEST_HEADER, "65536"),))
        try:
            async with device_occupied(worker, take_turn=False):
                # Both handed over (out of the queue, so no queue timer evicts the
                # first), then past the first's deadline.
                await wait_until(lambda: replica.in_flight == 2)
                await asyncio.sleep(first_seconds + 0.2)
            initial = await asyncio.wait_for(call.initial_metadata(), timeout=10)
            assert not call.done()
        finally:
            forward_may_end.set()
        answer = await call.read()
    early_bytes = dict(initial)[EARLY_RESULTS_HEADER]
    assert isinstance(early_bytes, bytes)
    early = pb.ClassifyBatchResponse.FromString(early_bytes)
    assert outcomes(early) == ["error", None]
    assert error_info(early.results[0].error).reason == "EXPIRED_IN_QUEUE"
    assert isinstance(answer, pb.ClassifyBatchResponse)
    assert answer.results[0] == early.results[0]
    assert answer.results[1].response.labels[0].name == "sports"
    assert (
        metric_sum(server.registry, DEADLINE_EXCEEDED_TOTAL, model="topic-minilm", stage="device")
        == 1
    )


async def test_each_item_is_traced_in_its_own_trace_with_every_capability_node(
    capability: CapabilityServer,
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    span_exporter: InMemorySpanExporter,
) -> None:
    parents = [new_traceparent() for _ in range(3)]
    before = {name: node_count(capability, name) for name in CAPABILITY_NODES}
    response, trailers = await classify_batch(
        capability_stub,
        [pb.ClassifyRequest(text=text) for text in TEXTS[:4]],
        [pb.ItemContext(traceparent=header) for header, _, _ in parents] + [pb.ItemContext()],
    )
    call_trace = trailers["x-trace-id"]
    expected = [trace_id for _, trace_id, _ in parents] + [call_trace]
    assert [result.response.trace_id for result in response.results] == expected

    # The call's server span ends once gRPC has sent the answer.
    await wait_until(
        lambda: any(s.name == BATCH_CALL_SPAN for s in spans_of(span_exporter, call_trace))
    )
    (call_span,) = [s for s in spans_of(span_exporter, call_trace) if s.name == BATCH_CALL_SPAN]
    batch_spans = set()
    for index, (result, trace_id) in enumerate(zip(response.results, expected, strict=True)):
        spans = await settled_spans(span_exporter, trace_id, len(CAPABILITY_NODES) + 1)
        (item_span,) = [
            s
            for s in spans
            if s.name == ITEM_SPAN_NAME
            and dict(s.attributes or {}).get("classify.request_id") == result.response.request_id
        ]
        assert item_span.kind == SpanKind.SERVER
        assert item_span.parent is not None
        if index < len(parents):  # under the caller's span, linked to the batch call
            assert item_span.parent.span_id == parents[index][2]
            assert [link.context.span_id for link in item_span.links] == [span_id(call_span)]
        else:  # no traceparent: a child of the batch call's span
            assert item_span.parent.span_id == span_id(call_span)
        under_item = [s for s in spans if s.parent and s.parent.span_id == span_id(item_span)]
        names = collections.Counter(s.name for s in under_item)
        assert names == collections.Counter(CAPABILITY_NODES)
        (assemble,) = [s for s in under_item if s.name == "batch_assemble"]
        (link,) = assemble.links
        batch_spans.add(link.context.span_id)
    # The four items shared one forward; its span links back to each item's span.
    (batch_span_id,) = batch_spans
    (batch,) = [
        s
        for s in span_exporter.get_finished_spans()
        if s.name == BATCH_SPAN_NAME and span_id(s) == batch_span_id
    ]
    assert len(batch.links) == 4
    # Every item counts once in each node's histogram; the call itself does not.
    for name in CAPABILITY_NODES:
        assert node_count(capability, name) - before[name] == 4, name


async def test_without_span_export_items_make_no_spans_but_every_node_is_counted(
    capability: CapabilityServer,
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    span_exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("classify_common.nodes.spans_are_exported", lambda: False)
    monkeypatch.setattr("capability.item_trace.spans_are_exported", lambda: False)
    parents = [new_traceparent() for _ in range(2)]
    before = {name: node_count(capability, name) for name in CAPABILITY_NODES}
    response, _ = await classify_batch(
        capability_stub,
        [pb.ClassifyRequest(text=text) for text in TEXTS[:2]],
        [pb.ItemContext(traceparent=header) for header, _, _ in parents],
    )
    assert [result.response.trace_id for result in response.results] == [
        trace_id for _, trace_id, _ in parents
    ]
    for _, trace_id, _ in parents:
        assert spans_of(span_exporter, trace_id) == []
    for name in CAPABILITY_NODES:
        assert node_count(capability, name) - before[name] == 2, name


async def test_stopping_the_loop_answers_the_running_and_the_following_batch(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(models=("topic-minilm",), max_batch_size=2)
    worker = server.pool.workers[0]
    replica = worker.replicas["topic-minilm"]
    encoded = replica.bundle.classifier.tokenize([TEXTS[0]])[0]
    async with device_occupied(worker, take_turn=False):
        waiters = [
            replica.admit(Admission(encoded, PRIORITY_INTERACTIVE, f"r{i}", None)) for i in range(4)
        ]
        # Both slots hold a batch handed to the (held) device thread.
        await wait_until(
            lambda: replica.batcher.running is not None and replica.batcher.following is not None
        )
        await replica.batcher.stop(ServerDraining("stopping"))
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(outcome, ModelFault) for outcome in outcomes)
    assert replica.in_flight == 0
    assert replica.batcher.running is None
    assert replica.batcher.following is None


async def test_a_batch_handed_to_a_closed_device_thread_is_answered_not_lost(
    start_capability: StartCapability,
) -> None:
    # A batch taken off the queue has left it: when the device thread cannot take it
    # (closed, here), its texts must still get an answer.
    server = await start_capability(models=("topic-minilm",))
    worker = server.pool.workers[0]
    replica = worker.replicas["topic-minilm"]
    encoded = replica.bundle.classifier.tokenize([TEXTS[0]])[0]
    worker._device_thread.close()

    waiter = replica.admit(Admission(encoded, PRIORITY_INTERACTIVE, "late", None))

    with pytest.raises(ModelFault, match="the batch failed"):
        await asyncio.wait_for(waiter, 10)
    assert replica.in_flight == 0
    assert replica.batcher.running is None


async def test_requests_evicted_while_waiting_for_the_device_do_not_keep_it_from_others(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(models=("topic-minilm", "topic-static"))
    worker = server.pool.workers[0]
    minilm = worker.replicas["topic-minilm"]
    encoded = minilm.bundle.classifier.tokenize([TEXTS[0]])[0]
    async with device_occupied(worker):
        expiring = minilm.admit(
            Admission(
                encoded, PRIORITY_INTERACTIVE, "expiring", asyncio.get_running_loop().time() + 1.0
            )
        )
        await wait_until(expiring.done)
        assert isinstance(expiring.exception(), ExpiredInQueue)
    # The minilm loop now gets the device with nothing left to run: it gives it back.
    async with classify_stub(server) as stub:
        response = await stub.Classify(
            pb.ClassifyRequest(text=STRIKER, model="topic-static"), timeout=20
        )
    assert response.labels[0].name == "sports"


async def test_a_failed_item_of_a_batch_call_is_logged_under_its_own_ids(
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The orchestrator merges many requests into one call: the call's `rpc` line says
    how many items failed, and each failed item gets a WARNING line under its own
    request and trace IDs with its reason and message, as a single Classify's failure
    is logged; the item answered gets none."""
    traceparent, trace_id, _ = new_traceparent()
    items = [
        pb.ClassifyRequest(text=STRIKER, request_id="item-answered"),
        pb.ClassifyRequest(text=STRIKER, model="no-such-model", request_id="item-unserved"),
    ]
    contexts = [pb.ItemContext(), pb.ItemContext(traceparent=traceparent)]
    with caplog.at_level(logging.INFO):
        answer, trailers = await classify_batch(capability_stub, items, contexts)
        await wait_until(
            lambda: any(r.getMessage() == "rpc" for r in caplog.records), "the call's rpc line"
        )
    assert answer.results[0].HasField("response")
    (info,) = unpack(answer.results[1].error, error_details_pb2.ErrorInfo)
    failed = [r for r in caplog.records if r.getMessage() == "batch item failed"]
    assert [(r.levelname, vars(r)["request_id"]) for r in failed] == [("WARNING", "item-unserved")]
    line = vars(failed[0])
    assert line["trace_id"] == trace_id
    assert line["reason"] == info.reason
    assert line["code"] == grpc.StatusCode.NOT_FOUND.name
    assert answer.results[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert line["error"] == answer.results[1].error.message
    assert line["call_request_id"] == trailers["x-request-id"]
    (rpc,) = [r for r in caplog.records if r.getMessage() == "rpc"]
    assert (vars(rpc)["items"], vars(rpc)["items_failed"]) == (2, 1)


async def test_a_batch_calls_lines_name_the_model_version_and_worker_its_items_reached(
    capability: CapabilityServer,
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The runbook looks for one failing worker in the failed calls' lines: a batch
    call's `rpc` line and its failed items' lines named none of them (a single call's
    did), and batch calls are how the orchestrator sends under load."""
    worker = capability.pool.workers[0]
    items = [pb.ClassifyRequest(text=STRIKER, request_id=f"late-{n}") for n in range(2)]
    contexts = [pb.ItemContext(timeout=timeout_of(0.2))] * 2
    with caplog.at_level(logging.DEBUG):
        async with device_occupied(worker):
            answer, _ = await classify_batch(capability_stub, items, contexts)
        await wait_until(
            lambda: any(r.getMessage() == "rpc" for r in caplog.records), "the call's rpc line"
        )
    assert outcomes(answer) == ["error", "error"]
    served_by = {
        key: vars(record)[key]
        for record in caplog.records
        if record.getMessage() == "batch item failed"
        for key in ("model", "worker")
    }
    assert served_by == {"model": "topic-minilm", "worker": worker.name}
    failed = [vars(r) for r in caplog.records if r.getMessage() == "batch item failed"]
    assert sorted(line["request_id"] for line in failed) == ["late-0", "late-1"]
    assert {line["model_version"] for line in failed} == {"1"}
    (rpc,) = [vars(r) for r in caplog.records if r.getMessage() == "rpc"]
    assert (rpc["model"], rpc["model_version"], rpc["worker"]) == ("topic-minilm", "1", worker.name)


async def test_a_batch_for_two_models_cancelled_while_one_waits_leaves_nothing_queued(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """One model's texts were queued at once while the other's waited for a cold start
    (or a tokenizer thread): the caller that went then left them queued, computed for
    nobody and holding places that later callers were refused for (QUEUE_FULL)."""
    names = ["static-a", "static-b"]
    copy_under_names(model_root / "topic-static" / "1", tmp_path / "models", names)
    server = await start_capability(
        model_root=tmp_path / "models",
        default_model=names[0],
        residency="on_demand",
        idle_seconds=3600,
        queue_capacity=4,
    )
    room_for(server, names, 1)  # static-b's cold start waits for static-a to go idle
    worker = server.pool.workers[0]
    async with classify_stub(server) as stub:
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"), timeout=30)
        computed = metric_sum(server.registry, MODEL_TEXTS_TOTAL, model="static-a")
        resident = worker.replicas["static-a"]
        items = [pb.ClassifyRequest(text=f"{STRIKER} {n}", model="static-a") for n in range(4)]
        items.append(pb.ClassifyRequest(text=STRIKER, model="static-b"))
        async with device_occupied(worker):
            call = stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), timeout=30)
            await wait_until(lambda: len(resident.queue) == 4, "static-a's texts queued")
            call.cancel()
            await wait_until(lambda: len(resident.queue) == 0, "static-a's texts withdrawn")
        # Answered, not QUEUE_FULL; and none of the withdrawn texts was computed.
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"), timeout=30)
    assert metric_sum(server.registry, MODEL_TEXTS_TOTAL, model="static-a") == computed + 1


async def test_a_failed_early_answer_frees_the_places_of_the_texts_it_abandons(
    start_capability: StartCapability,
) -> None:
    """The refusals of a batch call are sent first (on_refused, the early answer); when
    that send fails (the connection broke), the texts still queued are abandoned. Only
    a cancelled call freed their places: after any other failure they held them until
    a batch or their timers took them, refusing others QUEUE_FULL meanwhile and counted
    as evicted at their deadlines."""
    server = await start_capability(models=("topic-static",))
    (worker,) = server.pool.workers
    replica = worker.replicas["topic-static"]
    now = asyncio.get_running_loop().time()

    async def connection_lost(refusals: object) -> None:
        raise RuntimeError("the early answer could not be sent")

    texts = [
        TextRequest("topic-static", STRIKER, None, PRIORITY_INTERACTIVE, "late", now - 1),
        TextRequest("topic-static", STRIKER, None, PRIORITY_INTERACTIVE, "queued", None),
    ]
    async with device_occupied(worker):
        with pytest.raises(RuntimeError, match="could not be sent"):
            await server.pool.classify_many(texts, connection_lost)
        assert len(replica.queue) == 0

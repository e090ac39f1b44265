"""A bug in a handler, over real servers: INTERNAL with the IDs to quote, the
traceback only in the server's log, and the call counted by its code and as a bug
(classify_internal_errors_total, which the ClassifyInternalErrors alert reads)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from google.rpc.error_details_pb2 import ErrorInfo

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.metrics import CLASSIFY_METHOD
from capability.server import CapabilityServer
from classify_common.metrics import INTERNAL_ERRORS_TOTAL, RPC_REQUESTS_TOTAL
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, LineCollector, metric_sum, wait_until
from tests.status_details import error_info, error_reason, refusal, trailers_of, unpack

# Stands in for what a real bug's message can hold: a path and a secret.
PLANTED_MESSAGE = "planted bug: /srv/secrets/db.yaml has password=hunter2"
REQUEST_ID = "planted-bug-1"


async def planted_bug(*args: object, **kwargs: object) -> Any:
    raise RuntimeError(PLANTED_MESSAGE)


async def two_item_batch(port: int) -> pb.ClassifyBatchResponse:
    """A ClassifyBatch of two items, with request IDs REQUEST_ID-1 and -2, to `port`."""
    request = pb.ClassifyBatchRequest(
        items=[pb.ClassifyRequest(text=STRIKER, request_id=f"{REQUEST_ID}-{n}") for n in (1, 2)]
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answer: pb.ClassifyBatchResponse = await stub.ClassifyBatch(request, timeout=10)
    return answer


# Each server's domain object that its Classify servicer calls; the bug is planted
# there, so the servicer, the interceptor and the server around it are the real ones.
PLANT_IN = {"capability": "pool", "orchestrator": "dispatcher"}


@pytest.mark.parametrize("layer", sorted(PLANT_IN))
async def test_planted_bug_answers_internal_with_ids_and_no_traceback(
    layer: str,
    capability: CapabilityServer,
    orchestrator: OrchestratorServer,
    monkeypatch: pytest.MonkeyPatch,
    interceptor_log: LineCollector,
) -> None:
    server = capability if layer == "capability" else orchestrator
    monkeypatch.setattr(getattr(server, PLANT_IN[layer]), "classify", planted_bug)

    def internal_errors() -> float:
        return metric_sum(
            server.registry, RPC_REQUESTS_TOTAL, method=CLASSIFY_METHOD, code="INTERNAL"
        )

    before = internal_errors()
    bugs_before = metric_sum(server.registry, INTERNAL_ERRORS_TOTAL)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        error = await refusal(
            stub.Classify(pb.ClassifyRequest(text=STRIKER, request_id=REQUEST_ID))
        )

    assert error.code() == grpc.StatusCode.INTERNAL
    assert error_reason(error) == "INTERNAL"  # ErrorInfo and trailers carry the same IDs
    trace_id = trailers_of(error)["x-trace-id"]
    assert error_info(error).metadata["x-request-id"] == REQUEST_ID
    assert len(trace_id) == 32
    details = error.details() or ""
    assert details == (
        f"internal error (request {REQUEST_ID}, trace {trace_id}); the server logged the cause"
    )
    everything_sent = f"{details} {error_info(error)} {trailers_of(error)}"
    assert "RuntimeError" not in everything_sent
    assert "hunter2" not in everything_sent
    assert "Traceback" not in everything_sent
    # NOTE: grpc.aio's abort sends the status before the interceptor's `finally`
    # counts the call, and this client shares the servers' event loop.
    await wait_until(lambda: internal_errors() != before, "the call counted", limit_seconds=5)
    assert internal_errors() - before == 1
    assert metric_sum(server.registry, INTERNAL_ERRORS_TOTAL) - bugs_before == 1

    (line,) = [
        entry for entry in map(json.loads, interceptor_log.lines) if entry["level"] == "error"
    ]
    assert line["event"] == "unhandled error"
    assert line["method"] == CLASSIFY_METHOD
    assert (line["request_id"], line["trace_id"]) == (REQUEST_ID, trace_id)
    assert "Traceback" in line["exception"]
    assert f"RuntimeError: {PLANTED_MESSAGE}" in line["exception"]


async def test_planted_bug_in_a_batch_item_answers_that_item_internal_and_counts_it(
    orchestrator: OrchestratorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch call's items are served by the dispatcher, not the request lifecycle:
    a bug there answers each item as a single call would be answered, and counts."""
    monkeypatch.setattr(orchestrator.dispatcher, "classify", planted_bug)
    bugs_before = metric_sum(orchestrator.registry, INTERNAL_ERRORS_TOTAL)
    answer = await two_item_batch(orchestrator.port)
    for n, result in zip((1, 2), answer.results, strict=True):
        assert result.error.code == grpc.StatusCode.INTERNAL.value[0]
        (info,) = unpack(result.error, ErrorInfo)
        assert info.reason == "INTERNAL"
        assert info.metadata["x-request-id"] == f"{REQUEST_ID}-{n}"
        trace_id = info.metadata["x-trace-id"]
        assert result.error.message == (
            f"internal error (request {REQUEST_ID}-{n}, trace {trace_id}); "
            "the server logged the cause"
        )
        assert "hunter2" not in str(result.error)
    assert metric_sum(orchestrator.registry, INTERNAL_ERRORS_TOTAL) - bugs_before == 2


async def test_a_text_left_without_an_answer_in_a_capability_batch_is_internal_and_counted(
    capability: CapabilityServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capability batch call's items are answered by the worker pool, not the request
    lifecycle: a bug that leaves one text without an answer answers it INTERNAL, answers
    the others, and counts as a bug, as the orchestrator counts its own items'."""
    admitter = capability.pool._admitter
    admit_group = admitter.admit_group

    async def admit_losing_the_first(*args: Any) -> list[Any]:
        admitted = await admit_group(*args)
        lost: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        lost.set_exception(RuntimeError(PLANTED_MESSAGE))
        return [lost, *admitted[1:]]

    monkeypatch.setattr(admitter, "admit_group", admit_losing_the_first)
    bugs_before = metric_sum(capability.registry, INTERNAL_ERRORS_TOTAL)
    answer = await two_item_batch(capability.port)
    lost, answered = answer.results
    assert lost.error.code == grpc.StatusCode.INTERNAL.value[0]
    (info,) = unpack(lost.error, ErrorInfo)
    assert info.reason == "INTERNAL"
    assert info.metadata["x-request-id"] == f"{REQUEST_ID}-1"
    assert "hunter2" not in str(lost.error)
    assert answered.HasField("response")
    assert metric_sum(capability.registry, INTERNAL_ERRORS_TOTAL) - bugs_before == 1

"""classify_requests_total: one count per request (a Classify call, a ClassifyBatch
item) by the outcome its caller got, which the availability objective reads.

Counted per RPC (classify_rpc_requests_total), a ClassifyBatch call whose items all
failed was one call answered OK, and a PROCESSING answer was a fast success
whatever its work's fate."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.metrics import REQUESTS_TOTAL, RPC_REQUESTS_TOTAL
from orchestrator.metrics import REQUEST_DURATION_SECONDS
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, StartOrchestrator, closed_port, metric_sum, wait_until
from tests.unit.capability.test_serving import device_occupied
from tests.unit.orchestrator.test_batch import front_door_for_a_small_tenant

BATCH_METHOD = "/ai.classify.v1.ClassifyService/ClassifyBatch"


def outcomes(server: OrchestratorServer) -> dict[tuple[str, str, str], float]:
    """classify_requests_total's non-zero series: (route, code, reason) -> count."""
    return {
        (sample.labels["route"], sample.labels["code"], sample.labels["reason"]): sample.value
        for family in server.registry.collect()
        for sample in family.samples
        if sample.name == REQUESTS_TOTAL and sample.value
    }


async def test_each_batch_item_and_call_counts_once_by_its_own_outcome(
    capability: CapabilityServer, orchestrator_with: StartOrchestrator
) -> None:
    server = await orchestrator_with(
        "version: 1\n"
        "backends:\n"
        f"  live: {{model: topic-minilm, targets: ['127.0.0.1:{capability.port}']}}\n"
        f"  dead: {{model: topic-minilm, targets: ['127.0.0.1:{closed_port()}']}}\n"
        "routes:\n"
        "  - name: broken\n"
        "    match: {header: {name: x-route, values: [broken]}}\n"
        "    backend: dead\n"
        "  - name: default\n"
        "    backend: live\n"
    )
    to_dead = (("x-route", "broken"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER))
        batch = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(
                items=[
                    pb.ClassifyRequest(text=STRIKER),
                    pb.ClassifyRequest(text=""),
                    pb.ClassifyRequest(text=STRIKER),
                ]
            ),
            metadata=to_dead,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused_whole:
            # item_contexts that do not match the items: the call is refused whole.
            await stub.ClassifyBatch(
                pb.ClassifyBatchRequest(
                    items=[pb.ClassifyRequest(text=STRIKER)] * 3,
                    item_contexts=[pb.ItemContext()],
                )
            )
        with pytest.raises(grpc.aio.AioRpcError) as unary_failed:
            await stub.Classify(pb.ClassifyRequest(text=STRIKER), metadata=to_dead)
    assert [result.error.code for result in batch.results] == [
        grpc.StatusCode.UNAVAILABLE.value[0],
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.UNAVAILABLE.value[0],
    ]
    assert refused_whole.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unary_failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert outcomes(server) == {
        ("default", "OK", ""): 1,
        ("broken", "UNAVAILABLE", "MODEL_UNAVAILABLE"): 3,  # two items and the call
        # One item, and a call of three that the batch rules refused whole (it names
        # no text to serve, so it counts once, as its rate limit does).
        ("", "INVALID_ARGUMENT", "INVALID_REQUEST"): 2,
    }
    # Per RPC, both batch calls were one call each, the first answered OK.
    assert metric_sum(server.registry, RPC_REQUESTS_TOTAL, method=BATCH_METHOD, code="OK") == 1


async def test_a_processing_answer_counts_when_its_work_ends_with_the_works_outcome(
    capability: CapabilityServer, orchestrator_with: StartOrchestrator
) -> None:
    server = await orchestrator_with(
        "version: 1\n"
        "backends:\n"
        f"  live: {{model: topic-minilm, targets: ['127.0.0.1:{capability.port}'], timeout: 30s}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: live\n"
        "    budget: 100ms\n"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(capability.pool.workers[0]):
            pending = await stub.Classify(pb.ClassifyRequest(text=STRIKER, request_id="slow-1"))
            batch = await stub.ClassifyBatch(
                pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=STRIKER)])
            )
            counted_while_working = outcomes(server)

        async def both_counted() -> bool:
            return outcomes(server) == {("default", "OK", ""): 2}

        await wait_until(both_counted, "the two calls' work counted when it ended")
        for _ in range(3):  # polls are calls of their own, not the request's outcome
            await stub.GetResult(pb.GetResultRequest(request_id="slow-1"))
    assert pending.status == pb.RESULT_STATUS_PROCESSING
    assert batch.results[0].response.status == pb.RESULT_STATUS_PROCESSING
    assert counted_while_working == {}
    assert outcomes(server) == {("default", "OK", ""): 2}
    # Timed as what their callers waited, out of the latency objective's code="OK".
    durations = f"{REQUEST_DURATION_SECONDS}_count"
    assert metric_sum(server.registry, durations, route="default", code="PROCESSING") == 2
    assert metric_sum(server.registry, durations, route="default", code="OK") == 0


async def test_a_call_refused_whole_by_who_sent_it_or_the_batch_rules_counts_once(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    # A keyless caller's 500 items, and a keyed batch over the 1,024 items a call may
    # carry, each counted as that many refused requests: anyone who reached the front
    # door could outweigh an outage in the error-budget ratio.
    blank_items = [pb.ClassifyRequest(text="")]
    async with (
        front_door_for_a_small_tenant(capability, tmp_path) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as keyless:
            await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=blank_items * 500))
        with pytest.raises(grpc.aio.AioRpcError) as too_many:
            await stub.ClassifyBatch(
                pb.ClassifyBatchRequest(items=blank_items * 1_025),
                metadata=(("authorization", "Bearer limited-secret"),),
            )
        served = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=STRIKER)] * 2),
            metadata=(("authorization", "Bearer limited-secret"),),
            timeout=30,
        )
    assert keyless.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [result.WhichOneof("outcome") for result in served.results] == ["response"] * 2
    assert outcomes(server) == {
        ("", "UNAUTHENTICATED", "UNAUTHENTICATED"): 1,
        ("", "INVALID_ARGUMENT", "INVALID_REQUEST"): 1,
        ("default", "OK", ""): 2,
    }

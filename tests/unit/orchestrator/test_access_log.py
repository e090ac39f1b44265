"""The orchestrator's `rpc` access-log line, through a real orchestrator in front of a
real capability server (or a pod that fails its calls): the fields docs/observability.md
lists are there on the outcomes an operator greps it for, not only on a plain answer."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common import interceptor
from tests.conftest import (
    STRIKER,
    LineCollector,
    StartCapability,
    StartOrchestrator,
    routes_text,
    wait_until,
)
from tests.flaky_pod import FlakyPod
from tests.status_details import refusal
from tests.unit.capability.test_serving import device_occupied


def rpc_line(log: LineCollector, request_id: str) -> dict[str, Any]:
    """The one `rpc` line of the call `request_id`."""
    entries: list[dict[str, Any]] = [json.loads(line) for line in log.lines]
    (line,) = [e for e in entries if e["event"] == "rpc" and e.get("request_id") == request_id]
    return line


async def classify(port: int, request_id: str) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response: pb.ClassifyResponse = await stub.Classify(
            pb.ClassifyRequest(text=STRIKER, request_id=request_id), timeout=30
        )
        return response


async def test_a_failed_calls_line_names_the_backend_that_failed_and_the_attempts(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    interceptor_log: LineCollector,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """UNAVAILABLE after three attempts: the line said neither where nor how often."""
    pod = FlakyPod(capability.port, failing=True)
    await pod.start()
    try:
        server = await orchestrator_with(
            "version: 1\n"
            f"backends:\n  pod: {{model: topic-minilm, targets: ['{pod.address}']}}\n"
            "routes:\n"
            "  - name: default\n    backend: pod\n"
            "    retry: {max_attempts: 3, initial_backoff: 1ms, max_backoff: 2ms}\n"
        )
        caplog.set_level(logging.INFO, logger=interceptor.__name__)  # the "rpc" lines
        error = await refusal(classify(server.port, "failing-1"))
    finally:
        await pod.stop()

    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert pod.calls == 3
    line = rpc_line(interceptor_log, "failing-1")
    assert (line["code"], line["reason"]) == ("UNAVAILABLE", "MODEL_UNAVAILABLE")
    assert (line["route"], line["backend"], line["attempts"]) == ("default", "pod", 3)
    # The model it was bound for, as an answered call's line names the one that answered:
    # the runbook greps failing calls' lines for one model.
    assert line["model"] == "topic-minilm"


async def test_a_capability_refusals_line_names_the_model_version_and_worker(
    start_capability: StartCapability,
    interceptor_log: LineCollector,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Refused QUEUE_FULL on a worker whose queue is full: the line had none of `model`,
    `model_version` and `worker`, which only an answered call's carried, so the runbook's
    look for one failing worker in the failing calls' lines found nothing."""
    server = await start_capability(models=("topic-static",), queue_capacity=1)
    caplog.set_level(logging.INFO, logger=interceptor.__name__)
    (worker,) = server.pool.workers
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(worker):
            queued = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER, request_id="queued-1"))
            )
            await wait_until(lambda: len(worker.replicas["topic-static"].queue) == 1, "queued")
            error = await refusal(
                stub.Classify(pb.ClassifyRequest(text=STRIKER, request_id="refused-1"))
            )
        await queued
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    line = rpc_line(interceptor_log, "refused-1")
    assert line["reason"] == "QUEUE_FULL"
    assert (line["model"], line["model_version"], line["worker"]) == ("topic-static", "1", "cpu:0")


async def test_a_processing_answers_line_says_the_budget_ran_out(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    interceptor_log: LineCollector,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Answered PROCESSING, the line was `code: OK` and nothing else said so; it says
    `timeout: true`, as the call's spans do."""
    routes = routes_text([f"127.0.0.1:{capability.port}"])
    server = await orchestrator_with(routes + "    budget: 1ms\n")
    caplog.set_level(logging.INFO, logger=interceptor.__name__)
    (worker,) = capability.pool.workers
    async with device_occupied(worker):  # the model cannot answer within 1 ms
        answered = await classify(server.port, "processing-1")
    assert answered.status == pb.RESULT_STATUS_PROCESSING

    line = rpc_line(interceptor_log, "processing-1")
    assert (line["code"], line["route"], line["timeout"]) == ("OK", "default", True)


async def test_a_merged_calls_line_names_the_capability_call_that_carried_it(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
    interceptor_log: LineCollector,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The capability logs a merged call under a request ID of its own, which no line of
    the requests it carried named: a grep by request ID found only the front door's."""
    server = await orchestrator_with(routes_text([f"127.0.0.1:{capability.port}"]))
    caplog.set_level(logging.INFO, logger=interceptor.__name__)
    (pool,) = server.dispatcher.state.upstream.pools()
    (worker,) = capability.pool.workers
    async with device_occupied(worker):
        first = asyncio.ensure_future(classify(server.port, "alone-1"))
        await wait_until(lambda: pool.in_flight == 1, "the first call in flight")
        merged = [asyncio.ensure_future(classify(server.port, f"merged-{n}")) for n in range(3)]
        await wait_until(
            lambda: sum(c.waiting for c in pool.coalescers.values()) == 3, "three gathering"
        )
    await asyncio.gather(first, *merged)

    shared = {rpc_line(interceptor_log, f"merged-{n}")["upstream_request_id"] for n in range(3)}
    (shared_id,) = shared
    assert rpc_line(interceptor_log, shared_id)["items"] == 3
    # Sent alone, under its own request ID, which both servers' lines carry.
    alone = [json.loads(line) for line in interceptor_log.lines if '"alone-1"' in line]
    assert len(alone) == 2
    assert all("upstream_request_id" not in line for line in alone)

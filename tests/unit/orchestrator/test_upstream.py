"""The orchestrator's calls to capability servers: deadlines, failures, one trace."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.errors import DeadlineExpired, DeadlineUnreachable
from classify_common.metrics import RPC_REQUESTS_TOTAL
from orchestrator.metrics import REQUEST_DURATION_SECONDS
from orchestrator.policy.retries import DEADLINE_SAFETY_MARGIN_SECONDS
from orchestrator.server import OrchestratorServer
from orchestrator.upstream import errors as upstream_errors
from orchestrator.upstream import pool
from orchestrator.upstream.pool import call_timeout
from tests.conftest import (
    STRIKER,
    LineCollector,
    StartCapability,
    StartOrchestrator,
    capability_settings,
    closed_port,
    metric_sum,
    orchestrator_settings,
    routes_text,
    wait_until,
)
from tests.flaky_pod import FlakyPod
from tests.status_details import error_info, error_reason, refusal, trailers_of

CLASSIFY_SPAN = "ai.classify.v1.ClassifyService/Classify"

StartOrchestratorTo = Callable[..., Awaitable[OrchestratorServer]]


@pytest.fixture
def orchestrator_to(orchestrator_with: StartOrchestrator) -> StartOrchestratorTo:
    """Start an orchestrator whose one backend is `targets` with `timeout`."""

    async def start(targets: list[str], backend_timeout: str = "5s") -> OrchestratorServer:
        return await orchestrator_with(routes_text(targets, backend_timeout))

    return start


def test_call_timeout_takes_the_tighter_of_backend_timeout_and_client_deadline() -> None:
    assert call_timeout(5.0, None) == 5.0
    assert call_timeout(5.0, 1.0) == pytest.approx(1.0 - DEADLINE_SAFETY_MARGIN_SECONDS)
    assert call_timeout(0.5, 30.0) == 0.5
    # Time left, but less than the orchestrator keeps to answer: it cannot be met.
    with pytest.raises(DeadlineUnreachable, match="ms are left"):
        call_timeout(5.0, DEADLINE_SAFETY_MARGIN_SECONDS / 2)
    with pytest.raises(DeadlineExpired) as passed:
        call_timeout(5.0, -0.001)
    assert not isinstance(passed.value, DeadlineUnreachable)


async def test_unreachable_capability_is_a_model_error_with_ids(
    orchestrator_to: StartOrchestratorTo,
) -> None:
    server = await orchestrator_to([f"127.0.0.1:{closed_port()}"])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        error = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=20))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(error) == "MODEL_UNAVAILABLE"
    # No internal address or upstream text reaches the client, in the message or details.
    assert error.details() == "backend topic-minilm is unavailable"
    assert "127.0.0.1" not in str(error_info(error))
    trailers = trailers_of(error)
    assert trailers["x-request-id"]
    assert len(trailers["x-trace-id"]) == 32
    counted = server.registry.get_sample_value(
        RPC_REQUESTS_TOTAL,
        {"method": "/ai.classify.v1.ClassifyService/Classify", "code": "UNAVAILABLE"},
    )
    assert counted == 1.0


async def test_backend_timeout_is_passed_down_and_reported_as_deadline_exceeded(
    orchestrator_to: StartOrchestratorTo, capability: CapabilityServer
) -> None:
    # 1 ms cannot cover tokenising and six encoder layers on any machine.
    server = await orchestrator_to([f"127.0.0.1:{capability.port}"], "1ms")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        error = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=20))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Out of time on the way, or refused up front by the capability, which predicts
    # it cannot answer in 1 ms (kept as such, so a fallback could still answer).
    assert error_reason(error) in ("DEADLINE_EXPIRED", "DEADLINE_UNREACHABLE")
    assert trailers_of(error)["x-request-id"]


async def test_a_replica_past_the_backends_timeout_is_logged_at_warning_naming_it(
    capability: CapabilityServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stalled replica: its call runs out at the backend's timeout, long before the
    caller's deadline. The only line naming the replica is a WARNING (the translation
    of the call's DEADLINE_EXCEEDED, which cannot tell whose time ran out, logs at
    DEBUG), as the runbook's DEADLINE_EXPIRED step reads it."""
    pod = FlakyPod(capability.port, failing=False)
    pod.answering.clear()  # stalled
    await pod.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\n"
        f"backends:\n  pod: {{model: topic-minilm, targets: ['{pod.address}'], timeout: 200ms}}\n"
        "routes:\n  - name: default\n    backend: pod\n    retry: {max_attempts: 1}\n"
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes), registry=CollectorRegistry()
    )
    await server.start()
    try:
        with caplog.at_level(logging.INFO):
            caplog.clear()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
                error = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=20))
    finally:
        pod.answering.set()
        await server.stop(grace_seconds=0)
        await pod.stop()
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error_info(error).metadata["backend_timeout_ms"] == "200"
    warned = [
        vars(r)
        for r in caplog.records
        if r.levelno == logging.WARNING and r.getMessage() == "capability call failed"
    ]
    assert [(w["target"], w["backend_timeout_ms"], w["code"]) for w in warned] == [
        (pod.address, 200, "DEADLINE_EXCEEDED")
    ]


async def test_get_result_answers_not_found_for_unknown_request(
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    error = await refusal(orchestrator_stub.GetResult(pb.GetResultRequest(request_id="never-seen")))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason(error) == "RESULT_NOT_FOUND"


async def test_client_traceparent_is_continued(
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    response = await orchestrator_stub.Classify(
        pb.ClassifyRequest(text=STRIKER),
        metadata=(("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),),
    )
    assert response.trace_id == trace_id


async def test_replica_reporting_not_serving_gets_no_calls(
    orchestrator_to: StartOrchestratorTo, model_root: Path
) -> None:
    # Started but not warmed up: its health says NOT_SERVING.
    cold = CapabilityServer(capability_settings(model_root), registry=CollectorRegistry())
    await cold.start()
    try:
        server = await orchestrator_to([f"127.0.0.1:{cold.port}"])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            error = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=20))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        # The channel's health check kept every attempt from reaching the server.
        assert metric_sum(cold.registry, RPC_REQUESTS_TOTAL) == 0
    finally:
        await cold.stop(grace_seconds=0)


async def test_latency_histograms_carry_route_model_and_a_trace_exemplar(
    orchestrator: OrchestratorServer,
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    response = await orchestrator_stub.Classify(pb.ClassifyRequest(text=STRIKER))
    # prometheus_client's OpenMetrics writer has no type hints.
    exposition = generate_openmetrics(orchestrator.registry).decode()  # type: ignore[no-untyped-call]
    bucket_lines = [
        line
        for line in exposition.splitlines()
        if line.startswith(REQUEST_DURATION_SECONDS + "_bucket{")
        and 'route="default"' in line
        and 'model="topic-minilm"' in line
        and 'code="OK"' in line
    ]
    assert bucket_lines
    # OpenMetrics exemplars: `... # {trace_id="..."} value timestamp` on the bucket hit.
    assert any(f'# {{trace_id="{response.trace_id}"}}' in line for line in bucket_lines)


async def test_an_unsampled_call_leaves_no_exemplar_that_would_lead_nowhere(
    orchestrator: OrchestratorServer,
    orchestrator_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    """A caller's traceparent that says "not sampled": the call's spans are not exported
    (it succeeds), so neither server offers its trace ID as an exemplar. The ID is
    new: a sampled call of another test with a fixed ID leaves it in a bucket."""
    trace_id = uuid.uuid4().hex
    unsampled = (("traceparent", f"00-{trace_id}-00f067aa0ba902b7-00"),)
    response = await orchestrator_stub.Classify(
        pb.ClassifyRequest(text=STRIKER), metadata=unsampled
    )
    assert response.trace_id == trace_id
    # prometheus_client's OpenMetrics writer has no type hints.
    exposition = generate_openmetrics(orchestrator.registry).decode()  # type: ignore[no-untyped-call]
    assert trace_id not in exposition


async def test_a_token_budget_of_one_is_raised_to_what_the_model_needs_not_refused(
    orchestrator: OrchestratorServer,
) -> None:
    """The contract allows max_length 1 and promises truncation; [CLS] and [SEP] take
    two tokens, so the budget becomes three: one token of text, as with max_length 3."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answers = [
            await stub.Classify(pb.ClassifyRequest(text=STRIKER, max_length=budget), timeout=30)
            for budget in (1, 2, 3)
        ]
        whole = await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
    scores = [[(label.name, label.score) for label in answer.labels] for answer in answers]
    assert scores[0] == scores[1] == scores[2]
    assert scores[0] != [(label.name, label.score) for label in whole.labels]


async def test_a_replica_whose_model_fails_is_reported_as_a_model_fault_with_ids(
    orchestrator_to: StartOrchestratorTo, start_capability: StartCapability
) -> None:
    """Reached, but its batches fail (its device thread is closed): the caller is told
    MODEL_FAULT, not that the backend could not be reached."""
    faulty = await start_capability(models=("topic-minilm",))
    faulty.pool.workers[0]._device_thread.close()
    server = await orchestrator_to([f"127.0.0.1:{faulty.port}"])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        error = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=20))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(error) == "MODEL_FAULT"
    assert error.details() == "backend topic-minilm failed to compute the text"
    trailers = trailers_of(error)
    assert trailers["x-request-id"]
    assert len(trailers["x-trace-id"]) == 32


async def test_each_failed_upstream_item_is_logged_under_its_own_request_id(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """Eight callers while the one call a replica may have in flight is held: the rest
    gather and leave in one merged call, which fails; each failure's log line names
    its own request, not the caller's whose turn happened to send the call."""
    pod = FlakyPod(capability.port, failing=True)
    pod.answering.clear()
    await pod.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\n"
        f"backends:\n  pod: {{model: topic-minilm, targets: ['{pod.address}']}}\n"
        "routes:\n  - name: default\n    backend: pod\n    retry: {max_attempts: 1}\n"
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, upstream_calls_in_flight=1),
        registry=CollectorRegistry(),
    )
    collector = LineCollector()
    upstream_log = logging.getLogger(upstream_errors.__name__)
    upstream_log.addHandler(collector)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            calls = [
                asyncio.ensure_future(
                    refusal(
                        stub.Classify(
                            pb.ClassifyRequest(text=STRIKER, request_id=f"dead-{i}"), timeout=20
                        )
                    )
                )
                for i in range(8)
            ]
            await wait_until(lambda: pod.calls == 1, "the first call held at the pod")
            (pool,) = server.dispatcher.state.upstream.pools()
            (coalescer,) = pool.coalescers.values()
            # NOTE: all eight, held or gathering: callers that reach the coalescer in the
            # same turn of the event loop leave together, so on a busy machine the held
            # call may carry more than the first (waiting for exactly 7 then timed out).
            await wait_until(lambda: coalescer.outstanding == 8, "the other calls gathering")
            pod.answering.set()
            errors = await asyncio.gather(*calls)
    finally:
        upstream_log.removeHandler(collector)
        await server.stop(grace_seconds=0)
        await pod.stop()
    assert {error.code() for error in errors} == {grpc.StatusCode.UNAVAILABLE}
    assert pod.calls <= 2  # eight items in two calls at most: merged
    failed = [
        entry["request_id"]
        for entry in map(json.loads, collector.lines)
        if entry["event"] == "capability call failed"
    ]
    assert sorted(failed) == [f"dead-{i}" for i in range(8)]


# Reconnect backoff (first, longest) for the outage test: a fifth of the pool's, so
# that a few seconds down tell it from gRPC's own (1 s first, 1.6x a try, up to 120 s).
TEST_RECONNECT_BACKOFF_MS = (100, 400)


async def test_a_replica_back_after_an_outage_is_dialled_within_the_capped_backoff(
    start_capability: StartCapability,
    orchestrator_to: StartOrchestratorTo,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC's reconnect backoff grows 1.6x a try up to 120 s: after 20 s down, a replica
    back on its address waited several seconds more for its first call (40 s after a
    150 s outage), however many callers failed meanwhile. The pool caps it
    (RECONNECT_BACKOFF_MS, 2 s); capped here at 0.4 s, the address is dialled again
    every 0.4 s or so while nothing listens properly on it, and a replica back there
    is called within about that."""
    options = [
        (name, value)
        for name, value in pool.CHANNEL_OPTIONS
        if name not in ("grpc.initial_reconnect_backoff_ms", "grpc.max_reconnect_backoff_ms")
    ]
    options += [
        ("grpc.initial_reconnect_backoff_ms", TEST_RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", TEST_RECONNECT_BACKOFF_MS[1]),
    ]
    assert len(options) == len(pool.CHANNEL_OPTIONS)  # both were set
    monkeypatch.setattr(pool, "CHANNEL_OPTIONS", tuple(options))
    replica = await start_capability(models=("topic-minilm",))
    port = replica.port
    server = await orchestrator_to([f"127.0.0.1:{port}"])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=20)
        await replica.stop(grace_seconds=0)
        # Down: the port takes connections and closes them at once, so each dial the
        # orchestrator makes is counted.
        dials = 0

        def count_dial(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal dials
            dials += 1
            writer.close()

        down = await asyncio.start_server(count_dial, "127.0.0.1", port, reuse_address=True)
        loop = asyncio.get_running_loop()
        down_for = 4.0
        down_until = loop.time() + down_for
        while loop.time() < down_until:  # callers keep failing while it is down
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=1)
            await asyncio.sleep(0.3)
        down.close()
        await down.wait_closed()
        # About ten dials (0.1, 0.16, 0.26, 0.4, 0.4, ... s apart, with gRPC's 20%
        # jitter); gRPC's own backoff dials 3 times in 4 s (1, 1.6, 2.6 s apart).
        assert dials >= 6, dials
        await start_capability(models=("topic-minilm",), port=port)
        back_at = loop.time()
        while True:
            try:
                await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=1)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        # The capped backoff (0.4 s, with jitter), a connection and a health check; loose,
        # for a busy machine (the dials above are what tell the cap from gRPC's backoff).
        assert loop.time() - back_at < 2.5

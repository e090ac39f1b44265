"""Load shedding over real servers: a backend whose capability reports a wait longer
than a call's deadline is not sent the call (its route's fallback answers, or the call
is refused at once), the capability's answers carry its load report, and the
adaptive limit refuses the excess with RESOURCE_EXHAUSTED and RetryInfo."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.context import LOAD_REPORT_TRAILER
from orchestrator.config import DEFAULT_CONCURRENCY
from orchestrator.metrics import (
    BACKEND_CONCURRENCY_LIMIT,
    BACKEND_IN_FLIGHT,
    CONCURRENCY_LIMITED_TOTAL,
    DEADLINE_UNREACHABLE_TOTAL,
    MODEL_FALLBACK_TOTAL,
    UPSTREAM_RETRIES_TOTAL,
)
from orchestrator.server import OrchestratorServer
from orchestrator.upstream.load import REPORT_LIFETIME_SECONDS, read_load_report
from tests.conftest import (
    STRIKER,
    StartCapability,
    metric_sum,
    orchestrator_settings,
    wait_until,
)
from tests.flaky_pod import FlakyPod
from tests.status_details import error_info, metadata_dict, refusal, retry_delay_seconds
from tests.unit.capability.test_serving import device_occupied

# What the busy pod says: 800 ms of queue ahead of a new text, then 5 ms of its own.
LONG_QUEUE = pb.LoadReport(queue_depth=400, device_busy_share=1.0)
LONG_QUEUE.predicted_queue_wait.FromMilliseconds(800)
LONG_QUEUE.predicted_service.FromMilliseconds(5)
DEADLINE_SECONDS = 0.5
# Calls held by a stalled pod: more than a window of the adaptive limit needs.
STALLED_CALLS = 12


def routes_with_busy_primary(path: Path, pod: str, capability: str, fallback: bool) -> Path:
    fallback_line = "    fallback: [spare]\n" if fallback else ""
    path.write_text(
        "version: 1\n"
        "backends:\n"
        f"  busy: {{model: topic-minilm, targets: ['{pod}']}}\n"
        f"  spare: {{model: topic-static, targets: ['{capability}']}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: busy\n"
        f"{fallback_line}"
    )
    return path


@pytest_asyncio.fixture
async def busy_pod(capability: CapabilityServer) -> AsyncIterator[FlakyPod]:
    pod = FlakyPod(capability.port, failing=False)
    pod.load_report = LONG_QUEUE.SerializeToString()
    await pod.start()
    yield pod
    await pod.stop()


async def orchestrator_with(routes: Path) -> OrchestratorServer:
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes), registry=CollectorRegistry()
    )
    await server.start()
    return server


async def test_capability_answers_carry_its_load_report(
    capability: CapabilityServer,
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
) -> None:
    call = capability_stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)
    await call
    trailers = metadata_dict(await call.trailing_metadata())
    raw = trailers[LOAD_REPORT_TRAILER]
    assert isinstance(raw, bytes)
    report = pb.LoadReport.FromString(raw)
    # Idle: nothing queued, and its own batch predicted from warm-up.
    assert report.queue_depth == 0
    assert report.predicted_queue_wait.ToNanoseconds() == 0
    assert report.predicted_service.ToNanoseconds() > 0
    assert 0.0 <= report.device_busy_share <= 1.0
    # What the call took in the server, which the orchestrator takes from its round trip.
    assert 0 < report.handled.ToNanoseconds() < 10 * 10**9
    (replica,) = (worker.replicas["topic-minilm"] for worker in capability.pool.workers)
    assert report.max_batch_size == replica.settings.max_batch_size > 0


async def test_backend_reporting_a_long_queue_is_skipped_for_the_fallback_while_it_lasts(
    capability: CapabilityServer, busy_pod: FlakyPod, tmp_path: Path
) -> None:
    routes = routes_with_busy_primary(
        tmp_path / "routes.yaml", busy_pod.address, f"127.0.0.1:{capability.port}", True
    )
    server = await orchestrator_with(routes)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            request = pb.ClassifyRequest(text=STRIKER)
            # The first call finds no report yet: the busy pod answers, and says how busy.
            first = await stub.Classify(request, timeout=DEADLINE_SECONDS)
            assert (first.fallback, first.model.name, busy_pod.calls) == (False, "topic-minilm", 1)
            # While its queue lasts, calls that cannot wait 800 ms go to the fallback.
            for _ in range(3):
                answer = await stub.Classify(request, timeout=DEADLINE_SECONDS)
                assert (answer.fallback, answer.model.name) == (True, "topic-static")
            assert busy_pod.calls == 1
            registry = server.registry
            assert metric_sum(registry, DEADLINE_UNREACHABLE_TOTAL, backend="busy") == 3
            assert (
                metric_sum(
                    registry,
                    MODEL_FALLBACK_TOTAL,
                    **{"from": "busy", "to": "spare"},
                    reason="DEADLINE_UNREACHABLE",
                )
                == 3
            )
            # A caller with time for the wait is still sent there.
            patient = await stub.Classify(request, timeout=5)
            assert (patient.fallback, busy_pod.calls) == (False, 2)
            # The reported queue drains as time passes: once it would have, the busy
            # backend gets calls again (and reports its long queue anew).
            await asyncio.sleep(0.8 - DEADLINE_SECONDS + 0.1)
            again = await stub.Classify(request, timeout=DEADLINE_SECONDS)
            assert (again.fallback, busy_pod.calls) == (False, 3)
    finally:
        await server.stop(grace_seconds=0)


async def test_a_replica_reporting_a_long_queue_is_passed_over_for_one_that_can_answer(
    capability: CapabilityServer, busy_pod: FlakyPod, tmp_path: Path
) -> None:
    """Two replicas of one backend, one reporting 800 ms of queue. Chosen by fewest
    items outstanding alone, the busy one (which refuses such calls unsent, and so
    never has any) took its turn of every call, and refused it: half the calls failed
    while the other replica stood idle."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\nbackends:\n"
        f"  minilm: {{model: topic-minilm, targets: ['{busy_pod.address}',"
        f" '127.0.0.1:{capability.port}']}}\n"
        "routes:\n  - name: default\n    backend: minilm\n"
    )
    # A queue that outlasts the six calls on a busy machine too: 800 ms of it drained
    # (by the orchestrator's reckoning) while a slow run's calls were still made, and
    # the busy pod had its turn again, rightly.
    longer = pb.LoadReport()
    longer.CopyFrom(LONG_QUEUE)
    longer.predicted_queue_wait.FromSeconds(10)
    busy_pod.load_report = longer.SerializeToString()
    server = await orchestrator_with(routes)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            request = pb.ClassifyRequest(text=STRIKER)
            # Patient calls until one has reached the busy pod and brought its report.
            await wait_until(lambda: _reaches(stub, request, busy_pod), "the busy pod's report", 10)
            answers = [await stub.Classify(request, timeout=DEADLINE_SECONDS) for _ in range(6)]
        assert [answer.model.name for answer in answers] == ["topic-minilm"] * 6
        assert busy_pod.calls == 1
    finally:
        await server.stop(grace_seconds=0)


async def _reaches(
    stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    request: pb.ClassifyRequest,
    pod: FlakyPod,
) -> bool:
    await stub.Classify(request, timeout=5)
    return pod.calls >= 1


def test_a_load_report_is_trusted_for_a_second_past_its_queue_then_not() -> None:
    """Trusted for ever, the service time of one report (a batch sized by the deep
    queue of then) kept every call with a shorter deadline from the replica, and so
    kept any newer report from coming."""
    load = read_load_report(LONG_QUEUE.SerializeToString(), received_at=100.0)
    assert load is not None
    assert load.wait_at(100.0) == pytest.approx(0.805)
    assert load.wait_at(100.8 + REPORT_LIFETIME_SECONDS - 0.01) == pytest.approx(0.005)
    assert load.wait_at(100.8 + REPORT_LIFETIME_SECONDS + 0.01) == 0.0


def fallback_chain(**addresses: str) -> str:
    """routes.yaml with one backend of topic-minilm per keyword (its name, its replica's
    address), and one route: the first the primary, the others its fallbacks in order,
    one attempt each."""
    primary, *fallbacks = addresses
    backends = "".join(
        f"  {name}: {{model: topic-minilm, targets: ['{address}']}}\n"
        for name, address in addresses.items()
    )
    return (
        f"version: 1\nbackends:\n{backends}routes:\n  - name: default\n"
        f"    backend: {primary}\n    fallback: [{', '.join(fallbacks)}]\n"
        "    retry: {max_attempts: 1}\n"
    )


async def test_a_fallback_that_refuses_before_any_work_leaves_the_primarys_failure(
    capability: CapabilityServer, busy_pod: FlakyPod, tmp_path: Path
) -> None:
    """The primary is down (UNAVAILABLE); its fallback reports a wait longer than the
    call's time, so it refuses the call unsent. The caller is told what happened to
    its model (UNAVAILABLE, retry), not DEADLINE_EXCEEDED."""
    down = FlakyPod(capability.port, failing=True)
    await down.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(fallback_chain(down=down.address, busy=busy_pod.address))
    server = await orchestrator_with(routes)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            request = pb.ClassifyRequest(text=STRIKER)
            patient = await stub.Classify(request, timeout=5)  # learns the busy report
            refused = await refusal(stub.Classify(request, timeout=DEADLINE_SECONDS))
    finally:
        await server.stop(grace_seconds=0)
        await down.stop()
    assert (patient.fallback, busy_pod.calls) == (True, 1)
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(refused).reason == "MODEL_UNAVAILABLE"
    fallbacks = metric_sum(server.registry, MODEL_FALLBACK_TOTAL, **{"from": "down", "to": "busy"})
    assert fallbacks == 1  # the refused fallback is no fallback served


async def test_a_fallback_answer_is_counted_under_how_the_primary_failed(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """The primary refuses before any work (DEADLINE_UNREACHABLE), the first fallback is
    down (UNAVAILABLE: what the caller would hear, had no one answered), the second
    answers. model_fallback_total{from="refusing"} counted it under the first
    fallback's reason, which the primary never gave: the runbook reads the labels as
    which primary failed, and how."""
    refusing = FlakyPod(capability.port, failing=False)
    refusing.refusing_unreachable = True
    down = FlakyPod(capability.port, failing=True)
    for pod in (refusing, down):
        await pod.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        fallback_chain(
            refusing=refusing.address, down=down.address, live=f"127.0.0.1:{capability.port}"
        )
    )
    server = await orchestrator_with(routes)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=5)
    finally:
        await server.stop(grace_seconds=0)
        for pod in (refusing, down):
            await pod.stop()
    assert (answer.fallback, refusing.calls, down.calls) == (True, 1, 1)
    counted = {
        (sample.labels["from"], sample.labels["to"], sample.labels["reason"]): sample.value
        for family in server.registry.collect()
        for sample in family.samples
        if sample.name == MODEL_FALLBACK_TOTAL
    }
    assert counted == {("refusing", "live", "DEADLINE_UNREACHABLE"): 1}


async def test_a_fallback_refused_under_its_own_timeout_is_no_timeout_of_its_own(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """The fallback's replica refuses the call DEADLINE_UNREACHABLE, before any work,
    with seconds left on the caller's deadline and a backend timeout shorter than that:
    a refusal, as above, not the fallback failing to answer within its timeout
    (reported as DEADLINE_EXCEEDED, it replaced the primary's UNAVAILABLE)."""
    down = FlakyPod(capability.port, failing=True)
    refusing = FlakyPod(capability.port, failing=False)
    refusing.refusing_unreachable = True
    await down.start()
    await refusing.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\n"
        "backends:\n"
        f"  down: {{model: topic-minilm, targets: ['{down.address}'], timeout: 600ms}}\n"
        f"  full: {{model: topic-minilm, targets: ['{refusing.address}'], timeout: 600ms}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: down\n"
        "    fallback: [full]\n"
        "    retry: {max_attempts: 1}\n"
    )
    server = await orchestrator_with(routes)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            refused = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=5))
    finally:
        await server.stop(grace_seconds=0)
        await down.stop()
        await refusing.stop()
    assert refusing.calls == 1
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(refused).reason == "MODEL_UNAVAILABLE"


async def test_without_a_fallback_the_call_is_refused_at_once_with_a_retry_hint(
    capability: CapabilityServer, busy_pod: FlakyPod, tmp_path: Path
) -> None:
    routes = routes_with_busy_primary(
        tmp_path / "routes.yaml", busy_pod.address, f"127.0.0.1:{capability.port}", False
    )
    server = await orchestrator_with(routes)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            request = pb.ClassifyRequest(text=STRIKER)
            await stub.Classify(request, timeout=DEADLINE_SECONDS)  # learns the report
            started = time.perf_counter()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Classify(request, timeout=DEADLINE_SECONDS)
            took = time.perf_counter() - started
    finally:
        await server.stop(grace_seconds=0)
    error = refused.value
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = error_info(error)
    assert info.reason == "DEADLINE_UNREACHABLE"
    assert info.metadata["backend"] == "busy"
    assert info.metadata["x-request-id"]
    assert info.metadata["x-trace-id"]
    assert retry_delay_seconds(error) > 0
    # The reported 800 ms wait (plus 5 ms of service), counted down by the time since
    # the report arrived: on a loaded machine that can be tens of milliseconds.
    reported = re.search(r"reports a wait of about (\d+) ms", error.details() or "")
    assert reported is not None, error.details()
    assert 500 < int(reported.group(1)) <= 805
    # Refused before any work, not at the deadline (generous for a shared machine).
    assert took < DEADLINE_SECONDS / 2
    assert busy_pod.calls == 1


async def test_adaptive_limit_refuses_the_excess_at_once_with_a_retry_hint(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\n"
        "backends:\n"
        f"  topic-minilm: {{model: topic-minilm, targets: ['127.0.0.1:{capability.port}']}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: topic-minilm\n"
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, concurrency_min_limit=2, concurrency_max_limit=2),
        registry=CollectorRegistry(),
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            calls = [stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10) for _ in range(6)]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await server.stop(grace_seconds=0)
    answered = [outcome for outcome in outcomes if isinstance(outcome, pb.ClassifyResponse)]
    refused = [outcome for outcome in outcomes if isinstance(outcome, grpc.aio.AioRpcError)]
    assert (len(answered), len(refused)) == (2, 4)
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_info(error).reason == "CONCURRENCY_LIMITED"
        assert retry_delay_seconds(error) > 0
    assert metric_sum(server.registry, CONCURRENCY_LIMITED_TOTAL, backend="topic-minilm") == 4


@pytest.mark.parametrize(
    ("deadline_seconds", "cancel_after_seconds", "engages", "as_batch"),
    [
        # A caller that hangs up with most of its time left (a hedged call's loser, a
        # user's Ctrl-C) says nothing about the backend.
        (10.0, 0.3, False, False),
        # Calls whose deadlines pass while the backend holds them are overload.
        (0.3, None, True, False),
        # So are a ClassifyBatch's items, though the call's answer is due before its
        # deadline: cancelled as it went, they read as callers gone early.
        (0.3, None, True, True),
    ],
)
async def test_only_calls_that_run_out_of_time_engage_the_adaptive_limit(
    capability: CapabilityServer,
    tmp_path: Path,
    deadline_seconds: float,
    cancel_after_seconds: float | None,
    engages: bool,
    as_batch: bool,
) -> None:
    pod = FlakyPod(capability.port, failing=False)
    await pod.start()
    pod.answering.clear()  # the pod holds every call
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\n"
        "backends:\n"
        f"  stalled: {{model: topic-minilm, targets: ['{pod.address}']}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: stalled\n"
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, concurrency_min_limit=2),
        registry=CollectorRegistry(),
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            if as_batch:
                items = [pb.ClassifyRequest(text=STRIKER) for _ in range(STALLED_CALLS)]
                answer = await stub.ClassifyBatch(
                    pb.ClassifyBatchRequest(items=items), timeout=deadline_seconds
                )
                assert all(result.HasField("error") for result in answer.results), answer
            else:
                calls = [
                    stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=deadline_seconds)
                    for _ in range(STALLED_CALLS)
                ]
                if cancel_after_seconds is not None:
                    await asyncio.sleep(cancel_after_seconds)
                    for call in calls:
                        call.cancel()
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
                assert all(isinstance(outcome, BaseException) for outcome in outcomes), outcomes
            # The orchestrator's handlers see the callers go (cancelled, or out of time).
            await wait_until(
                lambda: metric_sum(server.registry, BACKEND_IN_FLIGHT, backend="stalled") == 0
            )
            limit = metric_sum(server.registry, BACKEND_CONCURRENCY_LIMIT, backend="stalled")
    finally:
        await server.stop(grace_seconds=0)
        pod.answering.set()
        await pod.stop()
    assert (limit < DEFAULT_CONCURRENCY.max_limit) is engages, limit


async def test_a_full_capability_queue_keeps_its_reason_in_retries_fallbacks_and_answers(
    capability: CapabilityServer, start_capability: StartCapability, tmp_path: Path
) -> None:
    """A capability whose queue is full answers RESOURCE_EXHAUSTED with QUEUE_FULL;
    one layer up that stays QUEUE_FULL (it was counted as a plain OVERLOADED, so the
    dashboards could not tell a full queue from any other overload)."""
    full = await start_capability(models=("topic-minilm",), queue_capacity=1, max_batch_size=1)
    spare = f"127.0.0.1:{capability.port}"
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\n"
        "backends:\n"
        f"  full: {{model: topic-minilm, targets: ['127.0.0.1:{full.port}']}}\n"
        f"  spare: {{model: topic-static, targets: ['{spare}']}}\n"
        "routes:\n"
        "  - name: spilling\n"
        "    match: {header: {name: x-route, values: [spilling]}}\n"
        "    backend: full\n"
        "    fallback: [spare]\n"
        "    retry: {max_attempts: 2, initial_backoff: 1ms, max_backoff: 2ms}\n"
        "  - name: default\n"
        "    backend: full\n"
        "    retry: {max_attempts: 1}\n"
    )
    server = await orchestrator_with(routes)
    registry = server.registry
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{full.port}") as beside,
        ):
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            async with device_occupied(full.pool.workers[0]):
                # Another client's text takes the queue's one place (and waits for the
                # held device); every text after it is refused by the queue. (The
                # orchestrator keeps its own calls within the queue's room.)
                held = asyncio.ensure_future(
                    classify_service_pb2_grpc.ClassifyServiceStub(beside).Classify(
                        pb.ClassifyRequest(text=STRIKER), timeout=10
                    )
                )
                await wait_until(
                    lambda: len(full.pool.workers[0].replicas["topic-minilm"].queue) == 1
                )
                refused = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=5))
                # The refusal brought the replica's load report: the held text queued.
                pool = server.dispatcher.state.upstream.pool(server.routes.backends["full"])
                (load,) = pool.loads.values()
                assert load.queue_depth == 1
                spilled = await stub.Classify(
                    pb.ClassifyRequest(text=STRIKER),
                    metadata=(("x-route", "spilling"),),
                    timeout=5,
                )
            assert (await held).model.name == "topic-minilm"
    finally:
        await server.stop(grace_seconds=0)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(refused)
    assert info.reason == "QUEUE_FULL"
    assert (info.metadata["backend"], info.metadata["upstream_code"]) == (
        "full",
        "RESOURCE_EXHAUSTED",
    )
    assert info.metadata["x-request-id"]
    assert info.metadata["x-trace-id"]
    assert retry_delay_seconds(refused) > 0
    assert (spilled.fallback, spilled.model.name) == (True, "topic-static")
    fallback = {"route": "spilling", "from": "full", "to": "spare"}
    assert metric_sum(registry, MODEL_FALLBACK_TOTAL, **fallback, reason="QUEUE_FULL") == 1
    assert metric_sum(registry, MODEL_FALLBACK_TOTAL, **fallback, reason="OVERLOADED") == 0
    retried = {"route": "spilling", "backend": "full"}
    assert metric_sum(registry, UPSTREAM_RETRIES_TOTAL, **retried, reason="QUEUE_FULL") == 1


def unknown_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field `number` no message of the contract names, as bytes."""

    def varint(value: int) -> bytes:
        out = b""
        while value > 0x7F:
            out += bytes((value & 0x7F | 0x80,))
            value >>= 7
        return out + bytes((value,))

    return varint(number << 3 | 2) + varint(len(payload)) + payload


async def test_unknown_fields_are_not_sent_upstream_and_a_size_refusal_is_no_overload(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A pod whose gRPC takes messages of 4 KiB at most. A short text padded with 100 KB
    of an unknown field was sent on whole (merged, such requests passed the capability's
    limit and other tenants' calls were refused as overloaded); it is answered now. A
    text of 5,000 characters the pod's gRPC refuses itself: no load of the backend's,
    so INTERNAL, neither retried nor shrinking the backend's concurrency limit."""
    pod = FlakyPod(capability.port, failing=False, max_receive_bytes=4096)
    await pod.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\n"
        f"backends:\n  small: {{model: topic-minilm, targets: ['{pod.address}']}}\n"
        "routes:\n  - {name: default, backend: small, retry: {max_attempts: 3}}\n"
    )
    server = await orchestrator_with(routes)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            classify: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                "/ai.classify.v1.ClassifyService/Classify"
            )
            padded = pb.ClassifyRequest(text=STRIKER).SerializeToString()
            padded += unknown_field(1000, b"x" * 100_000)
            answer = pb.ClassifyResponse.FromString(await classify(padded, timeout=10))
            too_large = pb.ClassifyRequest(text="word " * 1_000).SerializeToString()
            refused = await refusal(classify(too_large, timeout=10))
        limit = metric_sum(server.registry, BACKEND_CONCURRENCY_LIMIT, backend="small")
    finally:
        await server.stop(grace_seconds=0)
        await pod.stop()
    assert answer.labels[0].name == "sports"
    assert refused.code() == grpc.StatusCode.INTERNAL
    assert metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL) == 0
    assert limit == DEFAULT_CONCURRENCY.max_limit

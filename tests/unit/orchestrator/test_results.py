"""Time budgets: PROCESSING, then GetResult with the real result; the store's bounds."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.errors import ModelUnavailable, ResultNotFound
from orchestrator.metrics import PROCESSING_TOTAL
from orchestrator.results import LocalResultStore
from orchestrator.security import gate
from orchestrator.security.keys import Caller
from orchestrator.server import OrchestratorServer
from tests.conftest import (
    STRIKER,
    StartCapability,
    StartOrchestrator,
    metric_sum,
    orchestrator_settings,
    wait_until,
)
from tests.flaky_pod import FlakyPod
from tests.status_details import error_info, error_reason, refusal, unpack
from tests.unit.capability.test_serving import device_occupied

PROCESSING, DONE = pb.RESULT_STATUS_PROCESSING, pb.RESULT_STATUS_DONE
SHARES = "Shares fell sharply after the bank cut its profit forecast"


async def test_store_keeps_pending_then_final_results_within_capacity_and_ttl() -> None:
    now = [0.0]
    store = LocalResultStore(capacity=2, ttl_seconds=10, clock=lambda: now[0])
    pending = pb.ClassifyResponse(request_id="a", status=pb.RESULT_STATUS_PROCESSING)
    held_a = await store.hold("a", pending)
    assert held_a is not None
    assert (await store.get("a")).status == pb.RESULT_STATUS_PROCESSING
    done = pb.ClassifyResponse(request_id="a", status=pb.RESULT_STATUS_DONE)
    await store.finish("a", held_a, response=done)
    assert (await store.get("a")).status == pb.RESULT_STATUS_DONE

    held_b = await store.hold("b", pending)
    assert held_b is not None
    await store.finish("b", held_b, error=ModelUnavailable("backend down"))
    with pytest.raises(ModelUnavailable):
        await store.get("b")

    await store.hold("c", pending)  # over capacity: the oldest, "a", goes
    assert store.dropped == 1
    with pytest.raises(ResultNotFound):
        await store.get("a")
    now[0] = 10.0  # "b" and "c" expire
    with pytest.raises(ResultNotFound):
        await store.get("c")
    await store.finish("never-held", "token", response=pending)  # nobody waits for it
    with pytest.raises(ResultNotFound):
        await store.get("never-held")


async def test_a_later_call_with_the_same_request_id_keeps_its_place_from_the_earlier() -> None:
    """The earlier call's outcome, ready while the later one still runs, wrote into the
    later one's place: a poll for the later call got the earlier call's labels."""
    store = LocalResultStore(capacity=10, ttl_seconds=10)
    earlier = await store.hold("r", pb.ClassifyResponse(trace_id="1", status=PROCESSING))
    later = await store.hold("r", pb.ClassifyResponse(trace_id="2", status=PROCESSING))
    assert earlier is not None
    assert later is not None
    assert earlier != later
    await store.finish("r", earlier, response=pb.ClassifyResponse(trace_id="1", status=DONE))
    assert ((await store.get("r")).trace_id, (await store.get("r")).status) == ("2", PROCESSING)
    await store.finish("r", later, response=pb.ClassifyResponse(trace_id="2", status=DONE))
    assert ((await store.get("r")).trace_id, (await store.get("r")).status) == ("2", DONE)


@contextlib.contextmanager
def as_tenant(tenant: str) -> Iterator[None]:
    """Run the block as a call of `tenant` would (the gate binds the caller so)."""
    token = gate._caller.set(Caller(key_id=tenant, tenant=tenant, role="user"))
    try:
        yield
    finally:
        gate._caller.reset(token)


async def test_past_the_capacity_an_expired_entry_goes_first_then_the_largest_tenants_oldest() -> (
    None
):
    now = [0.0]
    store = LocalResultStore(capacity=3, ttl_seconds=10, clock=lambda: now[0])
    pending = pb.ClassifyResponse(status=pb.RESULT_STATUS_PROCESSING)
    with as_tenant("zenith"):
        await store.hold("z-old", pending)  # expires at 10
    now[0] = 5.0
    with as_tenant("acme"):
        await store.hold("a-1", pending)
        await store.hold("a-2", pending)
    now[0] = 11.0
    with as_tenant("acme"):
        await store.hold("a-3", pending)  # z-old has expired: let go, so nothing is dropped
    assert store.dropped == 0
    assert (store.held_by("acme"), store.held_by("zenith")) == (3, 0)
    with as_tenant("zenith"):
        await store.hold("z-1", pending)  # acme holds the most: its oldest goes
        await store.hold("z-2", pending)  # acme 2, zenith 2: acme still held first
        await store.hold("z-3", pending)  # zenith's own oldest goes
        with pytest.raises(ResultNotFound):
            await store.get("z-1")
    with as_tenant("acme"):
        for gone in ("a-1", "a-2"):
            with pytest.raises(ResultNotFound):
                await store.get(gone)
        assert (await store.get("a-3")).status == pb.RESULT_STATUS_PROCESSING
    assert (store.held_by("acme"), store.held_by("zenith"), len(store)) == (1, 2, 3)
    assert store.dropped == 3  # z-old expired: let go, not dropped


async def start_orchestrator(
    capability: CapabilityServer, tmp_path: Path, budget: str = "200ms"
) -> OrchestratorServer:
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"""version: 1
backends:
  minilm: {{model: topic-minilm, targets: ["127.0.0.1:{capability.port}"], timeout: 30s}}
routes:
  - name: default
    backend: minilm
    budget: {budget}
"""
    )
    server = OrchestratorServer(
        orchestrator_settings(port=0, metrics_port=-1, routes_file=routes, routes_poll_seconds=0),
        registry=CollectorRegistry(),
    )
    await server.start()
    return server


async def poll_until_done(
    stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub, request_id: str
) -> pb.ClassifyResponse:
    answers: list[pb.ClassifyResponse] = []

    async def done() -> bool:
        answers.append(await stub.GetResult(pb.GetResultRequest(request_id=request_id)))
        return answers[-1].status == pb.RESULT_STATUS_DONE

    await wait_until(done, f"the result of {request_id}", limit_seconds=10)
    return answers[-1]


async def test_budget_exceeded_answers_processing_then_get_result_returns_the_result(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    server = await start_orchestrator(capability, tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            async with device_occupied(capability.pool.workers[0]):
                first = await stub.Classify(pb.ClassifyRequest(text=STRIKER, request_id="slow-1"))
                assert first.status == pb.RESULT_STATUS_PROCESSING
                assert (first.request_id, first.route, len(first.labels)) == (
                    "slow-1",
                    "default",
                    0,
                )
                polled = await stub.GetResult(pb.GetResultRequest(request_id="slow-1"))
                assert polled.status == pb.RESULT_STATUS_PROCESSING
            done = await poll_until_done(stub, "slow-1")
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.GetResult(pb.GetResultRequest(request_id="never-sent"))
    finally:
        await server.stop(grace_seconds=0)
    assert done.labels[0].name == "sports"
    assert (done.request_id, done.trace_id) == ("slow-1", first.trace_id)
    assert metric_sum(server.registry, PROCESSING_TOTAL, route="default") == 1
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason(unknown.value) == "RESULT_NOT_FOUND"


async def batch_item_due_before_its_budget(
    server: OrchestratorServer, capability: CapabilityServer, request_id: str
) -> pb.ClassifyBatchResult:
    """The answer to a ClassifyBatch of one item whose 1 s deadline comes before its
    route's budget (2 s), while the device is held: the call's answer is due first."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(capability.pool.workers[0]):
            item = pb.ClassifyRequest(text=STRIKER, request_id=request_id)
            answer = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=[item]), timeout=1)
    (result,) = answer.results
    assert result.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    return result


async def test_a_batch_item_whose_deadline_comes_first_is_kept_as_a_single_call_is(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A deadline shorter than the route's budget: a single call answers
    DEADLINE_EXCEEDED with `result_kept`, and GetResult has the result later. A batch
    item got neither mark nor count: the call's answer, due before the item's deadline
    (less the time to answer its items), cancelled it first, and a client following
    the contract never polled for the result that was kept all the same."""
    server = await start_orchestrator(capability, tmp_path, budget="2s")
    try:
        result = await batch_item_due_before_its_budget(server, capability, "kept-1")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            done = await poll_until_done(stub, "kept-1")
    finally:
        await server.stop(grace_seconds=0)
    (info,) = unpack(result.error, error_details_pb2.ErrorInfo)
    assert info.metadata["result_kept"] == "true"
    assert done.labels[0].name == "sports"


async def test_a_batch_item_promises_no_result_its_store_could_not_hold(
    capability: CapabilityServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a single call: when the store cannot hold a place (the shared store down:
    `hold` answers None), nothing is kept, and the item says only that the call's
    answer came due, not `result_kept` (a poll would find nothing)."""
    server = await start_orchestrator(capability, tmp_path, budget="2s")

    async def store_down(request_id: str, pending: pb.ClassifyResponse) -> None:
        return None

    monkeypatch.setattr(server.dispatcher.results, "hold", store_down)
    try:
        result = await batch_item_due_before_its_budget(server, capability, "unkept-1")
    finally:
        await server.stop(grace_seconds=0)
    (info,) = unpack(result.error, error_details_pb2.ErrorInfo)
    assert "result_kept" not in info.metadata


async def test_a_poll_for_a_reused_request_id_never_gets_the_earlier_calls_result(
    capability: CapabilityServer,
    start_capability: StartCapability,
    orchestrator_with: StartOrchestrator,
) -> None:
    """Two calls with one request ID, both PROCESSING, each on a replica of its own:
    the earlier one's result, ready first, was what polls for the later one got."""
    other = await start_capability(models=("topic-minilm",))
    server = await orchestrator_with(
        "version: 1\n"
        "backends:\n"
        f"  one: {{model: topic-minilm, targets: ['127.0.0.1:{capability.port}'], timeout: 30s}}\n"
        f"  two: {{model: topic-minilm, targets: ['127.0.0.1:{other.port}'], timeout: 30s}}\n"
        "routes:\n"
        "  - name: second\n"
        "    match: {header: {name: x-route, values: [two]}}\n"
        "    backend: two\n"
        "    budget: 100ms\n"
        "  - name: default\n"
        "    backend: one\n"
        "    budget: 100ms\n"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(other.pool.workers[0]):
            async with device_occupied(capability.pool.workers[0]):
                earlier = await stub.Classify(
                    pb.ClassifyRequest(text=SHARES, request_id="reused-1")
                )
                later = await stub.Classify(
                    pb.ClassifyRequest(text=STRIKER, request_id="reused-1"),
                    metadata=(("x-route", "two"),),
                )
            # The earlier call's outcome has been through the store (its storing task
            # is done); the later one's is still held.
            storing = server.dispatcher._storing
            await wait_until(lambda: len(storing) == 1, "the earlier call's outcome stored")
            polled = await stub.GetResult(pb.GetResultRequest(request_id="reused-1"))
        done = await poll_until_done(stub, "reused-1")
    assert (earlier.status, later.status) == (PROCESSING, PROCESSING)
    assert (polled.status, polled.trace_id) == (PROCESSING, later.trace_id)
    assert (done.trace_id, done.labels[0].name) == (later.trace_id, "sports")


async def test_client_deadline_first_is_deadline_exceeded_but_the_result_is_kept(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    server = await start_orchestrator(capability, tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            async with device_occupied(capability.pool.workers[0]):
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await stub.Classify(
                        pb.ClassifyRequest(text=STRIKER, request_id="late-1"), timeout=0.1
                    )
                assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            done = await poll_until_done(stub, "late-1")
    finally:
        await server.stop(grace_seconds=0)
    assert done.labels[0].name == "sports"


async def test_expired_results_are_let_go_when_another_is_held_not_only_when_polled() -> None:
    now = [0.0]
    store = LocalResultStore(capacity=100, ttl_seconds=10, clock=lambda: now[0])
    pending = pb.ClassifyResponse(status=pb.RESULT_STATUS_PROCESSING)
    for request_id in ("a", "b"):
        await store.hold(request_id, pending)
    now[0] = 5.0
    await store.hold("c", pending)
    now[0] = 11.0  # "a" and "b" have expired, "c" has not
    await store.hold("d", pending)
    assert len(store) == 2
    assert store.dropped == 0


async def test_a_stored_error_keeps_no_traceback_and_so_no_request() -> None:
    """The frames of a traceback hold the call's request, its text up to 100,000
    characters, for as long as the result is kept."""
    store = LocalResultStore(capacity=10, ttl_seconds=10)
    held = await store.hold("r", pb.ClassifyResponse(status=pb.RESULT_STATUS_PROCESSING))
    assert held is not None

    def fail(request: pb.ClassifyRequest) -> None:
        try:
            raise KeyError(request.text)
        except KeyError as cause:
            raise ModelUnavailable("backend down") from cause

    try:
        fail(pb.ClassifyRequest(text="x" * 100_000))
    except ModelUnavailable as error:
        await store.finish("r", held, error=error)
    with pytest.raises(ModelUnavailable) as stored:
        await store.get("r")
    # Raised again by get(): only get()'s own frame is on it now, and nothing before.
    assert stored.value.__cause__ is None
    assert stored.value.__context__ is None
    frames = []
    traceback = stored.value.__traceback__
    while traceback is not None:
        frames.append(traceback.tb_frame.f_code.co_name)
        traceback = traceback.tb_next
    assert "fail" not in frames


async def test_a_failed_result_names_the_trace_it_failed_in(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A poll is a call in a trace of its own; the stored failure's ErrorInfo says which
    trace the work ran in (`result_trace_id`), as a DONE result's trace_id does."""
    pod = FlakyPod(capability.port, failing=True)
    pod.answering.clear()  # the pod holds the call past the route's budget, then fails it
    await pod.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\n"
        f"backends:\n  pod: {{model: topic-minilm, targets: ['{pod.address}']}}\n"
        "routes:\n  - name: default\n    backend: pod\n    budget: 100ms\n"
        "    retry: {max_attempts: 1}\n"
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, routes_poll_seconds=0),
        registry=CollectorRegistry(),
    )
    await server.start()
    poll = pb.GetResultRequest(request_id="fails-1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            first = await stub.Classify(pb.ClassifyRequest(text=STRIKER, request_id="fails-1"))
            pod.answering.set()

            async def failed() -> bool:
                try:
                    await stub.GetResult(poll)
                except grpc.aio.AioRpcError:
                    return True
                return False

            await wait_until(failed, "the stored failure", limit_seconds=10)
            stored = await refusal(stub.GetResult(poll))
    finally:
        await server.stop(grace_seconds=0)
        await pod.stop()
    assert first.status == pb.RESULT_STATUS_PROCESSING
    assert stored.code() == grpc.StatusCode.UNAVAILABLE
    info = error_info(stored)
    assert info.metadata["result_trace_id"] == first.trace_id
    assert info.metadata["x-request-id"] == "fails-1"
    assert info.metadata["x-trace-id"] != first.trace_id  # the poll's own


async def test_an_unsampled_processing_answer_leaves_an_exemplar_for_its_kept_trace(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A call answered PROCESSING keeps its trace whatever the sampling (a time-out):
    the latency of its answer, the slowest of the route's, still linked to no trace."""
    trace_id = uuid.uuid4().hex
    unsampled = (("traceparent", f"00-{trace_id}-00f067aa0ba902b7-00"),)
    server = await start_orchestrator(capability, tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            async with device_occupied(capability.pool.workers[0]):
                answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER), metadata=unsampled)
    finally:
        await server.stop(grace_seconds=0)
    assert (answer.status, answer.trace_id) == (pb.RESULT_STATUS_PROCESSING, trace_id)
    # prometheus_client's OpenMetrics writer has no type hints.
    exposition = generate_openmetrics(server.registry).decode()  # type: ignore[no-untyped-call]
    assert any(
        f'# {{trace_id="{trace_id}"}}' in line and 'code="PROCESSING"' in line
        for line in exposition.splitlines()
    )

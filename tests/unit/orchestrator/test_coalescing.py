"""Concurrent calls bound for one replica travel as one upstream ClassifyBatch call,
through a real orchestrator and a real capability server: fewer RPCs, the same answers,
no added wait at one client, per-request deadlines and traces."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.metrics import ADMISSIONS_REFUSED_TOTAL, MODEL_TEXTS_TOTAL
from capability.server import CapabilityServer
from capability.workers import DeviceWorker
from classify_common.errors import DeadlineExpired, DeadlineUnreachable, ModelFault, ServiceError
from classify_common.nodes import NODE_NAMES
from orchestrator.metrics import (
    DEADLINE_UNREACHABLE_TOTAL,
    UNREACHABLE_CALL_TIME,
    UNREACHABLE_REPORTED_WAIT,
    UPSTREAM_CALL_ITEMS,
    UPSTREAM_ITEMS_EXPIRED_TOTAL,
)
from orchestrator.policy import OutlierSettings
from orchestrator.routing import Backend
from orchestrator.server import OrchestratorServer
from orchestrator.upstream.call_time import CallTimeModel, TripTime
from orchestrator.upstream.coalescer import (
    UNANSWERED_AFTER_SECONDS,
    UPSTREAM_BATCH_SPAN_NAME,
    CoalescingSettings,
    ReplicaCoalescer,
)
from orchestrator.upstream.load import read_load_report
from orchestrator.upstream.pool import BackendPool
from tests.conftest import (
    STRIKER,
    StartCapability,
    metric_sum,
    orchestrator_for,
    orchestrator_settings,
    static_routes,
    wait_until,
)
from tests.flaky_pod import FlakyPod
from tests.status_details import error_reason, refusal
from tests.unit.capability.test_serving import device_occupied
from tests.unit.test_lifecycle_trace import CLASSIFY_SPAN, settled_trace

TEXTS = [
    STRIKER,
    "Shares fell sharply after the bank cut its profit forecast",
    "A new telescope found water on a distant planet",
    "The government announced talks to end the border dispute",
]


def upstream_calls(server: OrchestratorServer) -> tuple[float, float]:
    """(upstream calls made, requests they carried) so far."""
    registry = server.registry
    return (
        metric_sum(registry, UPSTREAM_CALL_ITEMS + "_count"),
        metric_sum(registry, UPSTREAM_CALL_ITEMS + "_sum"),
    )


def coalescer_on(
    channel: grpc.aio.Channel,
    capability: CapabilityServer,
    settings: CoalescingSettings | None = None,
    on_expired: Callable[[], None] = lambda: None,
    on_unreachable: Callable[[str], None] = lambda cause: None,
    predicted_wait: Callable[[], float] = lambda: 0.0,
    replica_batch_size: Callable[[], int] = lambda: 0,
    replica_queue_capacity: Callable[[], int] = lambda: 0,
) -> ReplicaCoalescer:
    """A coalescer in front of the real capability server, as a backend pool makes one."""
    return ReplicaCoalescer(
        channel,
        backend="minilm",
        target=f"127.0.0.1:{capability.port}",
        credentials=(),
        settings=settings or CoalescingSettings(),
        on_expired=on_expired,
        on_unreachable=on_unreachable,
        # Read as a backend pool reads it; the coalescer learns its calls' trips from it.
        on_load=lambda raw: read_load_report(raw, asyncio.get_running_loop().time()),
        predicted_wait=predicted_wait,
        replica_batch_size=replica_batch_size,
        replica_queue_capacity=replica_queue_capacity,
    )


def texts_computed(capability: CapabilityServer) -> float:
    return metric_sum(capability.registry, MODEL_TEXTS_TOTAL)


@pytest_asyncio.fixture
async def one_call_at_a_time(
    capability: CapabilityServer, tmp_path: Path
) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator that keeps one call in flight per replica, so whatever arrives
    while it runs must gather into the next."""
    async with orchestrator_for(capability, tmp_path, upstream_calls_in_flight=1) as server:
        yield server


async def test_concurrent_calls_share_upstream_rpcs_and_keep_their_answers(
    orchestrator: OrchestratorServer,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        alone = {t: await stub.Classify(pb.ClassifyRequest(text=t), timeout=30) for t in TEXTS}
        calls_before, items_before = upstream_calls(orchestrator)

        async def caller(index: int) -> list[tuple[str, pb.ClassifyResponse]]:
            answers = []
            for round_ in range(4):
                text = TEXTS[(index + round_) % len(TEXTS)]
                answers.append((text, await stub.Classify(pb.ClassifyRequest(text=text))))
            return answers

        answers = [a for batch in await asyncio.gather(*map(caller, range(32))) for a in batch]

    calls, items = upstream_calls(orchestrator)
    assert items - items_before == 128  # every request went upstream exactly once
    assert calls - calls_before < 128  # ... in fewer calls than requests
    for text, answer in answers:
        expected = alone[text]
        assert [label.name for label in answer.labels] == [label.name for label in expected.labels]
        assert [label.score for label in answer.labels] == pytest.approx(
            [label.score for label in expected.labels], abs=1e-5
        )
    assert len({answer.request_id for _, answer in answers}) == 128


async def test_a_lone_call_goes_upstream_in_the_next_loop_turn_without_a_timer(
    capability: CapabilityServer,
) -> None:
    """At one client nothing waits: the item is on the wire after a few turns of the
    event loop (microseconds), which any timer-based gathering window would fail."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(channel, capability)
        request = pb.ClassifyRequest(text=STRIKER, model="topic-minilm", request_id="lone")
        call = asyncio.ensure_future(coalescer.classify(request, seconds=30, trace_metadata=()))
        for _ in range(3):
            await asyncio.sleep(0)
        assert (coalescer.waiting, coalescer.in_flight) == (0, 1), "the lone item was held back"
        assert (await call).labels[0].name == "sports"


async def test_one_client_sends_each_call_alone(orchestrator: OrchestratorServer) -> None:
    calls_before, items_before = upstream_calls(orchestrator)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        for text in TEXTS:
            await stub.Classify(pb.ClassifyRequest(text=text), timeout=30)
    calls, items = upstream_calls(orchestrator)
    assert (calls - calls_before, items - items_before) == (len(TEXTS), len(TEXTS))


@pytest.mark.parametrize(
    ("max_items", "replica_batch_size"),
    [(4, 0), (128, 4), (4, 64)],
    ids=["max-items-when-the-replica-has-not-said", "the-replica-batch", "at-most-max-items"],
)
async def test_beside_a_call_in_flight_only_a_full_call_leaves(
    capability: CapabilityServer, max_items: int, replica_batch_size: int
) -> None:
    """Two calls may be in flight, but while one is, what gathers waits for it unless
    it fills a call (here 4 items: one batch on the replica as reported, at most
    max_items): three items wait, the fourth takes all four out."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(
            channel,
            capability,
            CoalescingSettings(max_items=max_items, max_in_flight=2),
            replica_batch_size=lambda: replica_batch_size,
        )

        def classify(request_id: str) -> asyncio.Future[pb.ClassifyResponse]:
            request = pb.ClassifyRequest(text=STRIKER, model="topic-minilm", request_id=request_id)
            return asyncio.ensure_future(coalescer.classify(request, seconds=30, trace_metadata=()))

        async def settled() -> tuple[int, int]:
            for _ in range(5):  # a call is sent within a few loop turns, or not at all
                await asyncio.sleep(0)
            return coalescer.waiting, coalescer.in_flight

        async with device_occupied(capability.pool.workers[0]):
            calls = [classify("first")]
            await wait_until(lambda: coalescer.in_flight == 1)
            calls += [classify(f"gathered-{index}") for index in range(3)]
            assert await settled() == (3, 1), "a partial call left beside the one in flight"
            calls.append(classify("fourth"))
            assert await settled() == (0, 2), "a full call waited for the one in flight"
        answers = await asyncio.gather(*calls)
    assert [answer.request_id for answer in answers] == [
        "first",
        "gathered-0",
        "gathered-1",
        "gathered-2",
        "fourth",
    ]


async def test_interactive_items_do_not_gather_behind_calls_of_batch_items_alone(
    capability: CapabilityServer,
) -> None:
    """One call in flight at most, and it carries bulk work sent as PRIORITY_BATCH:
    interactive items leave at once in a call of their own (one beyond the limit) and
    are computed first; another batch item gathers, as does an interactive item once
    an interactive call is in flight."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(channel, capability, CoalescingSettings(max_in_flight=1))
        finished: list[str] = []

        def classify(request_id: str, priority: pb.Priority.ValueType) -> asyncio.Future[None]:
            request = pb.ClassifyRequest(
                text=STRIKER, model="topic-minilm", request_id=request_id, priority=priority
            )

            async def call() -> None:
                await coalescer.classify(request, seconds=30, trace_metadata=())
                finished.append(request_id)

            return asyncio.ensure_future(call())

        async def settled() -> tuple[int, int]:
            for _ in range(5):  # a call is sent within a few loop turns, or not at all
                await asyncio.sleep(0)
            return coalescer.waiting, coalescer.in_flight

        async with device_occupied(capability.pool.workers[0]):
            calls = [classify(f"bulk-{index}", pb.PRIORITY_BATCH) for index in range(4)]
            await wait_until(lambda: coalescer.in_flight == 1)
            calls.append(classify("more-bulk", pb.PRIORITY_BATCH))
            assert await settled() == (1, 1), "a batch item left beside the batch call"
            calls.append(classify("interactive", pb.PRIORITY_INTERACTIVE))
            assert await settled() == (1, 2), "the interactive item gathered behind bulk work"
            calls.append(classify("interactive-2", pb.PRIORITY_UNSPECIFIED))
            assert await settled() == (2, 2), "a second interactive call went beside the first"
        await asyncio.gather(*calls)
    # It reached the capability while the more bulk work still gathered here.
    assert finished.index("interactive") < finished.index("more-bulk")


async def test_an_item_whose_time_runs_out_while_gathering_is_never_sent(
    capability: CapabilityServer,
) -> None:
    """One call in flight at a time: the second item waits behind the first, runs out of
    time there, and is answered DEADLINE_EXCEEDED then, while the first is still held,
    without reaching the model."""
    expired: list[int] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(
            channel, capability, CoalescingSettings(max_in_flight=1), lambda: expired.append(1)
        )
        computed_before = texts_computed(capability)
        worker = capability.pool.workers[0]
        first_request = pb.ClassifyRequest(text=STRIKER, model="topic-minilm", request_id="a")
        late_request = pb.ClassifyRequest(text=STRIKER, model="topic-minilm", request_id="b")
        async with device_occupied(worker):
            first = asyncio.ensure_future(
                coalescer.classify(first_request, seconds=30, trace_metadata=())
            )
            await wait_until(lambda: coalescer.in_flight == 1)
            late = asyncio.ensure_future(
                coalescer.classify(late_request, seconds=0.05, trace_metadata=())
            )
            # The point: the late item's 50 ms pass while the device is held.
            with pytest.raises(DeadlineExpired) as expired_late:
                await late
            assert str(expired_late.value) == (
                "the deadline passed before the backend could be called"
            )
            assert (coalescer.waiting, coalescer.in_flight) == (0, 1)
        assert (await first).request_id == "a"
    assert expired == [1]
    assert texts_computed(capability) - computed_before == 1


@contextlib.asynccontextmanager
async def front_door_on(
    routes: str, directory: Path, **upstream: int
) -> AsyncIterator[tuple[OrchestratorServer, classify_service_pb2_grpc.ClassifyServiceAsyncStub]]:
    """An orchestrator of its own on `routes` (routes.yaml's text), with the `upstream_*`
    coalescing settings given, and a stub for it; stopped when the block ends."""
    path = directory / "routes.yaml"
    path.write_text(routes)
    server = OrchestratorServer(
        orchestrator_settings(routes_file=path, **upstream), registry=CollectorRegistry()
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, classify_service_pb2_grpc.ClassifyServiceStub(channel)
    finally:
        await server.stop(grace_seconds=0)


async def test_batch_items_gather_for_as_long_as_their_caller_waits_and_each_call_gets_its_timeout(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A ClassifyBatch whose calls, one at a time, take longer altogether than the
    backend's 300 ms timeout, each well within it: every item is answered by the
    primary. Counted from each item's arrival, the timeout also bounded its gathering,
    and the items behind the first calls went to the fallback (with a minute left on
    the caller's deadline)."""
    pod = FlakyPod(capability.port, failing=False)
    pod.delay_seconds = 0.05  # 25 calls one after another: 1.25 s at the least
    await pod.start()
    routes = (
        "version: 1\n"
        "backends:\n"
        f"  slow: {{model: topic-static, targets: ['{pod.address}'], timeout: 300ms}}\n"
        f"  spare: {{model: topic-minilm, targets: ['127.0.0.1:{capability.port}']}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: slow\n"
        "    fallback: [spare]\n"
    )
    try:
        async with front_door_on(
            routes, tmp_path, upstream_batch_max_items=8, upstream_calls_in_flight=1
        ) as (_, stub):
            items = [pb.ClassifyRequest(text=f"{STRIKER} ({n})") for n in range(200)]
            started = asyncio.get_running_loop().time()
            answer = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), timeout=60)
            took = asyncio.get_running_loop().time() - started
    finally:
        await pod.stop()
    assert took >= 1.25
    failed = [result.error.message for result in answer.results if result.HasField("error")]
    assert failed == []
    models = collections.Counter(
        (result.response.model.name, result.response.fallback) for result in answer.results
    )
    assert models == {("topic-static", False): 200}
    assert pod.calls >= 25  # at most 8 items a call, one call at a time


async def test_a_call_that_runs_out_of_time_while_gathering_is_counted_and_never_computed(
    one_call_at_a_time: OrchestratorServer, capability: CapabilityServer
) -> None:
    """The same through a real orchestrator: its caller gets DEADLINE_EXCEEDED, the
    backend's expired-unsent counter goes up by one, and the model never sees it."""
    server = one_call_at_a_time
    expired_before = metric_sum(
        server.registry, UPSTREAM_ITEMS_EXPIRED_TOTAL, backend="topic-minilm"
    )
    calls_before, items_before = upstream_calls(server)
    computed_before = texts_computed(capability)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(capability.pool.workers[0]):
            first = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
            )
            await wait_until(lambda: upstream_calls(server)[1] - items_before == 1)
            late = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=TEXTS[1]), timeout=0.5)
            )
            # It gathers behind the held call (not refused as it arrives) ...
            (pool,) = server.dispatcher.state.upstream.pools()
            (coalescer,) = pool.coalescers.values()
            await wait_until(lambda: coalescer.waiting == 1, "the second call gathering")
            # ... and its time runs out there while the device is still held.
            await wait_until(
                lambda: (
                    metric_sum(
                        server.registry, UPSTREAM_ITEMS_EXPIRED_TOTAL, backend="topic-minilm"
                    )
                    - expired_before
                    == 1
                ),
                "the gathering call counted as expired",
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await late
            assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (await first).labels
    assert upstream_calls(server) == (calls_before + 1, items_before + 1)
    assert texts_computed(capability) - computed_before == 1


async def test_a_call_refused_as_it_arrives_is_counted_as_shed_not_expired(
    one_call_at_a_time: OrchestratorServer, capability: CapabilityServer
) -> None:
    """Calls of one item have been taking 10 s: a call with 2 s left, arriving behind
    the one in flight, is refused DEADLINE_UNREACHABLE at once and counted with the
    backend's shed calls (what the ClassifyLoadShedding alert reads), not as expired."""
    server = one_call_at_a_time

    def counted(name: str) -> float:
        return metric_sum(server.registry, name, backend="topic-minilm")

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)  # the pool exists
        (pool,) = server.dispatcher.state.upstream.pools()
        (coalescer,) = pool.coalescers.values()
        shed_before = counted(DEADLINE_UNREACHABLE_TOTAL)
        expired_before = counted(UPSTREAM_ITEMS_EXPIRED_TOTAL)
        async with device_occupied(capability.pool.workers[0]):
            first = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=60)
            )
            await wait_until(lambda: coalescer.in_flight == 1)
            for _ in range(40):
                coalescer.call_time.record(1, 10.0)
            error = await refusal(stub.Classify(pb.ClassifyRequest(text=TEXTS[1]), timeout=2))
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert error_reason(error) == "DEADLINE_UNREACHABLE"
        assert (await first).labels
    assert counted(DEADLINE_UNREACHABLE_TOTAL) == shed_before + 1
    assert counted(UPSTREAM_ITEMS_EXPIRED_TOTAL) == expired_before


async def test_long_texts_that_gather_leave_in_calls_a_batch_may_hold(
    one_call_at_a_time: OrchestratorServer, capability: CapabilityServer
) -> None:
    """Twelve callers' 100,000-character texts, each valid alone, gather behind a held
    call: merged into one call they would break the batch's 1,000,000-character rule
    (and fail every item for it); they leave in calls of at most ten texts."""
    server = one_call_at_a_time
    calls_before, items_before = upstream_calls(server)
    long_texts = [f"{index} " + TEXTS[index % len(TEXTS)] * 2_000 for index in range(12)]
    long_texts = [text[:100_000] for text in long_texts]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(capability.pool.workers[0]):
            first = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=long_texts[0]), timeout=60)
            )
            await wait_until(lambda: upstream_calls(server)[1] - items_before == 1)
            (pool,) = server.dispatcher.state.upstream.pools()
            (coalescer,) = pool.coalescers.values()
            rest = [
                asyncio.ensure_future(stub.Classify(pb.ClassifyRequest(text=text), timeout=60))
                for text in long_texts[1:]
            ]
            await wait_until(lambda: coalescer.waiting == 11, "the other eleven gathering")
        answers = await asyncio.gather(first, *rest)
    assert all(answer.labels for answer in answers)
    calls, items = upstream_calls(server)
    assert items - items_before == 12
    assert calls - calls_before == 3  # the held one, then ten texts and one


async def test_an_item_whose_time_runs_out_in_flight_is_answered_then_not_when_its_call_returns(
    capability: CapabilityServer,
) -> None:
    """Two items leave in one call, one with 0.3 s, one with 30 s, while the device is
    held. The short one is answered DEADLINE_EXCEEDED at its own deadline, while the
    call is still in flight; held to the call's end, it would wait for the device (and
    in service, past its caller's deadline). The capability drops it uncomputed."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(channel, capability)
        computed_before = texts_computed(capability)

        def classify(request_id: str, seconds: float) -> asyncio.Future[pb.ClassifyResponse]:
            request = pb.ClassifyRequest(text=STRIKER, model="topic-minilm", request_id=request_id)
            return asyncio.ensure_future(
                coalescer.classify(request, seconds=seconds, trace_metadata=())
            )

        async with device_occupied(capability.pool.workers[0]):
            short, patient = classify("short", 0.3), classify("patient", 30)
            await wait_until(lambda: coalescer.in_flight == 1)
            assert coalescer.waiting == 0, "the two items did not leave in one call"
            with pytest.raises(DeadlineExpired) as expired:
                await asyncio.wait_for(short, timeout=5)
            assert not patient.done()
        assert (await patient).request_id == "patient"
    assert type(expired.value) is DeadlineExpired
    assert str(expired.value) == "backend minilm did not answer in time"
    assert texts_computed(capability) - computed_before == 1


async def test_a_call_whose_callers_have_all_gone_is_cancelled_and_holds_nothing_back(
    capability: CapabilityServer,
) -> None:
    """A caller that hangs up (or a hedge's loser) left its upstream call running until
    the replica answered: it held its slot here, so the next call gathered behind it,
    and the replica computed a text nobody would read. Now the call is cancelled once
    none of its items is waited for; a call that still carries a waited-for item runs
    on."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(channel, capability)
        computed_before = texts_computed(capability)

        def classify(request_id: str) -> asyncio.Future[pb.ClassifyResponse]:
            request = minilm_request(request_id)
            return asyncio.ensure_future(coalescer.classify(request, seconds=30, trace_metadata=()))

        async with device_occupied(capability.pool.workers[0]):
            gone, stays = classify("gone"), classify("stays")
            await wait_until(lambda: coalescer.in_flight == 1)
            gone.cancel()
            await asyncio.sleep(0.1)
            assert coalescer.in_flight == 1, "a call with an item still waited for was cancelled"
            stays.cancel()
            await wait_until(lambda: coalescer.in_flight == 0, "the unwanted call cancelled")
            following = classify("following")
            for _ in range(3):
                await asyncio.sleep(0)
            assert (coalescer.waiting, coalescer.in_flight) == (0, 1), "it gathered behind"
        assert (await following).request_id == "following"
    # The replica dropped the cancelled call's two texts uncomputed.
    assert texts_computed(capability) - computed_before == 1


class OneResultShort(classify_service_pb2_grpc.ClassifyServiceServicer):
    """A faulty capability: answers a ClassifyBatch with one result fewer than its items
    (a real one never does, so this stands in for one with a bug)."""

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        answer = pb.ClassifyBatchResponse()
        for item in request.items[:-1]:
            answer.results.add().response.request_id = item.request_id
        return answer

    async def Classify(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "batches only")

    async def GetResult(  # noqa: N802 - the gRPC method's name
        self, request: pb.GetResultRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "batches only")


@contextlib.asynccontextmanager
async def coalescer_before(
    replica: classify_service_pb2_grpc.ClassifyServiceServicer, **options: Any
) -> AsyncIterator[ReplicaCoalescer]:
    """A coalescer in front of a scripted replica (a real gRPC server), with `options`."""
    server = grpc.aio.server()
    classify_service_pb2_grpc.add_ClassifyServiceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield ReplicaCoalescer(
                channel,
                backend="minilm",
                target=f"127.0.0.1:{port}",
                credentials=(),
                settings=CoalescingSettings(),
                **options,
            )
    finally:
        await server.stop(0)


async def test_an_item_a_batch_answer_leaves_out_is_a_fault_of_the_replica_not_a_timeout() -> None:
    """It was DEADLINE_EXCEEDED, "did not answer within its timeout" once the backend pool
    read it, from a replica that answered in milliseconds, and counted as overload."""
    async with coalescer_before(OneResultShort()) as coalescer:
        answered, left_out = await asyncio.gather(
            *(
                coalescer.classify(minilm_request(name), seconds=30, trace_metadata=())
                for name in ("answered", "left-out")
            ),
            return_exceptions=True,
        )
    assert isinstance(answered, pb.ClassifyResponse)
    assert answered.request_id == "answered"
    assert isinstance(left_out, ModelFault)
    assert str(left_out) == "backend minilm answered without a result for the item"


class Unanswering(OneResultShort):
    """A frozen replica: takes calls, answers none (until the test ends)."""

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        await asyncio.sleep(30)
        return pb.ClassifyBatchResponse()

    async def Classify(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        await asyncio.sleep(30)
        return pb.ClassifyResponse()


async def test_a_call_whose_last_waiter_runs_out_of_time_is_let_go_and_a_long_one_counted() -> None:
    """Only a caller's leaving let a call go: one whose last waited-for item ran out of
    time here ran on to its latest item's deadline, holding its slot. And a call let go
    after a second unanswered counts as one the replica did not answer, as its timeout
    would have (how a frozen replica gets ejected)."""
    unanswered: list[str] = []
    on_no_answer = {"on_no_answer": lambda: unanswered.append("call")}
    async with coalescer_before(Unanswering(), **on_no_answer) as coalescer:

        def classify(request_id: str, seconds: float) -> asyncio.Future[pb.ClassifyResponse]:
            request = minilm_request(request_id)
            return asyncio.ensure_future(
                coalescer.classify(request, seconds=seconds, trace_metadata=())
            )

        short, patient = classify("short", 0.3), classify("patient", 30)
        await wait_until(lambda: coalescer.in_flight == 1)
        patient.cancel()
        await asyncio.sleep(0.05)
        assert coalescer.in_flight == 1, "let go while an item was still waited for"
        with pytest.raises(DeadlineExpired):
            await short
        await wait_until(lambda: coalescer.in_flight == 0, "the unwanted call let go")
        assert unanswered == []  # 0.3 s says nothing of the replica

        alone = classify("alone", 30)
        await wait_until(lambda: coalescer.in_flight == 1)
        await asyncio.sleep(UNANSWERED_AFTER_SECONDS + 0.1)
        alone.cancel()
        await wait_until(lambda: coalescer.in_flight == 0, "the long call let go")
        assert unanswered == ["call"]


class FailingItems(OneResultShort):
    """Answers a ClassifyBatch OK with each item's outcome by its request ID: `ok-…`
    served, `fault-…` MODEL_FAULT (UNAVAILABLE: a broken device), `gone-…` NOT_FOUND,
    anything else INVALID_ARGUMENT (a refusal of the text)."""

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        answer = pb.ClassifyBatchResponse()
        codes = {"fault": grpc.StatusCode.UNAVAILABLE, "gone": grpc.StatusCode.NOT_FOUND}
        for item in request.items:
            result = answer.results.add()
            kind = item.request_id.partition("-")[0]
            if kind == "ok":
                result.response.request_id = item.request_id
            else:
                code = codes.get(kind, grpc.StatusCode.INVALID_ARGUMENT)
                result.error.code = code.value[0]
                result.error.message = f"planted {kind}"
        return answer


@pytest.mark.parametrize(
    ("request_ids", "answered"),
    [
        (("fault-1", "fault-2"), False),
        (("fault-1", "gone-2"), False),
        (("fault-1", "ok-2"), True),
        (("refused-1", "fault-2"), True),
    ],
    ids=["all-faulted", "faulted-or-not-served", "one-served", "one-refused"],
)
async def test_a_merged_call_failing_every_item_as_unanswered_counts_as_not_answered(
    request_ids: tuple[str, str], answered: bool
) -> None:
    """A replica whose device broke answers a merged call OK, each item MODEL_FAULT
    (UNAVAILABLE). Counted as answered, it reset its failures at every merged call, so
    under load (when calls merge) it was never ejected and cost each call sent to it
    a retry. Such a call counts as one a single call failing UNAVAILABLE is; a call
    with any item served, or refused for the text, counts as answered."""
    outcomes: list[str] = []
    counts = {
        "on_answered": lambda: outcomes.append("answered"),
        "on_no_answer": lambda: outcomes.append("not answered"),
    }
    async with coalescer_before(FailingItems(), **counts) as coalescer:
        await asyncio.gather(
            *(
                coalescer.classify(minilm_request(name), seconds=30, trace_metadata=())
                for name in request_ids
            ),
            return_exceptions=True,
        )
    assert outcomes == ["answered" if answered else "not answered"]  # one merged call


def minilm_request(request_id: str) -> pb.ClassifyRequest:
    return pb.ClassifyRequest(text=STRIKER, model="topic-minilm", request_id=request_id)


async def refused_behind_a_busy_call(
    coalescer: ReplicaCoalescer, worker: DeviceWorker, hurried: float, patient: float
) -> DeadlineUnreachable:
    """With the device held and call "a" in flight, item "b" with `hurried` seconds
    left is refused as it arrives (the call ahead still held), and item "c" with
    `patient` seconds gathers; "a" and "c" are answered once the device is let go.
    Returns b's refusal."""
    async with device_occupied(worker):
        first = asyncio.ensure_future(
            coalescer.classify(minilm_request("a"), seconds=30, trace_metadata=())
        )
        await wait_until(lambda: coalescer.in_flight == 1)
        with pytest.raises(DeadlineUnreachable) as refused:
            await coalescer.classify(minilm_request("b"), seconds=hurried, trace_metadata=())
        assert not first.done()
        gathering = asyncio.ensure_future(
            coalescer.classify(minilm_request("c"), seconds=patient, trace_metadata=())
        )
        await wait_until(lambda: coalescer.waiting == 1)
    assert (await first).request_id == "a"
    assert (await gathering).request_id == "c"
    return refused.value


async def test_an_item_that_cannot_make_it_behind_busy_calls_is_refused_as_it_arrives(
    capability: CapabilityServer,
) -> None:
    """The replica reports a 1 s wait: the call in flight is expected back in 1 s, and
    an item with 1.5 s left would need 2 s. It is refused at once, not after waiting for
    its turn; one with 3 s left gathers and is answered."""
    shed: list[str] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(
            channel,
            capability,
            CoalescingSettings(max_in_flight=1),
            on_unreachable=shed.append,
            predicted_wait=lambda: 1.0,
        )
        computed_before = texts_computed(capability)
        refused = await refused_behind_a_busy_call(
            coalescer, capability.pool.workers[0], hurried=1.5, patient=3.0
        )
    assert "busy for about" in str(refused)
    assert shed == [UNREACHABLE_REPORTED_WAIT]
    assert texts_computed(capability) - computed_before == 2


async def test_a_replica_that_reports_no_wait_is_judged_by_how_long_its_calls_take(
    capability: CapabilityServer,
) -> None:
    """The replica reports no wait, but its last call took at least 0.5 s (the device was
    held that long). Behind the next such call, an item with 0.8 s left would need about
    1 s: it is refused as it arrives. Trusting the report alone, it would be sent."""
    shed: list[str] = []
    worker = capability.pool.workers[0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(
            channel,
            capability,
            CoalescingSettings(max_in_flight=1),
            on_unreachable=shed.append,
        )
        async with device_occupied(worker):
            slow = asyncio.ensure_future(
                coalescer.classify(minilm_request("slow"), seconds=30, trace_metadata=())
            )
            await wait_until(lambda: coalescer.in_flight == 1)
            await asyncio.sleep(0.5)
        assert (await slow).request_id == "slow"
        refused = await refused_behind_a_busy_call(coalescer, worker, hurried=0.8, patient=10.0)
    assert "for a call of 1 items" in str(refused)
    assert shed == [UNREACHABLE_CALL_TIME]


async def test_an_item_that_gathers_first_is_judged_by_the_call_it_will_leave_in(
    capability: CapabilityServer,
) -> None:
    """Calls have lately carried about 20 items, and a call takes 0.1 s plus 0.02 s an
    item. The first item to gather behind a busy call leaves with the 19 or so that
    gather after it: it needs about 0.5 s, not the 0.12 s of a call of one, and with
    0.45 s left it is refused at once. One with 5 s left gathers and is answered."""
    shed: list[str] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(
            channel,
            capability,
            CoalescingSettings(max_in_flight=1),
            on_unreachable=shed.append,
        )
        # What the coalescer would have learned from calls of 10 and 30 items, and
        # from sending calls of 25 (the lone call "a" brings the count to 20).
        for items in (10, 30) * 10:
            coalescer.call_time.record(items, 0.1 + 0.02 * items)
        for _ in range(30):
            coalescer.call_time.sent(25)
        refused = await refused_behind_a_busy_call(
            coalescer, capability.pool.workers[0], hurried=0.45, patient=5.0
        )
    assert "for a call of 20 items" in str(refused)
    assert shed == [UNREACHABLE_CALL_TIME]


async def test_an_item_whose_call_comes_back_late_is_judged_again_as_it_leaves(
    capability: CapabilityServer,
) -> None:
    """Calls have been taking 1 s, and the replica reports no wait. Item "b" arrives
    with 2.5 s left behind call "a" (expected back in 1 s, then 1 s for its own call):
    it gathers. The device is held 1.6 s, so "a" comes back late and "b" has about
    0.9 s left as it would leave, less than the 1 s or more its call takes: it is
    refused then, never sent. Judged by the report alone it would have been sent."""
    shed: list[str] = []
    worker = capability.pool.workers[0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(
            channel,
            capability,
            CoalescingSettings(max_in_flight=1),
            on_unreachable=shed.append,
        )
        for items in (1, 5) * 10:
            coalescer.call_time.record(items, 1.0)
        computed_before = texts_computed(capability)
        async with device_occupied(worker):
            first = asyncio.ensure_future(
                coalescer.classify(minilm_request("a"), seconds=30, trace_metadata=())
            )
            await wait_until(lambda: coalescer.in_flight == 1)
            gathered = asyncio.ensure_future(
                coalescer.classify(minilm_request("b"), seconds=2.5, trace_metadata=())
            )
            await wait_until(lambda: coalescer.waiting == 1)
            await asyncio.sleep(1.6)
        assert (await first).request_id == "a"
        with pytest.raises(DeadlineUnreachable) as refused:
            await gathered
    # The call "a" took about 1.6 s, and the fit learned from it too.
    judged = re.fullmatch(
        r"backend minilm takes about (\d+) ms for a call of 1 items, but only (\d+) ms are left",
        str(refused.value),
    )
    assert judged is not None, str(refused.value)
    needed_ms, left_ms = int(judged.group(1)), int(judged.group(2))
    assert needed_ms >= 1000
    assert 0 < left_ms < needed_ms
    assert shed == [UNREACHABLE_CALL_TIME]
    assert texts_computed(capability) - computed_before == 1


async def test_a_fit_learned_under_load_counts_down_while_the_replica_is_idle(
    capability: CapabilityServer,
) -> None:
    """Calls have been taking 2 s (learned under load), and the last one just came
    back. An item with 1 s left is refused at once. Nothing is sent for 1.3 s, so the
    queueing the fit learned has drained: the next item with 1 s left is sent and
    answered. A fit that did not count down would refuse every such item, send
    nothing, and never learn otherwise."""
    shed: list[str] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(
            channel,
            capability,
            CoalescingSettings(max_in_flight=1),
            on_unreachable=shed.append,
        )
        first = await coalescer.classify(minilm_request("a"), seconds=30, trace_metadata=())
        assert first.request_id == "a"
        for items in (1, 5) * 10:
            coalescer.call_time.record(items, 2.0)
        computed_before = texts_computed(capability)
        with pytest.raises(DeadlineUnreachable) as refused:
            await coalescer.classify(minilm_request("early"), seconds=1.0, trace_metadata=())
        judged = re.search(r"takes about (\d+) ms for a call of 1 items", str(refused.value))
        assert judged is not None, str(refused.value)
        # The fit ("a" among its calls), less the moments since "a" came back.
        assert 1000 < int(judged.group(1)) <= 2000
        await asyncio.sleep(1.3)
        later = await coalescer.classify(minilm_request("later"), seconds=1.0, trace_metadata=())
    assert later.request_id == "later"
    assert shed == [UNREACHABLE_CALL_TIME]
    assert texts_computed(capability) - computed_before == 1


async def test_items_leave_with_their_time_less_the_way_back_of_their_answers(
    capability: CapabilityServer,
) -> None:
    """A coalescer that has learned that answers spend 10 s between the two servers (a
    stalled network, say) gives the replica no time for two items of 5 s: the replica
    answers both DEADLINE_EXCEEDED at once, uncomputed, rather than compute answers that
    could only arrive after their items ran out here. With nothing learned, the same
    two items are computed."""

    def classify(
        coalescer: ReplicaCoalescer, request_id: str
    ) -> asyncio.Future[pb.ClassifyResponse]:
        request = pb.ClassifyRequest(text=STRIKER, model="topic-minilm", request_id=request_id)
        return asyncio.ensure_future(coalescer.classify(request, seconds=5.0, trace_metadata=()))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        computed_before = texts_computed(capability)
        stalled = coalescer_on(channel, capability)
        stalled.trip.record(round_trip=10.5, handled=0.5, longest=30.0)
        outcomes = await asyncio.gather(
            classify(stalled, "a"), classify(stalled, "b"), return_exceptions=True
        )
        assert [type(outcome).__name__ for outcome in outcomes] == ["DeadlineUnreachable"] * 2
        assert texts_computed(capability) == computed_before
        fresh = coalescer_on(channel, capability)
        answers = await asyncio.gather(classify(fresh, "c"), classify(fresh, "d"))
        assert [answer.request_id for answer in answers] == ["c", "d"]
        assert texts_computed(capability) == computed_before + 2
        # A real call taught it a trip: short on loopback, far under the items' time.
        assert 0 < fresh.trip.allowance() < 1.0


async def test_an_item_the_replica_refuses_is_answered_before_its_call_returns(
    capability: CapabilityServer,
) -> None:
    """Two items in one call, the device held: the replica refuses at admission the one
    whose 5 s cannot cover the learned 10 s way back, and the coalescer answers it from
    the call's early results while the other (30 s) waits for the device."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(channel, capability)
        coalescer.trip.record(round_trip=10.5, handled=0.5, longest=30.0)

        def classify(seconds: float) -> asyncio.Future[pb.ClassifyResponse]:
            request = pb.ClassifyRequest(text=STRIKER, model="topic-minilm")
            return asyncio.ensure_future(
                coalescer.classify(request, seconds=seconds, trace_metadata=())
            )

        async with device_occupied(capability.pool.workers[0]):
            refused, served = classify(5.0), classify(30.0)
            await wait_until(refused.done, "the refused item answered")
            assert not served.done()
            assert coalescer.in_flight == 1  # its call has not returned
        assert isinstance(refused.exception(), DeadlineUnreachable)
        assert (await served).labels[0].name == "sports"


def test_the_way_back_is_the_round_trip_less_the_time_in_the_replica() -> None:
    trip = TripTime()
    assert trip.allowance() == 0.0  # nothing answered yet
    for _ in range(50):
        trip.record(round_trip=0.120, handled=0.100, longest=0.3)
    # Steady 20 ms trips: the allowance settles on them, the deviation gone.
    assert trip.allowance() == pytest.approx(0.020, abs=0.001)
    for _ in range(50):
        trip.record(round_trip=0.120, handled=0.100, longest=0.3)
        trip.record(round_trip=0.140, handled=0.100, longest=0.3)
    # Trips of 20 and 40 ms: about their mean plus twice their spread.
    assert 0.045 < trip.allowance() < 0.060
    # A stall of the whole process counts for no more than the call's own time.
    stalled = TripTime()
    stalled.record(round_trip=3.0, handled=0.01, longest=0.3)
    assert stalled.allowance() == pytest.approx(0.3 + 2 * 0.15)
    # An answer the replica says took longer than the round trip: no negative trip.
    odd = TripTime()
    odd.record(round_trip=0.1, handled=0.2, longest=0.3)
    assert odd.allowance() == 0.0


def test_call_time_is_fitted_as_a_fixed_cost_plus_a_cost_per_item() -> None:
    model = CallTimeModel()
    assert model.predict(10) == 0.0  # nothing answered yet
    for items in (4, 16, 64, 8, 32) * 6:
        model.record(items, 0.005 + 0.002 * items)
    assert model.predict(1) == pytest.approx(0.007, rel=1e-6)
    assert model.predict(100) == pytest.approx(0.205, rel=1e-6)


def test_calls_of_one_size_say_nothing_of_other_sizes() -> None:
    """Equal counts cannot tell the fixed cost from the per-item one: any call is
    expected to take what they took (the first calls of a burst are not refused for
    ten times what they cost)."""
    model = CallTimeModel()
    for _ in range(5):
        model.record(1, 0.01)
    assert model.predict(1) == pytest.approx(0.01)
    assert model.predict(30) == pytest.approx(0.01)
    for items in (10, 30, 20):
        model.record(items, 0.01 + 0.002 * items)
    assert model.predict(30) > 0.04


def test_the_items_per_call_follow_the_latest_calls_sent() -> None:
    """One item a call until calls are sent; then the count moves a fifth of the way
    to each new call's, so twenty calls of a new size all but replace the old."""
    model = CallTimeModel()
    assert model.items_per_call() == 1.0
    model.sent(21)
    assert model.items_per_call() == pytest.approx(5.0)
    for _ in range(20):
        model.sent(30)
    assert model.items_per_call() == pytest.approx(30, abs=1.0)
    for _ in range(20):
        model.sent(4)
    assert model.items_per_call() == pytest.approx(4, abs=1.0)


def test_a_negative_cost_from_noise_is_taken_as_none() -> None:
    """Larger calls that happened to come back sooner: no cost per item, and the fixed
    cost is what the calls took on average, never a negative time."""
    model = CallTimeModel()
    for items, seconds in ((10, 0.3), (40, 0.1), (10, 0.3), (40, 0.1)):
        model.record(items, seconds)
    assert model.predict(1000) == pytest.approx(model.predict(1))
    assert model.predict(1) > 0


async def test_coalesced_requests_keep_every_node_and_their_own_trace(
    one_call_at_a_time: OrchestratorServer,
    capability: CapabilityServer,
    span_exporter: InMemorySpanExporter,
) -> None:
    server = one_call_at_a_time
    calls_before, items_before = upstream_calls(server)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(capability.pool.workers[0]):
            # The first call holds the one upstream slot; the other seven gather.
            calls = [
                asyncio.ensure_future(stub.Classify(pb.ClassifyRequest(text=t), timeout=30))
                for t in TEXTS * 2
            ]
            await wait_until(lambda: upstream_calls(server)[1] - items_before >= 1)
            (pool,) = server.dispatcher.state.upstream.pools()
            (coalescer,) = pool.coalescers.values()
            await wait_until(
                lambda: upstream_calls(server)[1] - items_before + coalescer.waiting == 8,
                "every call sent or gathering",
            )
        responses = await asyncio.gather(*calls)
    calls_made, items = upstream_calls(server)
    # The first call went on its own (or with whoever arrived in its loop turn); the
    # rest gathered while it was held. How they split is the scheduler's business.
    assert items - items_before == 8
    assert calls_made - calls_before < 8

    trace_ids = [response.trace_id for response in responses]
    assert len(set(trace_ids)) == 8
    # Each coalesced request's client span is named after the batch call it left in
    # and links to that shared call's span; a request that left alone is a Classify.
    linked: collections.Counter[int] = collections.Counter()
    for trace_id in trace_ids:
        spans = await settled_trace(span_exporter, trace_id, len(NODE_NAMES) + 3)
        (client,) = [span for span in spans if span.kind == SpanKind.CLIENT]
        names = collections.Counter(span.name for span in spans if span is not client)
        assert names == collections.Counter([*NODE_NAMES, CLASSIFY_SPAN, CLASSIFY_SPAN])
        assert len(client.links) <= 1
        merged = UPSTREAM_BATCH_SPAN_NAME if client.links else CLASSIFY_SPAN
        assert client.name == dict(client.attributes or {})["rpc.method"] == merged
        linked.update(link.context.span_id for link in client.links)
    assert sum(linked.values()) >= 2  # some requests did travel together
    shared_spans = {
        span.context.span_id: span
        for span in span_exporter.get_finished_spans()
        if span.name == UPSTREAM_BATCH_SPAN_NAME and span.context is not None
    }
    for shared_id, requests in linked.items():
        # ... and the shared span links back to exactly those requests.
        shared = shared_spans[shared_id]
        assert len(shared.links) == requests
        assert dict(shared.attributes or {})["classify.batch_size"] == requests
        assert shared.kind == SpanKind.CLIENT
        assert shared.parent is None
        assert dict(shared.attributes or {})["server.address"] == "127.0.0.1"
        assert dict(shared.attributes or {})["rpc.response.status_code"] == "OK"


async def test_the_items_of_a_caller_gone_while_gathering_are_no_longer_counted(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    """Left gathering, a cancelled ClassifyBatch's 300 items counted as outstanding and
    sized the next call: a single call after it was refused DEADLINE_UNREACHABLE as if
    it would leave with 128 items."""
    capability = await start_capability(models=("topic-minilm",), queue_capacity=1000)
    worker = capability.pool.workers[0]
    async with orchestrator_for(
        capability, tmp_path, backend_timeout="30s", upstream_calls_in_flight=1
    ) as orchestrator:
        (pool,) = orchestrator.dispatcher.state.upstream.pools()
        (coalescer,) = pool.coalescers.values()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            async with device_occupied(worker):
                held = stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
                await wait_until(lambda: coalescer.in_flight == 1, "a call in flight")
                items = [pb.ClassifyRequest(text=f"{STRIKER} {n}") for n in range(300)]
                batch = stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), timeout=30)
                await wait_until(lambda: coalescer.waiting == 300, "the batch gathering")
                batch.cancel()
                await wait_until(lambda: coalescer.waiting == 0, "the gone items forgotten")
                assert coalescer.outstanding == 1
            await held


async def test_calls_in_flight_to_a_replica_stay_within_its_reported_queue_capacity(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    """Calls of up to 64 items, two at once, to a replica whose queue holds 16: once its
    first answer has reported that, a ClassifyBatch of 200 goes up in calls that fit,
    and none of its items is refused QUEUE_FULL on the idle stack."""
    capability = await start_capability(
        models=("topic-static",), queue_capacity=16, max_batch_size=8
    )
    async with front_door_on(
        static_routes(f"127.0.0.1:{capability.port}"),
        tmp_path,
        upstream_batch_max_items=64,
        upstream_calls_in_flight=2,
    ) as (server, stub):
        await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
        items = [pb.ClassifyRequest(text=f"{STRIKER} {n}") for n in range(200)]
        answer = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), timeout=30)
    refused = metric_sum(
        capability.registry, ADMISSIONS_REFUSED_TOTAL, model="topic-static", reason="QUEUE_FULL"
    )
    assert refused == 0
    assert [result.WhichOneof("outcome") for result in answer.results] == ["response"] * 200
    # The warm-up call, then calls of 16 items at most.
    upstream_calls = metric_sum(server.registry, f"{UPSTREAM_CALL_ITEMS}_count")
    assert upstream_calls >= 1 + 200 / 16


async def test_interactive_items_beside_bulk_work_stay_within_the_replicas_queue(
    start_capability: StartCapability,
) -> None:
    """A replica's queue of 32 taken up by a call of 32 bulk items (two batches of 8 out
    of it, for the busy device): interactive items went beside the bulk call all at
    once, past the queue's room, and the replica refused 8 of 24 QUEUE_FULL (which the
    adaptive limit takes for overload). They leave as the room allows: a batch's worth
    now, the rest as calls come back; none is refused."""
    capability = await start_capability(
        models=("topic-minilm",), max_batch_size=8, queue_capacity=32
    )
    backend = Backend("minilm", "topic-minilm", (f"127.0.0.1:{capability.port}",), 30.0)
    pool = BackendPool(backend, OutlierSettings())
    target = pool.replicas[0]

    async def classify(text: str, priority: pb.Priority.ValueType) -> str:
        request = pb.ClassifyRequest(text=text, model="topic-minilm", priority=priority)
        try:
            await pool.classify(request, target=target, client_remaining=None)
        except ServiceError as refused:
            return refused.reason
        return "OK"

    try:
        assert await classify(STRIKER, pb.PRIORITY_BATCH) == "OK"  # its load report
        replica = capability.pool.workers[0].replicas["topic-minilm"]
        async with device_occupied(capability.pool.workers[0], take_turn=False):
            bulk = [
                asyncio.ensure_future(classify(f"{STRIKER} {n}", pb.PRIORITY_BATCH))
                for n in range(32)
            ]
            # Two batches of 8 out of the queue: one handed to the device, one next.
            await wait_until(lambda: len(replica.queue) == 16, "16 bulk items queued")
            interactive = [
                asyncio.ensure_future(
                    classify(
                        f"Shares fell after the bank cut its forecast {n}", pb.PRIORITY_INTERACTIVE
                    )
                )
                for n in range(24)
            ]
            await wait_until(lambda: len(replica.queue) == 24, "8 interactive items queued")
            for _ in range(5):  # anything more would leave within a few loop turns
                await asyncio.sleep(0)
            assert pool.coalescers[target].waiting == 16
        outcomes = collections.Counter(await asyncio.gather(*bulk, *interactive))
    finally:
        await pool.close()
    assert outcomes == {"OK": 56}


async def test_one_of_two_processes_sends_half_of_a_replicas_queue(
    start_capability: StartCapability,
) -> None:
    """With --processes N every worker sends to the same replicas: each sent up to the
    whole queue the replica reported, so together N times what it holds, and the rest
    was refused QUEUE_FULL. One worker of two sends half."""
    capability = await start_capability(
        models=("topic-minilm",), max_batch_size=8, queue_capacity=32
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(
            channel,
            capability,
            CoalescingSettings(processes=2),
            replica_queue_capacity=lambda: 32,  # as the replica reports it
        )

        async def classify(n: int) -> pb.ClassifyResponse:
            request = pb.ClassifyRequest(
                text=f"{STRIKER} {n}", model="topic-minilm", priority=pb.PRIORITY_BATCH
            )
            return await coalescer.classify(request, seconds=30, trace_metadata=())

        async with device_occupied(capability.pool.workers[0]):
            calls = [asyncio.ensure_future(classify(n)) for n in range(32)]
            await wait_until(lambda: coalescer.in_flight == 1, "the first call sent")
            for _ in range(5):
                await asyncio.sleep(0)
            assert coalescer.waiting == 16  # the call carries the worker's half alone
        answers = await asyncio.gather(*calls)
    assert len(answers) == 32


async def test_an_item_behind_more_than_a_call_is_judged_by_the_calls_ahead_of_it(
    capability: CapabilityServer,
) -> None:
    """Calls of 4 items have been taking 1 s, one call in flight at a time, and 8 items
    (two calls) wait ahead: an item with 2.5 s left cannot make it (its call leaves in
    2 s, then takes 1). Judged as leaving with the first call back, it was let in, and
    refused only as its turn came, too late for its route's fallback."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        coalescer = coalescer_on(
            channel, capability, CoalescingSettings(max_items=4, max_in_flight=1)
        )

        def classify(text: str, seconds: float) -> asyncio.Future[pb.ClassifyResponse]:
            request = pb.ClassifyRequest(text=text, model="topic-minilm")
            return asyncio.ensure_future(
                coalescer.classify(request, seconds=seconds, trace_metadata=())
            )

        async with device_occupied(capability.pool.workers[0]):
            calls = [classify(STRIKER, 60)]
            await wait_until(lambda: coalescer.in_flight == 1, "the first call sent")
            calls += [classify(f"{STRIKER} {n}", 60) for n in range(8)]
            await wait_until(lambda: coalescer.waiting == 8, "two calls' worth waiting")
            for _ in range(40):
                coalescer.call_time.record(4, 1.0)
            with pytest.raises(DeadlineUnreachable, match="busy for about 2"):
                await classify(TEXTS[1], 2.5)
            assert coalescer.waiting == 8
        assert len(await asyncio.gather(*calls)) == 9

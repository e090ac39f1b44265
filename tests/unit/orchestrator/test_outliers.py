"""Outlier ejection: unit rules with a fake clock, then a replica killed under real load,
and a failing pod among the addresses of one target."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.metrics import MODEL_TEXTS_TOTAL
from capability.server import CapabilityServer
from orchestrator.metrics import OUTLIER_EJECTIONS_TOTAL, UPSTREAM_RETRIES_TOTAL
from orchestrator.policy import OutlierDetector, OutlierSettings
from orchestrator.routing import RoutesFileError, load_routes
from orchestrator.server import OrchestratorServer
from tests.conftest import (
    STRIKER,
    capability_settings,
    metric_sum,
    orchestrator_settings,
    wait_until,
)
from tests.flaky_pod import FlakyPod


def make_detector(targets: list[str], now: list[float]) -> tuple[OutlierDetector, list[float]]:
    ejections: list[float] = []
    detector = OutlierDetector(
        targets,
        OutlierSettings(consecutive_failures=2, base_ejection_seconds=1, max_ejection_seconds=3),
        on_ejected=lambda target, seconds: ejections.append(seconds),
        clock=lambda: now[0],
    )
    return detector, ejections


def test_replica_is_ejected_after_failures_in_a_row_for_a_doubling_capped_time() -> None:
    now = [0.0]
    detector, ejections = make_detector(["a", "b", "c", "d"], now)
    for _ in range(3):
        detector.record_failure("a")
        detector.record_failure("a")
        assert detector.is_ejected("a")
        now[0] += ejections[-1]  # readmitted when its time is up
        assert not detector.is_ejected("a")
    assert ejections == [1, 2, 3]


def test_a_replica_failing_for_hours_is_still_ejected_for_the_capped_time() -> None:
    now = [0.0]
    ejections: list[float] = []
    detector = OutlierDetector(
        ["a", "b"],
        # Times as routes.yaml gives them: floats (2**1024 times an int was no overflow).
        OutlierSettings(
            consecutive_failures=1, base_ejection_seconds=1.0, max_ejection_seconds=30.0
        ),
        on_ejected=lambda target, seconds: ejections.append(seconds),
        clock=lambda: now[0],
    )
    for _ in range(1100):  # 1,024 ejections are about 8.5 hours at these settings
        detector.record_failure("a")
        assert detector.is_ejected("a")
        now[0] += ejections[-1]
    assert ejections[:6] == [1, 2, 4, 8, 16, 30]
    assert set(ejections[5:]) == {30}


def test_a_success_resets_the_count() -> None:
    now = [0.0]
    detector, ejections = make_detector(["a", "b"], now)
    detector.record_failure("a")
    detector.record_success("a")
    detector.record_failure("a")
    assert not detector.is_ejected("a")
    assert ejections == []


def test_a_success_between_bouts_keeps_the_doubling_and_time_readmitted_fades_it() -> None:
    """A replica that answers one call between bouts of failures (crashing in a loop,
    shedding most of its load) was ejected for the base time at every bout."""
    now = [0.0]
    detector, ejections = make_detector(["a", "b"], now)

    def bout() -> None:
        detector.record_failure("a")
        detector.record_failure("a")
        assert detector.is_ejected("a")
        now[0] += ejections[-1]  # readmitted when its time is up

    bout()
    detector.record_success("a")
    bout()
    assert ejections == [1, 2]
    now[0] += 10  # one doubling forgotten
    bout()
    assert ejections == [1, 2, 2]
    now[0] += 25  # two forgotten: back to the base time
    bout()
    assert ejections == [1, 2, 2, 1]


def test_the_last_replicas_are_never_all_ejected() -> None:
    now = [0.0]
    detector, _ = make_detector(["a", "b"], now)
    for target in ("a", "b"):
        detector.record_failure(target)
        detector.record_failure(target)
    assert detector.is_ejected("a")
    assert not detector.is_ejected("b")


async def static_replica(model_root: Path, port: int = 0) -> CapabilityServer:
    server = CapabilityServer(
        capability_settings(model_root, models=("topic-static",), port=port),
        registry=CollectorRegistry(),
    )
    await server.start()
    await server.warm_up()
    return server


async def orchestrator_over(
    replicas: list[CapabilityServer], tmp_path: Path, outlier_ejection: str
) -> OrchestratorServer:
    """Started on one backend over `replicas`, whose failed calls are retried on another
    at once, with `outlier_ejection` (routes.yaml's, as a YAML flow mapping)."""
    targets = ", ".join(f'"127.0.0.1:{replica.port}"' for replica in replicas)
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"""version: 1
outlier_ejection: {outlier_ejection}
backends:
  static: {{model: topic-static, targets: [{targets}]}}
routes:
  - name: default
    backend: static
    retry: {{max_attempts: 3, initial_backoff: 1ms, max_backoff: 5ms}}
"""
    )
    orchestrator = OrchestratorServer(
        orchestrator_settings(port=0, metrics_port=-1, routes_file=routes),
        registry=CollectorRegistry(),
    )
    await orchestrator.start()
    return orchestrator


async def test_killed_replica_costs_no_call_is_passed_by_and_used_again_when_back(
    model_root: Path, tmp_path: Path
) -> None:
    replicas = [await static_replica(model_root), await static_replica(model_root)]
    orchestrator = await orchestrator_over(
        replicas, tmp_path, "{consecutive_failures: 2, base_ejection: 300ms}"
    )
    failures: list[grpc.aio.AioRpcError] = []
    answered = 0
    stop = asyncio.Event()

    async def client(stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub) -> None:
        nonlocal answered
        while not stop.is_set():
            try:
                await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)
                answered += 1
            except grpc.aio.AioRpcError as error:
                failures.append(error)

    dead_port = replicas[1].port
    dead_target = f"127.0.0.1:{dead_port}"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            clients = [asyncio.ensure_future(client(stub)) for _ in range(4)]
            await wait_until(
                lambda: metric_sum(replicas[1].registry, MODEL_TEXTS_TOTAL) >= 2,
                "the doomed replica served under load",
            )
            await replicas[1].stop(grace_seconds=0)  # killed mid-load
            # Passed by: ejected after the calls it failed, or its channel failing to connect.
            (pool,) = orchestrator.dispatcher.state.upstream.pools()
            await wait_until(
                lambda: dead_target not in {pool.pick() for _ in range(4)},
                "the killed replica passed by",
            )

            # The replica comes back on the same address, and is used again once its
            # channel reconnects (and its ejection, if any, is over).
            returned = await static_replica(model_root, port=dead_port)
            replicas.append(returned)
            await wait_until(
                lambda: metric_sum(returned.registry, MODEL_TEXTS_TOTAL) >= 5,
                "the returned replica used again",
            )
            stop.set()
            await asyncio.gather(*clients)
    finally:
        await orchestrator.stop(grace_seconds=0)
        for server in replicas:
            await server.stop(grace_seconds=0)
    assert failures == []
    assert answered > 20
    assert metric_sum(returned.registry, MODEL_TEXTS_TOTAL) >= 5, "the replica was not readmitted"


async def test_a_replica_down_while_the_other_is_ejected_leaves_the_calls_to_the_other(
    model_root: Path, tmp_path: Path
) -> None:
    """A rolling restart: one replica is back but still ejected (its ejection doubled
    while it was down) when the other goes down. The one down cannot be ejected (never
    all), and both were passed over alike: every other call went to it first, failed,
    and spent a retry (from a budget that load runs out of, and none where a route
    allows one attempt)."""
    first, second = await static_replica(model_root), await static_replica(model_root)
    orchestrator = await orchestrator_over(
        [first, second],
        tmp_path,
        "{consecutive_failures: 1, base_ejection: 60s, max_ejection: 60s}",
    )
    (pool,) = orchestrator.dispatcher.state.upstream.pools()
    second_target = f"127.0.0.1:{second.port}"
    servers = [first, second]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            await second.stop(grace_seconds=0)
            while metric_sum(orchestrator.registry, OUTLIER_EJECTIONS_TOTAL) < 1:
                await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)
            assert pool.outliers.is_ejected(second_target)
            servers.append(await static_replica(model_root, port=second.port))  # back, ejected
            channel_of_second = pool._channels[second_target]
            await wait_until(
                lambda: (
                    channel_of_second.get_state(try_to_connect=True)
                    is grpc.ChannelConnectivity.READY
                ),
                "the replica back connected again",
            )
            await first.stop(grace_seconds=0)
            # The first call finds the one down (its connection was idle): retried.
            await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)
            retries = metric_sum(orchestrator.registry, UPSTREAM_RETRIES_TOTAL)
            for n in range(20):
                await stub.Classify(pb.ClassifyRequest(text=f"{STRIKER} {n}"), timeout=10)
            # Each of the others went to the ejected one first: no retry was needed, and
            # none spent the retry budget (which load would have run out of).
            assert metric_sum(orchestrator.registry, UPSTREAM_RETRIES_TOTAL) == retries
            assert metric_sum(servers[-1].registry, MODEL_TEXTS_TOTAL) == 21
            assert pool.outliers.is_ejected(second_target)
    finally:
        await orchestrator.stop(grace_seconds=0)
        for server in servers:
            await server.stop(grace_seconds=0)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("{consecutive_failures: 0}", "consecutive_failures 0 is outside 1..100"),
        ("{max_ejected_percent: 150}", "max_ejected_percent 150 is outside 0..100"),
        ("{base_ejection: 5s, max_ejection: 1s}", "max_ejection must be at least base_ejection"),
        ("{ejection: 5s}", "outlier_ejection.ejection: unknown key"),
    ],
)
def test_bad_outlier_settings_are_refused_with_their_path(
    tmp_path: Path, setting: str, message: str
) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(
        f"version: 1\noutlier_ejection: {setting}\nbackends:\n  a: {{model: m, targets: ['h:1']}}\n"
        "routes:\n  - {name: d, backend: a}\n"
    )
    with pytest.raises(RoutesFileError) as caught:
        load_routes(path)
    assert message in str(caught.value)


def test_replicas_that_stay_keep_their_state_and_never_all_follows_the_count() -> None:
    now = [0.0]
    detector, ejections = make_detector(["a", "b"], now)
    detector.record_failure("a")
    detector.record_failure("a")
    assert detector.is_ejected("a")
    detector.track(["a", "b", "c"])  # a pod joins: "a" stays out
    assert detector.is_ejected("a")
    detector.track(["c"])  # one replica left: ejection is off
    detector.record_failure("c")
    detector.record_failure("c")
    assert not detector.is_ejected("c")
    detector.record_failure("a")  # a call to a pod that left reports back late
    assert ejections == [1]


def test_fewer_replicas_readmit_those_ejected_past_the_new_count_due_back_first() -> None:
    """Two of four ejected, then the name holds two, then one: both stayed out, and
    then the only replica was, until its time was up."""
    now = [0.0]
    detector = OutlierDetector(
        ["a", "b", "c", "d"],
        OutlierSettings(consecutive_failures=1, max_ejected_percent=50),
        clock=lambda: now[0],
    )
    detector.record_failure("a")
    now[0] += 0.1
    detector.record_failure("b")  # due back 0.1 s after a
    assert (detector.is_ejected("a"), detector.is_ejected("b")) == (True, True)
    detector.track(["a", "b"])  # one of two may be out
    assert (detector.is_ejected("a"), detector.is_ejected("b")) == (False, True)
    detector.track(["b"])
    assert not detector.is_ejected("b")


async def test_failing_pod_behind_one_target_is_ejected_and_readmitted(
    model_root: Path, tmp_path: Path
) -> None:
    """One target with two addresses, as a dns:/// name of a headless Service has: the
    pod that passes its health checks but fails its calls is ejected on its own (the
    other is not: never all), gets no calls while out, and gets them again once it
    recovers and its time is up."""
    healthy = CapabilityServer(
        capability_settings(model_root, models=("topic-static",)), registry=CollectorRegistry()
    )
    await healthy.start()
    await healthy.warm_up()
    pod = FlakyPod(healthy.port)
    await pod.start()
    healthy_address = f"127.0.0.1:{healthy.port}"
    ejection_seconds = 2.0
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"""version: 1
outlier_ejection: {{consecutive_failures: 2, base_ejection: {ejection_seconds}s}}
backends:
  static:
    model: topic-static
    targets: ["ipv4:{healthy_address},{pod.address}"]
routes:
  - name: default
    backend: static
    retry: {{max_attempts: 2, initial_backoff: 1ms, max_backoff: 1ms}}
"""
    )
    orchestrator = OrchestratorServer(
        orchestrator_settings(port=0, metrics_port=-1, routes_file=routes),
        registry=CollectorRegistry(),
    )
    await orchestrator.start()

    def ejections(address: str) -> float:
        return metric_sum(
            orchestrator.registry, OUTLIER_EJECTIONS_TOTAL, backend="static", target=address
        )

    loop = asyncio.get_running_loop()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)

            async def classify() -> None:  # a failure here fails the test: retries hide none
                await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)

            for _ in range(20):
                await classify()
                if ejections(pod.address):
                    break
            ejected_at = loop.time()
            assert ejections(pod.address) == 1
            calls_before = pod.calls
            for _ in range(10):
                await classify()
            assert loop.time() - ejected_at < ejection_seconds, "too slow to see the ejection"
            assert pod.calls == calls_before, "an ejected pod got calls"

            pod.failing = False  # the pod recovers, and is readmitted when its time is up

            async def readmitted() -> bool:
                await classify()
                return pod.answered >= 3

            await wait_until(readmitted, "the recovered pod answering again")
    finally:
        await orchestrator.stop(grace_seconds=0)
        await pod.stop()
        await healthy.stop(grace_seconds=0)
    assert pod.answered >= 3, "the pod was not readmitted"
    assert ejections(pod.address) == 1
    assert ejections(healthy_address) == 0


class _NeverAnswers(grpc.GenericRpcHandler):
    """Every call is taken and never answered: a replica that stopped (a stopped
    process, a wedged event loop) while its connections stay open."""

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes]:
        async def never(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            await asyncio.Event().wait()
            return b""

        return grpc.unary_unary_rpc_method_handler(never)


async def beside_a_frozen_replica(
    capability: CapabilityServer,
    tmp_path: Path,
    consecutive_failures: int,
    callers: int,
    calls: Callable[[classify_service_pb2_grpc.ClassifyServiceAsyncStub], Awaitable[None]],
) -> OrchestratorServer:
    """Run `callers` concurrent `calls(stub)` through an orchestrator whose backend has
    two replicas: first one that takes calls and never answers, then `capability`.
    Calls are given up after the backend's 300 ms; ejection lasts the whole test."""
    frozen = grpc.aio.server()
    frozen.add_generic_rpc_handlers((_NeverAnswers(),))
    frozen_port = frozen.add_insecure_port("127.0.0.1:0")
    await frozen.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"""version: 1
outlier_ejection:
  {{consecutive_failures: {consecutive_failures}, base_ejection: 60s, max_ejection: 60s}}
backends:
  static:
    model: topic-static
    targets: ["127.0.0.1:{frozen_port}", "127.0.0.1:{capability.port}"]
    timeout: 300ms
routes:
  - name: default
    backend: static
"""
    )
    orchestrator = OrchestratorServer(
        orchestrator_settings(port=0, metrics_port=-1, routes_file=routes),
        registry=CollectorRegistry(),
    )
    try:
        await orchestrator.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            await asyncio.gather(*(calls(stub) for _ in range(callers)))
    finally:
        await orchestrator.stop(grace_seconds=0)
        await frozen.stop(grace=0)
    return orchestrator


async def classify_noting_the_code(
    stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub, codes: list[grpc.StatusCode]
) -> None:
    try:
        await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)
        codes.append(grpc.StatusCode.OK)
    except grpc.aio.AioRpcError as error:
        codes.append(error.code())


async def test_a_replica_that_stopped_answering_is_ejected_and_the_other_serves(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """Calls one after the other: the stopped replica fails three of them in a row (out
    of time, no status), is ejected, and the rest are answered by the other. Turns
    alone, with no ejection, gave it every second call."""
    codes: list[grpc.StatusCode] = []

    async def one_after_the_other(stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub) -> None:
        for _ in range(12):
            await classify_noting_the_code(stub, codes)

    orchestrator = await beside_a_frozen_replica(
        capability, tmp_path, consecutive_failures=3, callers=1, calls=one_after_the_other
    )
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == 3, codes
    assert codes[-6:] == [grpc.StatusCode.OK] * 6
    assert metric_sum(orchestrator.registry, OUTLIER_EJECTIONS_TOTAL) == 1


async def test_calls_go_to_the_replica_with_the_fewest_outstanding(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """No ejection (100 failures in a row needed): four callers, fifteen calls each. The
    stopped replica holds what it was sent, so while it holds any the other gets the
    calls; it is picked again only when it holds fewer than the other (9 of 60 here,
    each held 300 ms). In turns it got every second call, 30 of 60."""
    codes: list[grpc.StatusCode] = []

    async def fifteen_calls(stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub) -> None:
        for _ in range(15):
            await classify_noting_the_code(stub, codes)

    await beside_a_frozen_replica(
        capability, tmp_path, consecutive_failures=100, callers=4, calls=fifteen_calls
    )
    assert len(codes) == 60
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) <= 20, codes
    assert codes.count(grpc.StatusCode.OK) + codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == 60

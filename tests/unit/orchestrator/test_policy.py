"""Retries and model fallback through a real orchestrator and a real capability server."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from orchestrator.metrics import (
    BACKEND_IN_FLIGHT,
    MODEL_FALLBACK_TOTAL,
    RETRY_BUDGET_EXHAUSTED_TOTAL,
    UPSTREAM_RETRIES_TOTAL,
)
from orchestrator.policy import RetryBudget, RetryBudgetSettings, RetryPolicy, backoff_seconds
from orchestrator.routing import RoutesFileError, load_routes
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, StartOrchestrator, closed_port, metric_sum, wait_until
from tests.flaky_pod import FlakyPod
from tests.status_details import error_info, refusal, violations_of
from tests.unit.capability.test_serving import device_occupied


async def classify_many(
    server: OrchestratorServer, count: int, **fields: object
) -> list[pb.ClassifyResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        return [
            await stub.Classify(pb.ClassifyRequest(text=STRIKER, **fields), timeout=30)  # type: ignore[arg-type]
            for _ in range(count)
        ]


def test_backoff_is_full_jitter_under_a_growing_capped_bound() -> None:
    policy = RetryPolicy(initial_backoff_seconds=0.1, max_backoff_seconds=0.3, multiplier=2)
    rng = random.Random(7)
    for attempt, bound in ((1, 0.1), (2, 0.2), (3, 0.3), (4, 0.3)):
        waits = [backoff_seconds(policy, attempt, rng) for _ in range(200)]
        assert min(waits) >= 0
        assert max(waits) <= bound
        assert max(waits) > bound * 0.8  # the whole range is used, not a fixed delay


async def test_dead_replica_is_retried_on_the_live_one_without_a_failed_call(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    server = await orchestrator_with(
        f"""version: 1
backends:
  minilm:
    model: topic-minilm
    targets: ["127.0.0.1:{closed_port()}", "127.0.0.1:{capability.port}"]
routes:
  - name: default
    backend: minilm
"""
    )
    responses = await classify_many(server, 8)
    assert all(r.labels[0].name == "sports" and not r.fallback for r in responses)
    retried = metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL, route="default", backend="minilm")
    assert retried >= 1
    assert retried == metric_sum(
        server.registry, UPSTREAM_RETRIES_TOTAL, reason="MODEL_UNAVAILABLE"
    )


def dead_primary_with_fallback(live_port: int) -> str:
    """Routes whose primary backend is down (tried twice) and whose fallback is live."""
    return f"""version: 1
backends:
  minilm:
    model: topic-minilm
    targets: ["127.0.0.1:{closed_port()}"]
  static:
    model: topic-static
    targets: ["127.0.0.1:{live_port}"]
routes:
  - name: default
    backend: minilm
    fallback: [static]
    retry: {{max_attempts: 2, initial_backoff: 1ms, max_backoff: 5ms}}
"""


async def test_failing_primary_is_answered_by_the_fallback_model_and_counted(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    server = await orchestrator_with(dead_primary_with_fallback(capability.port))
    responses = await classify_many(server, 5)
    assert all(r.fallback for r in responses)
    assert {(r.model.name, r.labels[0].name, r.route) for r in responses} == {
        ("topic-static", "sports", "default")
    }
    counted = metric_sum(
        server.registry,
        MODEL_FALLBACK_TOTAL,
        route="default",
        reason="MODEL_UNAVAILABLE",
        **{"from": "minilm", "to": "static"},
    )
    assert counted == 5
    # max_attempts 2: each call retried the dead primary once before falling back.
    assert metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL, backend="minilm") == 5


async def test_client_errors_are_neither_retried_nor_sent_to_the_fallback(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    """A capability that finds the request itself wrong (INVALID_ARGUMENT with its
    field violations): the caller is told so, with the violation, and no other replica
    or model is asked."""
    pod = FlakyPod(capability.port, failing=False)
    pod.refusing_field = "text"
    await pod.start()
    try:
        server = await orchestrator_with(
            f"""version: 1
backends:
  strict:
    model: topic-minilm
    targets: ["{pod.address}", "{pod.address}"]
  static:
    model: topic-static
    targets: ["127.0.0.1:{capability.port}"]
routes:
  - name: default
    backend: strict
    fallback: [static]
    retry: {{max_attempts: 3}}
"""
        )
        error = await refusal(classify_many(server, 1))
    finally:
        await pod.stop()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations_of(error) == [("text", "planted.rule")]
    assert metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL) == 0
    assert metric_sum(server.registry, MODEL_FALLBACK_TOTAL) == 0
    assert pod.calls == 1


BASE = """version: 1
backends:
  a: {model: topic-minilm, targets: ["127.0.0.1:1"]}
  b: {model: topic-static, targets: ["127.0.0.1:2"]}
routes:
  - name: default
    backend: a
"""


@pytest.mark.parametrize(
    ("route_lines", "message"),
    [
        ("    fallback: [c]\n", "routes[0].fallback[0]: unknown backend 'c'"),
        ("    fallback: [a]\n", "routes[0].fallback[0]: backend 'a' is already tried earlier"),
        ("    fallback: [b, b]\n", "routes[0].fallback[1]: backend 'b' is already tried earlier"),
        (
            "    retry: {max_attempts: 9}\n",
            "routes[0].retry.max_attempts: max_attempts 9 is outside 1..5",
        ),
        (
            "    retry: {retryable_codes: [INVALID_ARGUMENT]}\n",
            "INVALID_ARGUMENT may not be retried",
        ),
        (
            "    retry: {retryable_codes: [NOPE]}\n",
            "routes[0].retry.retryable_codes: unknown status code",
        ),
        ("    retry: {backoff: 1s}\n", "routes[0].retry.backoff: unknown key"),
    ],
)
def test_bad_fallback_or_retry_settings_are_refused_with_their_path(
    tmp_path: Path, route_lines: str, message: str
) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(BASE + route_lines)
    with pytest.raises(RoutesFileError) as caught:
        load_routes(path)
    assert message in str(caught.value)


def test_retry_budget_allows_a_share_of_recent_requests_plus_a_floor() -> None:
    now = [1000.0]
    budget = RetryBudget(
        RetryBudgetSettings(ratio=0.2, min_retries_per_second=0.1, window_seconds=10),
        clock=lambda: now[0],
    )
    for _ in range(20):
        budget.record_request()
    # 0.1/s x 10 s = 1 from the floor, plus 20 x 0.2 = 4 from traffic.
    assert [budget.try_spend() for _ in range(6)] == [True] * 5 + [False]
    now[0] += 11  # the window has moved past all of it
    assert budget.try_spend()  # the floor alone
    assert not budget.try_spend()


async def test_retry_budget_stops_a_retry_storm_when_every_replica_fails(
    orchestrator_with: StartOrchestrator,
) -> None:
    server = await orchestrator_with(
        f"""version: 1
retry_budget: {{ratio: 0.1, min_retries_per_second: 0, window: 10s}}
backends:
  dead:
    model: topic-minilm
    targets: ["127.0.0.1:{closed_port()}", "127.0.0.1:{closed_port()}"]
routes:
  - name: default
    backend: dead
    retry: {{max_attempts: 5, initial_backoff: 1ms, max_backoff: 2ms}}
"""
    )
    calls = 30
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        for _ in range(calls):
            error = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
    retries = metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL)
    # Without the budget: 4 retries per call, 120 in all.
    assert retries <= 0.1 * calls
    # Attempts were not what stopped them (5 allowed): each call ended on a refusal.
    assert metric_sum(server.registry, RETRY_BUDGET_EXHAUSTED_TOTAL) == calls


async def test_dns_target_is_resolved_and_served(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    server = await orchestrator_with(
        f"""version: 1
backends:
  minilm:
    model: topic-minilm
    targets: ["dns:///127.0.0.1:{capability.port}"]
routes:
  - name: default
    backend: minilm
"""
    )
    responses = await classify_many(server, 3)
    assert all(r.labels[0].name == "sports" for r in responses)


def limited_minilm_routes(
    port: int, *, max_concurrency: int, backend_extra: str = "", route_extra: str = ""
) -> str:
    """One route to topic-minilm limited to `max_concurrency` calls in flight, falling
    back to topic-static, both on `port`; each extra is one more line of the backend
    or the route."""
    return f"""version: 1
backends:
  minilm:
    model: topic-minilm
    targets: ["127.0.0.1:{port}"]
    max_concurrency: {max_concurrency}
    {backend_extra}
  static:
    model: topic-static
    targets: ["127.0.0.1:{port}"]
routes:
  - name: default
    backend: minilm
    fallback: [static]
    {route_extra}
"""


async def test_backend_at_its_concurrency_limit_sheds_to_the_fallback(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    server = await orchestrator_with(
        limited_minilm_routes(
            capability.port,
            max_concurrency=2,
            route_extra="retry: {max_attempts: 3, initial_backoff: 1s, max_backoff: 1s}",
        )
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(capability.pool.workers[0]):
            # Two calls hold the primary's two slots while the device is busy...
            held = [
                asyncio.ensure_future(stub.Classify(pb.ClassifyRequest(text=STRIKER)))
                for _ in range(2)
            ]
            pool = server.dispatcher.state.upstream.pool(server.routes.default_route.backend)
            await wait_until(lambda: pool.in_flight == 2, "two calls held upstream")
            # ...so the third is refused there at once and handed to the fallback, which
            # also waits for the held device: it is answered after the release.
            third = asyncio.ensure_future(stub.Classify(pb.ClassifyRequest(text=STRIKER)))
            fallback = server.dispatcher.state.upstream.pool(server.routes.backends["static"])
            await wait_until(lambda: fallback.in_flight == 1, "the third call at the fallback")
        answers = await asyncio.gather(*held, third)
    assert [a.fallback for a in answers] == [False, False, True]
    assert metric_sum(server.registry, MODEL_FALLBACK_TOTAL, reason="CONCURRENCY_LIMITED") == 1
    # Not retried on the full backend first (a second of backoff a retry, here): the
    # fallback took it at once.
    assert metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL) == 0


async def test_a_backends_concurrency_limit_counts_its_calls_from_before_an_edit_of_it(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer, tmp_path: Path
) -> None:
    """An edit that changes a backend (here its timeout) gives it a new pool; the calls
    still in flight on the old one go to the same replicas, and count against the
    limit until they end. Counting the new pool alone let as many calls again in."""

    def routes(timeout: str) -> str:
        return limited_minilm_routes(
            capability.port, max_concurrency=1, backend_extra=f"timeout: {timeout}"
        )

    server = await orchestrator_with(routes("20s"))
    edited = tmp_path / "edited.yaml"
    edited.write_text(routes("19s"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(capability.pool.workers[0]):
            held = asyncio.ensure_future(stub.Classify(pb.ClassifyRequest(text=STRIKER)))
            before = server.dispatcher.state.upstream.pool(server.routes.default_route.backend)
            await wait_until(lambda: before.in_flight == 1, "a call held upstream")
            server._apply_routes(load_routes(edited))  # what the watcher does with an edit
            after = server.dispatcher.state.upstream.pool(server.routes.default_route.backend)
            assert after is not before
            assert metric_sum(server.registry, BACKEND_IN_FLIGHT, backend="minilm") == 1
            second = asyncio.ensure_future(stub.Classify(pb.ClassifyRequest(text=STRIKER)))
            fallback = server.dispatcher.state.upstream.pool(server.routes.backends["static"])
            await wait_until(lambda: fallback.in_flight == 1, "the second call at the fallback")
        answers = await asyncio.gather(held, second)
        assert [a.fallback for a in answers] == [False, True]
        # The old pool has closed with its last call: the limit is the new pool's alone.
        await wait_until(lambda: after.calls_in_flight == 0, "the old pool's call ended")
        third = await stub.Classify(pb.ClassifyRequest(text=STRIKER))
    assert (third.fallback, third.model.name) == (False, "topic-minilm")
    assert metric_sum(server.registry, MODEL_FALLBACK_TOTAL, reason="CONCURRENCY_LIMITED") == 1


async def test_a_hung_primary_falls_back_when_its_own_timeout_runs_out(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    """A replica that takes calls and never answers (a stopped process, a wedged
    device): the backend's 300 ms timeout runs out with seconds left on the caller's
    deadline, and the fallback answers in them. Without a fallback, the caller is told
    how long the backend had."""
    pod = FlakyPod(capability.port, failing=False)
    pod.answering.clear()
    await pod.start()
    try:
        server = await orchestrator_with(
            f"""version: 1
backends:
  hung: {{model: topic-minilm, targets: ["{pod.address}"], timeout: 300ms}}
  static: {{model: topic-static, targets: ["127.0.0.1:{capability.port}"]}}
routes:
  - name: alone
    match: {{model: [topic-minilm]}}
    backend: hung
  - name: default
    backend: hung
    fallback: [static]
"""
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            started = asyncio.get_running_loop().time()
            answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)
            took = asyncio.get_running_loop().time() - started
            alone = await refusal(
                stub.Classify(pb.ClassifyRequest(text=STRIKER, model="topic-minilm"), timeout=10)
            )
        assert (answer.fallback, answer.model.name, answer.labels[0].name) == (
            True,
            "topic-static",
            "sports",
        )
        assert took < 5  # the backend's timeout, not the caller's 10 s deadline
        assert (
            metric_sum(
                server.registry,
                MODEL_FALLBACK_TOTAL,
                route="default",
                reason="DEADLINE_EXPIRED",
                **{"from": "hung", "to": "static"},
            )
            == 1
        )
        assert alone.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert alone.details() == "backend hung did not answer within its 300 ms timeout"
        # What tells a client (the CLI's --timeout hint) it was no deadline of its own.
        assert error_info(alone).metadata["backend_timeout_ms"] == "300"
    finally:
        pod.answering.set()
        await pod.stop()


def retrying_hung_routes(targets: list[str], timeout: str, static_port: int) -> str:
    """`hung` (topic-minilm at `targets`, with `timeout`) retried up to three times on
    UNAVAILABLE or DEADLINE_EXCEEDED, falling back to topic-static."""
    listed = ", ".join(f'"{target}"' for target in targets)
    return f"""version: 1
backends:
  hung: {{model: topic-minilm, targets: [{listed}], timeout: {timeout}}}
  static: {{model: topic-static, targets: ["127.0.0.1:{static_port}"]}}
routes:
  - name: default
    backend: hung
    fallback: [static]
    retry: {{max_attempts: 3, retryable_codes: [UNAVAILABLE, DEADLINE_EXCEEDED]}}
"""


async def assert_the_fallback_answers_unretried(server: OrchestratorServer, pod: FlakyPod) -> None:
    """A call with 1.5 s left is answered by the fallback, the hung pod asked once."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=1.5)
    assert (answer.fallback, answer.model.name) == (True, "topic-static")
    assert pod.calls == 1
    assert metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL) == 0


async def test_a_hung_replica_is_not_retried_while_the_other_one_is_down(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    """Two replicas, one hung, the other's connection failing: a retry can only go back
    to the hung one. Counted as a replica not yet tried, the down one made each
    time-out a retry on the hung replica, and the fallback never got its turn."""
    pod = FlakyPod(capability.port, failing=False)
    pod.answering.clear()
    await pod.start()
    down = f"127.0.0.1:{closed_port()}"
    try:
        server = await orchestrator_with(
            retrying_hung_routes([pod.address, down], "300ms", capability.port)
        )
        pool = server.dispatcher.state.upstream.pool(server.routes.backends["hung"])
        channel_of_down = pool._channels[down]
        await wait_until(
            lambda: (
                channel_of_down.get_state(try_to_connect=True)
                is grpc.ChannelConnectivity.TRANSIENT_FAILURE
            ),
            "the down replica's connection failing",
        )
        await assert_the_fallback_answers_unretried(server, pod)
    finally:
        pod.answering.set()
        await pod.stop()


async def test_a_hung_lone_replica_is_not_retried_into_the_fallbacks_time(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    """DEADLINE_EXCEEDED retryable, three attempts, one replica: asked again, the hung
    replica spent the caller's time, and the last attempt, cut by the caller's
    deadline, ended in a failure no fallback may take (DEADLINE_EXCEEDED at 2.5 s)."""
    pod = FlakyPod(capability.port, failing=False)
    pod.answering.clear()
    await pod.start()
    try:
        server = await orchestrator_with(
            retrying_hung_routes([pod.address], "500ms", capability.port)
        )
        await assert_the_fallback_answers_unretried(server, pod)
    finally:
        pod.answering.set()
        await pod.stop()

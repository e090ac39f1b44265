"""Orchestrators that share their state in a real Redis: results, rate limits, outages."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.context import bind_time_left_on_arrival
from classify_common.errors import (
    QueueFull,
    ResultNotFound,
    ServerDraining,
    StateUnavailable,
    grpc_code_for,
    status_for,
)
from classify_common.settings import SettingsError
from orchestrator.metrics import (
    API_KEYS_RELOADS_TOTAL,
    RATE_LIMITED_TOTAL,
    REQUEST_DURATION_SECONDS,
)
from orchestrator.results import LocalResultStore
from orchestrator.security import hash_key, new_key
from orchestrator.security.limits import TokenBucketSettings
from orchestrator.server import START_ERRORS, OrchestratorServer
from orchestrator.state import RedisRateLimits, RedisResultStore, RedisState, StateMetrics
from orchestrator.state import connection as state_connection
from orchestrator.state import results as state_results
from orchestrator.state.connection import (
    DEADLINE_MARGIN_SECONDS,
    STATE_OPERATIONS_TOTAL,
    STATE_UP,
)
from orchestrator.state.limits import BUCKET_PREFIX, MAX_BUCKET_LAPSE_MS
from orchestrator.state.results import (
    PENDING,
    PROCESS_LEASE_PREFIX,
    RESULT_PREFIX,
    RESULT_TOKEN_PREFIX,
    TENANT_COUNTS,
    backoff_ceiling,
)
from orchestrator.workers import one_worker_of
from tests.conftest import (
    STRIKER,
    ProcessStarter,
    RedisServer,
    closed_port,
    metric_sum,
    orchestrator_settings,
    wait_until,
)
from tests.status_details import error_info, error_reason, refusal, retry_delay_seconds, unpack
from tests.unit.capability.test_serving import device_occupied
from tests.unit.orchestrator.test_results import as_tenant

ACME_KEY = new_key()
StartShared = Callable[..., Awaitable[OrchestratorServer]]
PROCESSING, DONE = pb.RESULT_STATUS_PROCESSING, pb.RESULT_STATUS_DONE


def write_shared_files(
    directory: Path, capability: CapabilityServer, model: str, burst: int, budget: str = "200ms"
) -> tuple[Path, Path]:
    """The API keys file (tenant `acme`, ACME_KEY, `burst` calls and next to no refill)
    and the routes file (one route to `model` on `capability`, with `budget`) of the
    orchestrators that share a Redis."""
    keys = directory / "keys.yaml"
    keys.write_text(
        f"keys:\n  - {{id: a, sha256: {hash_key(ACME_KEY)}, tenant: acme, role: user}}\n"
        f"tenants:\n  acme: {{rate_per_second: 0.001, burst: {burst}}}\n"
    )
    routes = directory / "routes.yaml"
    routes.write_text(
        f"""version: 1
backends:
  model: {{model: {model}, targets: ["127.0.0.1:{capability.port}"], timeout: 30s}}
routes:
  - name: default
    backend: model
    budget: {budget}
"""
    )
    return keys, routes


@pytest_asyncio.fixture
async def start_shared(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[StartShared]:
    """Start orchestrators that share `redis_server`, routing to a capability server;
    tenant `acme` (ACME_KEY) has `burst` calls and next to no refill."""
    started: list[OrchestratorServer] = []

    async def start(
        capability: CapabilityServer,
        *,
        model: str = "topic-static",
        burst: int = 5,
        budget: str = "200ms",
        **settings: Any,
    ) -> OrchestratorServer:
        keys, routes = write_shared_files(tmp_path, capability, model, burst, budget)
        values = {"state_url": redis_server.url, "state_retry_seconds": 0.05, **settings}
        server = OrchestratorServer(
            orchestrator_settings(
                routes_file=routes, auth="required", api_keys_file=keys, **values
            ),
            registry=CollectorRegistry(),
        )
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop(grace_seconds=0)


def stub_for(channel: grpc.aio.Channel) -> classify_service_pb2_grpc.ClassifyServiceAsyncStub:
    return classify_service_pb2_grpc.ClassifyServiceStub(channel)


async def classify(
    server: OrchestratorServer, within: float | None = None, **fields: Any
) -> pb.ClassifyResponse:
    """One Classify on a fresh connection, as tenant acme."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        response: pb.ClassifyResponse = await stub_for(channel).Classify(
            pb.ClassifyRequest(text=STRIKER, **fields),
            metadata=(("authorization", f"Bearer {ACME_KEY}"),),
            timeout=within,
        )
        return response


async def get_result(
    server: OrchestratorServer, request_id: str, within: float | None = None
) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        response: pb.ClassifyResponse = await stub_for(channel).GetResult(
            pb.GetResultRequest(request_id=request_id),
            metadata=(("authorization", f"Bearer {ACME_KEY}"),),
            timeout=within,
        )
        return response


def state_failures(server: OrchestratorServer, operation: str) -> float:
    """Commands of `operation` that Redis did not answer (failed, timed out or skipped)."""
    return sum(
        metric_sum(server.registry, STATE_OPERATIONS_TOTAL, operation=operation, outcome=outcome)
        for outcome in ("error", "timeout", "skipped")
    )


async def test_processing_answer_from_one_orchestrator_is_polled_to_done_on_another(
    capability: CapabilityServer, start_shared: StartShared
) -> None:
    first = await start_shared(capability, model="topic-minilm", burst=100)
    second = await start_shared(capability, model="topic-minilm", burst=100)
    async with device_occupied(capability.pool.workers[0]):
        answer = await classify(first, request_id="shared-1")
        assert answer.status == pb.RESULT_STATUS_PROCESSING
        polled = await get_result(second, "shared-1")
        assert (polled.status, polled.route) == (pb.RESULT_STATUS_PROCESSING, "default")
    done: list[pb.ClassifyResponse] = []

    async def is_done() -> bool:
        done.append(await get_result(second, "shared-1"))
        return done[-1].status == pb.RESULT_STATUS_DONE

    await wait_until(is_done, "shared-1 done on the other orchestrator", limit_seconds=10)
    assert done[-1].labels[0].name == "sports"
    assert (done[-1].request_id, done[-1].trace_id) == ("shared-1", answer.trace_id)
    unknown = await refusal(get_result(second, "never-sent"))
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason(unknown) == "RESULT_NOT_FOUND"
    assert state_failures(first, "result_hold") == 0


async def test_a_result_whose_orchestrator_stopped_is_not_left_processing(
    capability: CapabilityServer, start_shared: StartShared
) -> None:
    """The orchestrator that answered PROCESSING stops (a rolling deploy) with the work
    unfinished: the other one answers the poll SERVER_DRAINING (call again), not
    PROCESSING for the rest of the TTL with nothing running behind it."""
    first = await start_shared(capability, model="topic-minilm", burst=100)
    second = await start_shared(capability, model="topic-minilm", burst=100)

    async def not_processing() -> bool:
        try:
            await get_result(second, "orphan-1")
        except grpc.aio.AioRpcError:
            return True
        return False

    async with device_occupied(capability.pool.workers[0]):
        answer = await classify(first, request_id="orphan-1")
        assert answer.status == pb.RESULT_STATUS_PROCESSING
        # The stop waits for the upstream call in flight, which the held device answers
        # once the block ends; the work itself is dropped at once.
        stopping = asyncio.ensure_future(first.stop(grace_seconds=0))
        await wait_until(not_processing, "the result no longer PROCESSING")
        polled = await refusal(get_result(second, "orphan-1"))
    await stopping
    assert polled.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(polled) == "SERVER_DRAINING"
    assert error_info(polled).metadata["result_trace_id"] == answer.trace_id


# The lease of the process killed below (--state-lease-seconds): long enough for the
# poll right after the kill to come within it on a busy machine.
KILLED_LEASE_SECONDS = 2


async def test_a_result_whose_orchestrator_process_was_killed_is_not_left_processing(
    capability: CapabilityServer,
    start_shared: StartShared,
    start_process: ProcessStarter,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    """The process that answered PROCESSING is killed (SIGKILL, as the OOM killer does),
    so it writes nothing: once its lease lapses, a poll on another orchestrator answers
    SERVER_DRAINING (call again), not PROCESSING for the rest of the TTL (300 s)."""
    keys, routes = write_shared_files(tmp_path, capability, "topic-minilm", burst=1000)
    doomed = start_process(
        "orchestrator",
        *("--port", "0", "--metrics-port", "0", "--routes-file", str(routes)),
        *("--auth", "required", "--api-keys-file", str(keys)),
        *("--state-url", redis_server.url, "--state-retry-seconds", "0.05"),
        *("--state-lease-seconds", str(KILLED_LEASE_SECONDS)),
    )
    survivor = await start_shared(capability, model="topic-minilm", burst=1000)
    async with device_occupied(capability.pool.workers[0]):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{doomed.port}") as channel:
            answer = await stub_for(channel).Classify(
                pb.ClassifyRequest(text=STRIKER, request_id="killed-1"),
                metadata=(("authorization", f"Bearer {ACME_KEY}"),),
            )
        assert answer.status == pb.RESULT_STATUS_PROCESSING
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=10)
        killed_at = time.monotonic()
        # Within the lease, the result may still be on its way: PROCESSING.
        polled_in_lease = await get_result(survivor, "killed-1")
        assert polled_in_lease.status == pb.RESULT_STATUS_PROCESSING

        async def not_processing() -> bool:
            try:
                await get_result(survivor, "killed-1")
            except grpc.aio.AioRpcError:
                return True
            await asyncio.sleep(0.2)  # a client's pace: each poll takes a token
            return False

        await wait_until(
            not_processing,
            "the killed process's result no longer PROCESSING",
            limit_seconds=KILLED_LEASE_SECONDS + 5,
        )
        polled = await refusal(get_result(survivor, "killed-1"))
    assert time.monotonic() - killed_at <= KILLED_LEASE_SECONDS + 5
    assert polled.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(polled) == "SERVER_DRAINING"
    assert error_info(polled).metadata["result_trace_id"] == answer.trace_id


async def test_a_tenants_rate_is_one_bucket_across_orchestrators(
    capability: CapabilityServer, start_shared: StartShared
) -> None:
    servers = [await start_shared(capability, burst=5) for _ in range(2)]
    codes = []
    for turn in range(8):  # alternating: each orchestrator sees 4 calls
        try:
            await classify(servers[turn % 2])
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as error:
            codes.append(error.code())
    assert codes == [grpc.StatusCode.OK] * 5 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
    refused = [metric_sum(server.registry, RATE_LIMITED_TOTAL, tenant="acme") for server in servers]
    assert refused == [1, 2]  # calls 6 and 8 went to the first, 7 to the second


async def test_a_tenants_limit_edited_in_the_keys_file_holds_in_redis_and_in_its_stand_in(
    capability: CapabilityServer, start_shared: StartShared, tmp_path: Path
) -> None:
    """Each check sends the tenant's limit with it, so Redis's bucket follows the edit;
    the process's own share, which answers while Redis is away, follows it too."""
    server = await start_shared(capability, burst=5, keys_poll_seconds=0.05)
    keys = tmp_path / "keys.yaml"
    staging = tmp_path / "keys.yaml.new"
    staging.write_text(keys.read_text().replace("burst: 5", "burst: 2"))
    staging.replace(keys)
    await wait_until(
        lambda: metric_sum(server.registry, API_KEYS_RELOADS_TOTAL, outcome="ok") == 1,
        "the edit applied",
    )
    response = await classify_batch(server, [f"item-{n}" for n in range(4)], within=30)
    assert [result.HasField("error") for result in response.results] == [False] * 2 + [True] * 2
    limits = server.state.limits
    assert isinstance(limits, RedisRateLimits)
    assert limits.stand_in_limits == {"acme": TokenBucketSettings(0.001, 2)}


async def test_batch_items_over_a_tenants_redis_bucket_are_hinted_the_wait_for_all_of_them(
    capability: CapabilityServer, start_shared: StartShared
) -> None:
    server = await start_shared(capability, burst=5)  # 0.001 tokens a second
    response = await classify_batch(server, [f"item-{n}" for n in range(8)], within=30)
    refused = [result.error for result in response.results if result.HasField("error")]
    assert len(refused) == 3
    # Three tokens at 0.001 a second (less the sliver refilled since the grant), not
    # the one token a resend of three would find.
    delays = {
        round(retry.retry_delay.ToTimedelta().total_seconds())
        for error in refused
        for retry in unpack(error, error_details_pb2.RetryInfo)
    }
    assert delays == {3000}


async def test_redis_stopped_calls_are_answered_counted_and_state_returns_with_it(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    server = await start_shared(capability, model="topic-minilm", burst=4)
    assert (await classify(server)).labels[0].name == "sports"  # a token from Redis's bucket
    redis_server.stop()

    # Polls: UNAVAILABLE while the store is away (the call takes a token too).
    away = await refusal(get_result(server, "anything"))
    assert away.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(away) == "STATE_UNAVAILABLE"
    assert state_failures(server, "result_get") == 1

    # Rate limits: the process's own bucket stands in for Redis's. It holds 4 tokens
    # less the call Redis granted (charged to it too) and the poll: 2, not a full 4.
    codes = [await code_of(classify(server)) for _ in range(4)]
    assert codes == [grpc.StatusCode.OK] * 2 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert state_failures(server, "rate_limit") == 5

    redis_server.start()  # back, empty: the tenant's bucket in Redis is full again

    def answered_by_redis() -> float:
        return metric_sum(
            server.registry, STATE_OPERATIONS_TOTAL, operation="rate_limit", outcome="ok"
        )

    before = answered_by_redis()

    async def checked_in_redis() -> bool:
        await code_of(classify(server))
        return answered_by_redis() > before

    await wait_until(checked_in_redis, "a rate-limit check answered by Redis again")
    assert (await classify(server)).labels[0].name == "sports"


def state_outcomes(server: OrchestratorServer, operation: str) -> dict[str, float]:
    return {
        outcome: metric_sum(
            server.registry, STATE_OPERATIONS_TOTAL, operation=operation, outcome=outcome
        )
        for outcome in ("ok", "error", "timeout", "deadline", "skipped")
    }


def leave_the_rest_of_the_call(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Keep `seconds` of a call's time after its Redis command gives up, for the rest of
    the call and its answer's way back (connection.DEADLINE_MARGIN_SECONDS, 30 ms in
    service): on a busy machine 30 ms was not always enough, and the client saw
    DEADLINE_EXCEEDED (1 run in 11)."""
    monkeypatch.setattr(state_connection, "DEADLINE_MARGIN_SECONDS", seconds)


async def test_a_call_whose_deadline_precedes_the_state_timeout_goes_on_without_a_stalled_redis(
    capability: CapabilityServer,
    start_shared: StartShared,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 0.6 s deadline, a 0.8 s --state-timeout-ms, Redis stalled (SIGSTOP): the call
    was cancelled in its rate-limit check, uncounted and starting no rest, so it and
    every call after it failed DEADLINE_EXCEEDED. Its check now gives up in time,
    counted, the call is answered from the process's share, and the next skips Redis."""
    leave_the_rest_of_the_call(monkeypatch, 0.1)
    server = await start_shared(capability, burst=100, state_timeout_ms=800, state_retry_seconds=5)
    await classify(server)  # connections opened and the script loaded
    redis_server.pause()
    try:
        stalled = await code_of(classify(server, within=0.6))
        after = await code_of(classify(server, within=0.6))
    finally:
        redis_server.resume()
    assert (stalled, after) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
    assert state_outcomes(server, "rate_limit") == {
        "ok": 1,
        "error": 0,
        "timeout": 1,  # 500 ms of 800: over half, so Redis's own
        "deadline": 0,
        "skipped": 1,
    }


async def test_a_deadline_too_tight_to_tell_a_failing_redis_starts_no_rest(
    redis_state: RedisState, redis_server: RedisServer, state_registry: CollectorRegistry
) -> None:
    """Cut short by its caller's deadline well within --state-timeout-ms, a command
    that Redis did not answer is counted but starts no rest: a tenant's tight
    deadlines must not send every call in the process to its fallback."""
    await redis_state.run("ping", redis_state.client.ping)
    redis_server.pause()
    try:
        with pytest.raises(StateUnavailable):
            await redis_state.run("rate_limit", redis_state.client.ping, within=0.035)
    finally:
        redis_server.resume()
    assert await redis_state.run("rate_limit", redis_state.client.ping) is True
    # Counted as the deadline's, not as Redis timing out (which the alert reads).
    outcomes = {
        outcome: metric_sum(
            state_registry,
            STATE_OPERATIONS_TOTAL,
            operation="rate_limit",
            outcome=outcome,
        )
        for outcome in ("ok", "timeout", "deadline")
    }
    assert outcomes == {"ok": 1, "timeout": 0, "deadline": 1}


async def test_a_poll_whose_deadline_precedes_the_state_timeout_is_answered_in_time(
    capability: CapabilityServer,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GetResult with a 0.4 s deadline, a 1 s --state-timeout-ms, Redis stalled
    (SIGSTOP); the caller is not rate limited (auth off), so the poll's read is its
    only command. It was cancelled at the deadline: uncounted, and the poller got a
    bare DEADLINE_EXCEEDED from its own gRPC, with no IDs. It now gives up before
    the deadline, counted, and says UNAVAILABLE (STATE_UNAVAILABLE) with its IDs."""
    leave_the_rest_of_the_call(monkeypatch, 0.2)
    _, routes = write_shared_files(tmp_path, capability, "topic-static", burst=1)
    server = OrchestratorServer(
        orchestrator_settings(
            routes_file=routes,
            state_url=redis_server.url,
            state_timeout_ms=1000,
            state_retry_seconds=5,
        ),
        registry=CollectorRegistry(),
    )
    await server.start()
    try:
        # A connection opened and the script loaded while Redis answers.
        assert (await refusal(get_result(server, "poll-1"))).code() == grpc.StatusCode.NOT_FOUND
        redis_server.pause()
        try:
            failed = await refusal(get_result(server, "poll-1", within=0.4))
        finally:
            redis_server.resume()
    finally:
        await server.stop(grace_seconds=0)
    assert failed.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(failed) == "STATE_UNAVAILABLE"
    assert error_info(failed).metadata["x-request-id"] == "poll-1"
    assert state_outcomes(server, "result_get") == {
        "ok": 1,
        "error": 0,
        "timeout": 0,
        "deadline": 1,  # 200 ms of 1 s: the deadline's, not Redis's
        "skipped": 0,
    }


async def test_a_rate_limited_poll_is_answered_in_time_by_a_stalled_redis(
    capability: CapabilityServer,
    start_shared: StartShared,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above for a rate-limited tenant: its check takes the poll's time up to the
    margin, and the read, given what is left, is not sent and says so in time."""
    leave_the_rest_of_the_call(monkeypatch, 0.2)
    server = await start_shared(capability, burst=100, state_timeout_ms=1000, state_retry_seconds=5)
    assert (await refusal(get_result(server, "poll-2"))).code() == grpc.StatusCode.NOT_FOUND
    redis_server.pause()
    try:
        failed = await refusal(get_result(server, "poll-2", within=0.4))
    finally:
        redis_server.resume()
    assert failed.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(failed) == "STATE_UNAVAILABLE"
    assert error_info(failed).metadata["x-request-id"] == "poll-2"
    assert state_outcomes(server, "rate_limit")["deadline"] == 1
    assert state_outcomes(server, "result_get") == {
        "ok": 1,
        "error": 0,
        "timeout": 0,
        "deadline": 0,
        "skipped": 1,
    }


async def test_a_check_whose_caller_goes_while_redis_is_stalled_is_counted_cancelled(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    """The client cancels its call while the call's rate-limit check waits on a
    stalled Redis (SIGSTOP; no deadline, a 2 s --state-timeout-ms). The command was
    counted nowhere: the metric showed a stalled Redis's commands as answers only.
    It is counted cancelled: not a failure (no rest starts, and the alert does not
    read it), and its connection goes back to the pool, closed."""
    server = await start_shared(capability, burst=100, state_timeout_ms=2000, state_retry_seconds=5)
    await classify(server)  # a pooled connection, the script loaded

    def cancelled() -> float:
        return metric_sum(
            server.registry, STATE_OPERATIONS_TOTAL, operation="rate_limit", outcome="cancelled"
        )

    redis_server.pause()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = stub_for(channel).Classify(
                pb.ClassifyRequest(text=STRIKER),
                metadata=(("authorization", f"Bearer {ACME_KEY}"),),
            )
            await asyncio.sleep(0.3)  # the check waits on Redis
            call.cancel()
            await wait_until(lambda: cancelled() == 1, "the check counted cancelled")
    finally:
        redis_server.resume()
    assert (await classify(server)).labels[0].name == "sports"
    assert state_outcomes(server, "rate_limit") == {
        "ok": 2,
        "error": 0,
        "timeout": 0,
        "deadline": 0,
        "skipped": 0,
    }


@pytest.mark.parametrize("left", [0.0, 1e-6], ids=["none", "a_microsecond"])
async def test_a_command_with_next_to_no_time_left_does_not_wait_on_a_stalled_redis(
    redis_server: RedisServer, left: float
) -> None:
    """Its call's deadline leaves a command no time, or a microsecond, past the margin;
    Redis is stalled (SIGSTOP), --state-timeout-ms 500. The command was written all
    the same, and the cancellation meant to end it was lost in redis-py's write
    (asyncio.wait_for, in Python 3.11): it waited the whole timeout, far past the
    deadline, and was counted an error that started a rest for every call."""
    registry = CollectorRegistry()
    state = RedisState.from_settings(
        orchestrator_settings(state_url=redis_server.url, state_timeout_ms=500),
        StateMetrics(registry),
    )
    try:
        await state.run("rate_limit", state.client.ping)  # a pooled connection
        redis_server.pause()
        try:
            started = time.perf_counter()
            with pytest.raises(StateUnavailable):
                await state.run(
                    "rate_limit", state.client.ping, within=DEADLINE_MARGIN_SECONDS + left
                )
            waited = time.perf_counter() - started
        finally:
            redis_server.resume()
        assert waited < 0.25
        assert await state.run("rate_limit", state.client.ping) is True  # no rest started
    finally:
        await state.close()
    failed = metric_sum(registry, STATE_OPERATIONS_TOTAL, operation="rate_limit", outcome="error")
    assert failed == 0


async def test_a_command_its_deadline_leaves_no_time_for_is_not_sent(
    redis_server: RedisServer,
) -> None:
    """Not sent, and counted as skipped, not as Redis timing out: with a healthy Redis,
    a tenant's tight deadlines must not feed the alert, nor close a connection a call."""
    registry = CollectorRegistry()
    state = RedisState.from_settings(
        orchestrator_settings(state_url=redis_server.url), StateMetrics(registry)
    )
    try:
        before = await state.run("ping", lambda: state.client.info("stats"))
        with pytest.raises(StateUnavailable) as refused:
            await state.run("rate_limit", state.client.ping, within=0.02)
        after = await state.run("ping", lambda: state.client.info("stats"))
    finally:
        await state.close()
    # One command between the two reads, the first INFO itself: no PING, and no new
    # connection (a command cut off as it starts closes its own).
    assert after["total_commands_processed"] - before["total_commands_processed"] == 1
    assert after["total_connections_received"] == before["total_connections_received"]
    assert refused.value.retry_after_seconds == 0.0
    outcomes = {
        outcome: metric_sum(
            registry, STATE_OPERATIONS_TOTAL, operation="rate_limit", outcome=outcome
        )
        for outcome in ("ok", "error", "timeout", "skipped")
    }
    assert outcomes == {"ok": 0, "error": 0, "timeout": 0, "skipped": 1}


SPIN_20_MS = """
local started = redis.call('TIME')
repeat
  local now = redis.call('TIME')
until (now[1] - started[1]) * 1000000 + now[2] - started[2] >= 20000
return 1
"""


async def test_a_burst_of_the_processs_own_commands_waits_for_connections_not_failing(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout covered the wait for a pooled connection: a ClassifyBatch of 1,024
    items past its budget, each holding its result's place at once, timed out at the
    pool with Redis well, counted as Redis failing, and every call then went without
    it for --state-retry-seconds. Here: 2 connections, 60 commands of 20 ms each
    (the last waits 600 ms for a connection) and a 250 ms timeout, which a command
    once on a connection needs at most 40 ms of (the other connection's script)."""
    monkeypatch.setattr(state_connection, "MAX_CONNECTIONS", 2)
    registry = CollectorRegistry()
    state = RedisState.from_settings(
        orchestrator_settings(state_url=redis_server.url, state_timeout_ms=250),
        StateMetrics(registry),
    )

    def a_20_ms_command() -> Awaitable[object]:
        # A script that spins 20 ms (a blocking command's own timeout is checked only
        # ten times a second).
        return state.client.eval(SPIN_20_MS, 0)

    try:
        answers = await asyncio.gather(
            *(state.run("result_hold", a_20_ms_command) for _ in range(60))
        )
        assert await state.run("ping", state.client.ping) is True  # no rest started
    finally:
        await state.close()
    assert answers == [1] * 60
    outcomes = {
        outcome: metric_sum(
            registry, STATE_OPERATIONS_TOTAL, operation="result_hold", outcome=outcome
        )
        for outcome in ("ok", "timeout", "skipped")
    }
    assert outcomes == {"ok": 60, "timeout": 0, "skipped": 0}


async def code_of(call: Awaitable[object]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_over_budget_call_is_answered_when_done_while_redis_is_away(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    server = await start_shared(capability, model="topic-minilm", burst=100)
    redis_server.stop()
    async with device_occupied(capability.pool.workers[0]):
        call = asyncio.ensure_future(classify(server, request_id="unstored-1"))
        # Past the budget, no place could be held: the call waits instead of PROCESSING.
        await wait_until(lambda: state_failures(server, "result_hold") == 1, "a failed hold")
        assert not call.done()
    answer = await call
    assert (answer.status, answer.labels[0].name) == (pb.RESULT_STATUS_DONE, "sports")

    redis_server.start()  # back: results are kept again and polls find them

    async def held() -> bool:
        async with device_occupied(capability.pool.workers[0]):
            try:
                answer = await classify(server, request_id="kept-after")
            except grpc.aio.AioRpcError:
                return False
        return answer.status == pb.RESULT_STATUS_PROCESSING

    await wait_until(held, "a PROCESSING answer once Redis is back")
    await wait_until(
        lambda: _is_done(get_result(server, "kept-after")), "the kept result", limit_seconds=10
    )


async def _is_done(answer: Awaitable[pb.ClassifyResponse]) -> bool:
    return (await answer).status == pb.RESULT_STATUS_DONE


class SlowReplies:
    """A TCP relay in front of Redis that passes commands on at once and each reply
    `delay` seconds late (set at any time): a Redis that answers, slowly (a busy or
    distant one)."""

    def __init__(self, redis_port: int) -> None:
        self._redis_port = redis_port
        self.delay = 0.0
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    async def __aenter__(self) -> SlowReplies:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for relay in self._relays:
            relay.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        redis_reader, redis_writer = await asyncio.open_connection("127.0.0.1", self._redis_port)
        for relay in (
            self._relay(reader, redis_writer, replies=False),
            self._relay(redis_reader, writer, replies=True),
        ):
            task = asyncio.create_task(relay)
            self._relays.add(task)
            task.add_done_callback(self._relays.discard)

    async def _relay(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, replies: bool
    ) -> None:
        try:
            while chunk := await source.read(65536):
                if replies and self.delay:
                    await asyncio.sleep(self.delay)
                sink.write(chunk)
                await sink.drain()
        finally:
            sink.close()


async def test_a_redis_a_third_of_the_timeout_away_is_reached_from_a_cold_start(
    redis_server: RedisServer,
) -> None:
    """Replies 35 ms late, the default 100 ms --state-timeout-ms. A new connection sent
    CLIENT SETNAME and CLIENT SETINFO before the command, each a round trip inside its
    timeout: from a cold start no command was ever answered."""
    async with SlowReplies(redis_server.port) as slow:
        slow.delay = 0.035
        registry = CollectorRegistry()
        state = RedisState.from_settings(
            orchestrator_settings(state_url=slow.url), StateMetrics(registry)
        )
        limits = RedisRateLimits(state, {"t": TokenBucketSettings(10, 10)}, sharers=2)
        try:
            assert await state.check_at_start() is True
            assert await limits.try_acquire("t") == (9.0, 1, 0.0)
        finally:
            await state.close()
    answered = metric_sum(registry, STATE_OPERATIONS_TOTAL, operation="rate_limit", outcome="ok")
    assert answered == 1


async def classify_batch(
    server: OrchestratorServer, request_ids: list[str], within: float
) -> pb.ClassifyBatchResponse:
    """One ClassifyBatch of STRIKER under each of `request_ids`, as tenant acme."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        items = [pb.ClassifyRequest(text=STRIKER, request_id=rid) for rid in request_ids]
        response: pb.ClassifyBatchResponse = await stub_for(channel).ClassifyBatch(
            pb.ClassifyBatchRequest(items=items),
            metadata=(("authorization", f"Bearer {ACME_KEY}"),),
            timeout=within,
        )
        return response


async def test_a_deadline_before_the_budget_keeps_the_result_though_redis_answers_late(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    """Redis answers 30 ms late, the call's 0.5 s deadline comes before its route's
    budget. The place for its result was held 20 ms before the deadline, so the
    deadline passed during the hold: a bare DEADLINE_EXCEEDED (no IDs, no
    `result_kept`), and the place stayed PROCESSING for the TTL with nobody to fill
    it. A batch's items, each holding after its call's answer came due, lost the
    whole answer."""
    async with SlowReplies(redis_server.port) as slow:
        server = await start_shared(
            capability, model="topic-minilm", burst=100, budget="5s", state_url=slow.url
        )
        async with device_occupied(capability.pool.workers[0]):
            # Connections opened and the scripts loaded while Redis is quick: each
            # takes round trips of its own, which at 30 ms apiece would outlast the
            # 100 ms the orchestrator gives a command.
            await classify_batch(server, ["warm-1", "warm-2", "warm-3"], within=0.5)
            slow.delay = 0.03
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await classify(server, request_id="single-1", within=0.5)
            batch = await classify_batch(server, ["item-1", "item-2"], within=0.5)
            slow.delay = 0.0  # the finish and get scripts, not loaded yet, load quickly
        info = error_info(late.value)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (info.metadata["request_id"], info.metadata["result_kept"]) == ("single-1", "true")
        for result, request_id in zip(batch.results, ["item-1", "item-2"], strict=True):
            (item_info,) = unpack(result.error, error_details_pb2.ErrorInfo)
            assert result.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            assert item_info.metadata["x-request-id"] == request_id
            assert item_info.metadata["result_kept"] == "true"
        for request_id in ("single-1", "item-1", "item-2"):
            await wait_until(
                lambda rid=request_id: _is_done(get_result(server, rid)),  # type: ignore[misc]
                f"the kept result of {request_id}",
                limit_seconds=10,
            )


async def test_the_request_latency_histogram_times_the_front_doors_own_steps(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    """Redis stalled: the call's rate-limit check waits out the 300 ms state timeout
    before the process's share answers it. The histogram the latency objective reads
    began timing after routing, so this wait, like any of auth, rate limits and
    validation, never showed in it nor in its alert."""
    server = await start_shared(capability, burst=100, state_timeout_ms=300)
    await classify(server)  # connections opened and the script loaded
    labels = {"route": "default", "code": "OK"}
    before = metric_sum(server.registry, REQUEST_DURATION_SECONDS + "_sum", **labels)
    redis_server.pause()
    try:
        await classify(server, within=5)
    finally:
        redis_server.resume()
    waited = metric_sum(server.registry, REQUEST_DURATION_SECONDS + "_sum", **labels) - before
    assert state_outcomes(server, "rate_limit")["timeout"] == 1
    assert waited >= 0.25, waited


async def test_a_stalled_redis_still_answers_calls_and_batches_with_their_ids_in_time(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    """Redis stalled (SIGSTOP): no place can be held (a hold times out, or is not sent
    while the store rests after a failure), so nothing is promised, and the single
    call and each batch item still say DEADLINE_EXCEEDED with their own IDs."""
    server = await start_shared(capability, model="topic-minilm", burst=100, budget="5s")
    redis_server.pause()
    try:
        async with device_occupied(capability.pool.workers[0]):
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await classify(server, request_id="single-2", within=0.5)
            batch = await classify_batch(server, ["item-3", "item-4"], within=0.5)
    finally:
        redis_server.resume()
    info = error_info(late.value)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.metadata["request_id"] == "single-2"
    assert "result_kept" not in info.metadata
    for result, request_id in zip(batch.results, ["item-3", "item-4"], strict=True):
        (item_info,) = unpack(result.error, error_details_pb2.ErrorInfo)
        assert result.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert item_info.metadata["x-request-id"] == request_id
        assert "result_kept" not in item_info.metadata


@pytest.fixture
def state_registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest_asyncio.fixture
async def redis_state(
    redis_server: RedisServer, state_registry: CollectorRegistry
) -> AsyncIterator[RedisState]:
    """A connection to `redis_server`, as an orchestrator opens it, counting its commands
    in `state_registry`."""
    settings = orchestrator_settings(state_url=redis_server.url)
    state = RedisState.from_settings(settings, StateMetrics(state_registry))
    yield state
    await state.close()


NewStore = Callable[..., RedisResultStore]


@pytest_asyncio.fixture
async def new_store(redis_state: RedisState) -> AsyncIterator[NewStore]:
    """RedisResultStores on `redis_state`, as many processes' would be, each closed after
    the test (which stops the task renewing its process's lease)."""
    stores: list[RedisResultStore] = []

    def new(**settings: Any) -> RedisResultStore:
        stores.append(RedisResultStore(redis_state, **settings))
        return stores[-1]

    yield new
    for store in stores:
        await store.close()


async def test_stored_error_is_answered_with_its_class_and_retry_hint(
    redis_server: RedisServer, new_store: NewStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = new_store(capacity=2, ttl_seconds=60)
    pending = pb.ClassifyResponse(request_id="e", status=pb.RESULT_STATUS_PROCESSING)
    held = {}
    for request_id in ("e", "f", "g"):  # capacity 2: "e", the oldest, is dropped
        token = await store.hold(request_id, pending)
        assert token is not None
        held[request_id] = token
    refused = QueueFull("the queue is full", retry_after_seconds=0.25, model="m")
    await store.finish("g", held["g"], error=refused)
    with pytest.raises(QueueFull) as stored:
        await store.get("g")
    assert status_for(stored.value) == status_for(refused)
    await store.finish("e", held["e"], response=pending)  # dropped: not written, and said so
    assert "result not stored: its entry is gone" in caplog.text
    # Outside a call the tenant is the anonymous one; keys name tenant and request.
    assert redis_server.command("EXISTS", "classify:v1:result:anonymous/e") == ":0"
    assert redis_server.command("EXISTS", "classify:v1:result:anonymous/g") == ":1"
    assert redis_server.command("ZCARD", "classify:v1:results") == ":2"
    # The dropped result's token and process went with it.
    assert redis_server.command("EXISTS", "classify:v1:result-token:anonymous/e") == ":0"
    assert redis_server.command("EXISTS", "classify:v1:result-token:anonymous/g") == ":1"
    assert redis_server.command("EXISTS", "classify:v1:result-process:anonymous/e") == ":0"
    assert redis_server.command("EXISTS", "classify:v1:result-process:anonymous/f") == ":1"
    # A finished result names no process any more (_FINISH says why).
    assert redis_server.command("EXISTS", "classify:v1:result-process:anonymous/g") == ":0"
    redis_server.stop()
    assert await store.hold("h", pending) is None
    with pytest.raises(StateUnavailable):
        await store.get("f")


@pytest.mark.parametrize("shared", [False, True], ids=["local", "redis"])
async def test_on_a_tie_the_oldest_result_goes_never_the_one_just_held(
    new_store: NewStore, shared: bool
) -> None:
    """Three tenants hold one result each in a store for two. The Redis store dropped
    the tenant last in the alphabet on a tie: here, the result just held, its caller
    told PROCESSING for a result already gone (and the local store kept it)."""
    store = new_store(capacity=2, ttl_seconds=60) if shared else LocalResultStore(capacity=2)
    pending = pb.ClassifyResponse(status=pb.RESULT_STATUS_PROCESSING)
    for tenant in ("a", "b", "c"):
        with as_tenant(tenant):
            assert await store.hold(f"{tenant}-1", pending) is not None
    with as_tenant("a"), pytest.raises(ResultNotFound):
        await store.get("a-1")
    for tenant in ("b", "c"):
        with as_tenant(tenant):
            assert (await store.get(f"{tenant}-1")).status == pb.RESULT_STATUS_PROCESSING


async def test_a_later_call_with_the_same_request_id_keeps_its_place_in_redis(
    new_store: NewStore, caplog: pytest.LogCaptureFixture
) -> None:
    """As in the local store: the earlier call's outcome does not answer the later's
    polls (nor is it logged as lost: it was replaced, as documented)."""
    store = new_store(capacity=10, ttl_seconds=60)
    processing, done = pb.RESULT_STATUS_PROCESSING, pb.RESULT_STATUS_DONE
    earlier = await store.hold("r", pb.ClassifyResponse(trace_id="1", status=processing))
    later = await store.hold("r", pb.ClassifyResponse(trace_id="2", status=processing))
    assert earlier is not None
    assert later is not None
    await store.finish("r", earlier, response=pb.ClassifyResponse(trace_id="1", status=done))
    assert ((await store.get("r")).trace_id, (await store.get("r")).status) == ("2", processing)
    await store.finish("r", later, response=pb.ClassifyResponse(trace_id="2", status=done))
    assert ((await store.get("r")).trace_id, (await store.get("r")).status) == ("2", done)
    assert "result not stored" not in caplog.text


# Leases: each process renews its own, so the results of one that died are given up.

# Leases the stores of a test take (renewed every quarter of that).
LEASE_SECONDS = 0.4


async def test_a_living_process_keeps_its_results_processing_past_its_lease(
    new_store: NewStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Renewed every 0.1 s: a stall of the shared machine must not lapse it here.
    monkeypatch.setattr(state_results, "PROCESS_LEASE_RENEWALS", 10)
    holder = new_store(capacity=10, ttl_seconds=60, lease_seconds=1.0)
    poller = new_store(capacity=10, ttl_seconds=60, lease_seconds=1.0)
    token = await holder.hold("alive", pb.ClassifyResponse(trace_id="t", status=PROCESSING))
    assert token is not None
    await asyncio.sleep(2.3)  # past two leases: renewed, not lapsed
    assert (await poller.get("alive")).status == PROCESSING
    await holder.finish("alive", token, response=pb.ClassifyResponse(status=DONE))
    assert (await poller.get("alive")).status == DONE


async def test_a_result_whose_process_stopped_renewing_is_answered_send_again(
    new_store: NewStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The holder stops renewing with the result unwritten: its own polls still say
    PROCESSING, but another process's answer SERVER_DRAINING with the trace the work
    ran in, and log which process held it."""
    holder = new_store(capacity=10, ttl_seconds=60, lease_seconds=LEASE_SECONDS)
    poller = new_store(capacity=10, ttl_seconds=60, lease_seconds=LEASE_SECONDS)
    pending = pb.ClassifyResponse(trace_id="abc", status=PROCESSING)
    assert await holder.hold("orphan", pending) is not None
    assert holder._renewing_lease is not None
    holder._renewing_lease.cancel()  # as a process that died: its lease stays, unrenewed
    assert (await poller.get("orphan")).status == PROCESSING  # still within the lease

    async def lease_lapsed() -> bool:
        try:
            await poller.get("orphan")
        except ServerDraining:
            return True
        return False

    await wait_until(lease_lapsed, "the result given up once the lease lapsed")
    assert (await holder.get("orphan")).status == PROCESSING
    with pytest.raises(ServerDraining) as given_up:
        await poller.get("orphan")
    assert given_up.value.context == {"result_trace_id": "abc"}
    assert grpc_code_for(given_up.value) == grpc.StatusCode.UNAVAILABLE
    given_up_lines = [r for r in caplog.records if r.message.startswith("result given up")]
    assert given_up_lines
    assert {vars(r)["holding_process"] for r in given_up_lines} == {holder.process_id}


async def hold_as_the_last_version(state: RedisState, request_id: str, token: str) -> None:
    """What an orchestrator of the last version writes for a held result of the
    anonymous tenant (its value and token; no process)."""
    member = f"anonymous/{request_id}"
    pending = pb.ClassifyResponse(trace_id=token, status=PROCESSING).SerializeToString()
    await state.client.set(RESULT_PREFIX + member, PENDING + pending, px=60_000)
    await state.client.set(RESULT_TOKEN_PREFIX + member, token, px=60_000)


async def test_the_last_versions_pending_results_stay_processing_until_their_ttl(
    redis_state: RedisState, new_store: NewStore
) -> None:
    """A rolling upgrade: a result the last version holds names no process, and one it
    held again after this version did names another call's token; neither is given up,
    whatever the leases (the TTL bounds them, as before)."""
    store = new_store(capacity=10, ttl_seconds=60, lease_seconds=LEASE_SECONDS)
    stopped = new_store(capacity=10, ttl_seconds=60, lease_seconds=LEASE_SECONDS)
    await hold_as_the_last_version(redis_state, "old", "o")
    assert await stopped.hold("again", pb.ClassifyResponse(status=PROCESSING)) is not None
    await stopped.close()
    await hold_as_the_last_version(redis_state, "again", "later")
    # The stopped process's lease ended with it (close).
    assert await redis_state.client.get(PROCESS_LEASE_PREFIX + stopped.process_id) is None
    assert [(await store.get(r)).status for r in ("old", "again")] == [PROCESSING] * 2


async def test_a_finished_result_names_no_process_for_an_older_hold_to_inherit(
    redis_state: RedisState, new_store: NewStore
) -> None:
    """An orchestrator from before the hold tokens writes only the value: holding a
    request ID again after this one finished it, its live work must not be taken for
    this process's, given up once this process's lease has gone."""
    finished, poller = (
        new_store(capacity=10, ttl_seconds=60),
        new_store(capacity=10, ttl_seconds=60),
    )
    token = await finished.hold("r", pb.ClassifyResponse(status=PROCESSING))
    assert token is not None
    await finished.finish("r", token, response=pb.ClassifyResponse(status=DONE))
    await finished.close()  # its lease ends
    again = pb.ClassifyResponse(trace_id="older", status=PROCESSING).SerializeToString()
    await redis_state.client.set(RESULT_PREFIX + "anonymous/r", PENDING + again, px=60_000)
    assert (await poller.get("r")).status == PROCESSING


async def test_a_hold_whose_answer_was_lost_is_marked_not_kept_not_left_pending(
    redis_server: RedisServer, redis_state: RedisState, new_store: NewStore
) -> None:
    """Redis stalled as a place was held: the hold timed out (its caller answered
    directly, nothing to store), and Redis ran it once it resumed. Polls answered
    PROCESSING for a result no one would fill, until the holder's lease lapsed (and
    for as long as its other results kept the lease renewed)."""
    holder = new_store(capacity=10, ttl_seconds=60)
    poller_state = RedisState.from_settings(
        orchestrator_settings(state_url=redis_server.url), StateMetrics(CollectorRegistry())
    )
    poller = RedisResultStore(poller_state, capacity=10, ttl_seconds=60)
    # A pooled connection, and the scripts loaded (as check_at_start loads them): a
    # hold sent to a Redis that lacks its script runs nothing.
    assert await holder.hold("first", pb.ClassifyResponse(status=PROCESSING)) is not None
    redis_server.pause()
    try:
        assert await holder.hold("lost", pb.ClassifyResponse(status=PROCESSING)) is None
    finally:
        redis_server.resume()

    async def marked_not_kept() -> bool:
        try:
            await poller.get("lost")
        except ResultNotFound as refused:
            return "answered directly" in refused.message
        return False

    try:
        await wait_until(marked_not_kept, "the place marked not kept")
    finally:
        await poller.close()
        await poller_state.close()


async def test_a_graceful_stop_ends_the_lease_at_once(new_store: NewStore) -> None:
    """A result still pending when its process stops gracefully (Redis did not take
    its outcome) has nothing behind it: polls say so at once, not a lease later."""
    holder, poller = new_store(capacity=10, ttl_seconds=60), new_store(capacity=10, ttl_seconds=60)
    assert await holder.hold("left", pb.ClassifyResponse(trace_id="x", status=PROCESSING))
    await holder.close()
    with pytest.raises(ServerDraining):
        await poller.get("left")


async def test_the_last_version_reads_the_pending_value_this_one_writes(
    redis_state: RedisState, new_store: NewStore
) -> None:
    """The value is still the kind byte and the serialized pending response, as the last
    version's GET parses it: who holds it is in keys of their own."""
    pending = pb.ClassifyResponse(request_id="v", trace_id="t", status=PROCESSING, route="r")
    assert await new_store(capacity=10, ttl_seconds=60).hold("v", pending) is not None
    value = await redis_state.client.get(RESULT_PREFIX + "anonymous/v")
    assert isinstance(value, bytes)
    assert (value[:1], pb.ClassifyResponse.FromString(value[1:])) == (PENDING, pending)


async def held_counts(state: RedisState) -> dict[str, float]:
    """How many results each tenant holds, as the Redis store counts them."""
    held: list[tuple[bytes, float]] = await state.client.zrange(
        TENANT_COUNTS, 0, -1, withscores=True
    )  # type: ignore[assignment]
    return {tenant.decode(): count for tenant, count in held}


async def test_redis_store_drops_expired_results_first_then_the_largest_tenants_oldest(
    redis_server: RedisServer, redis_state: RedisState, new_store: NewStore
) -> None:
    store = new_store(capacity=3, ttl_seconds=1)
    pending = pb.ClassifyResponse(status=pb.RESULT_STATUS_PROCESSING)

    with as_tenant("zenith"):
        await store.hold("z-old", pending)
    await asyncio.sleep(1.05)  # z-old expires
    with as_tenant("acme"):
        for request_id in ("a-1", "a-2", "a-3"):
            await store.hold(request_id, pending)
    assert redis_server.command("ZCARD", "classify:v1:results:zenith") == ":0"
    with as_tenant("zenith"):
        await store.hold("z-1", pending)  # acme holds the most: a-1 goes
    assert redis_server.command("ZCARD", "classify:v1:results") == ":3"
    assert redis_server.command("EXISTS", "classify:v1:result:acme/a-1") == ":0"
    with as_tenant("acme"):
        with pytest.raises(ResultNotFound):
            await store.get("a-1")
        assert (await store.get("a-2")).status == pb.RESULT_STATUS_PROCESSING
    assert await held_counts(redis_state) == {"acme": 2, "zenith": 1}
    # A result an older version held is in the shared index only: it goes first.
    store = new_store(capacity=3, ttl_seconds=60)
    redis_server.command("FLUSHALL")
    held_at_ms = str(int(time.time() * 1000) - 100)  # before the holds below
    redis_server.command("ZADD", "classify:v1:results", held_at_ms, "old/o-1")
    redis_server.command("SET", "classify:v1:result:old/o-1", "P")
    with as_tenant("acme"):
        for request_id in ("a-4", "a-5", "a-6"):
            await store.hold(request_id, pending)
    assert redis_server.command("EXISTS", "classify:v1:result:old/o-1") == ":0"
    assert await held_counts(redis_state) == {"acme": 3}


async def test_a_tenant_whose_results_expired_is_not_counted_as_still_holding_them(
    redis_server: RedisServer, redis_state: RedisState, new_store: NewStore
) -> None:
    """A tenant's own index expires with its last result, before the shared index lets
    go of that result: its count must go down all the same, or its next result is the
    first pushed out by another tenant's burst."""
    store = new_store(capacity=3, ttl_seconds=2)
    pending = pb.ClassifyResponse(status=pb.RESULT_STATUS_PROCESSING)

    with as_tenant("zenith"):
        for request_id in ("z-1", "z-2"):
            await store.hold(request_id, pending)
    await asyncio.sleep(1.1)
    with as_tenant("other"):  # keeps the shared keys alive past zenith's results
        await store.hold("o-1", pending)
    await asyncio.sleep(1.0)  # zenith's results and its own index expire
    with as_tenant("acme"):
        await store.hold("a-0", pending)
    assert await held_counts(redis_state) == {"acme": 1, "other": 1}
    with as_tenant("zenith"):
        await store.hold("z-3", pending)
    with as_tenant("acme"):
        for request_id in ("a-1", "a-2"):  # acme's burst pushes out its own
            await store.hold(request_id, pending)
    with as_tenant("zenith"):
        assert (await store.get("z-3")).status == pb.RESULT_STATUS_PROCESSING
    assert await held_counts(redis_state) == {"acme": 1, "other": 1, "zenith": 1}


async def test_first_command_after_redis_returns_is_answered_by_it(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    """A process that made no call while Redis was away still holds a connection to
    the Redis that went: its first command afterwards goes out on a new one."""
    server = await start_shared(capability, burst=4)
    await classify(server)  # leaves a pooled connection to this Redis
    redis_server.stop()
    redis_server.start()
    await classify(server)
    assert state_failures(server, "rate_limit") == 0
    answered = metric_sum(
        server.registry, STATE_OPERATIONS_TOTAL, operation="rate_limit", outcome="ok"
    )
    assert answered == 2


# Short and long outages, and a Redis that refuses: what is kept, said and counted.


async def stored_status(state: RedisState, request_id: str) -> pb.ResultStatus.ValueType:
    """The status in Redis of the anonymous tenant's result, read past the rest window."""
    value = await state.client.get(f"classify:v1:result:anonymous/{request_id}")
    assert isinstance(value, bytes)
    return pb.ClassifyResponse.FromString(value[1:]).status


async def finish_while_stalled(
    redis_server: RedisServer, store: RedisResultStore, request_ids: list[str]
) -> None:
    """Hold each result, then finish each while Redis is stalled (the first finish times
    out, the others are skipped), and let Redis answer again."""
    tokens = [
        await store.hold(request_id, pb.ClassifyResponse(status=PROCESSING))
        for request_id in request_ids
    ]
    redis_server.pause()
    try:
        for request_id, token in zip(request_ids, tokens, strict=True):
            assert token is not None
            done = pb.ClassifyResponse(request_id=request_id, status=DONE)
            await store.finish(request_id, token, response=done)
    finally:
        redis_server.resume()


async def test_an_outcome_finished_during_a_stall_is_stored_once_redis_answers(
    redis_server: RedisServer, redis_state: RedisState
) -> None:
    """The audit's lost finish: without the retry, polls saw PROCESSING for the TTL."""
    store = RedisResultStore(redis_state, capacity=10, ttl_seconds=60, retry_max_seconds=0.2)
    await finish_while_stalled(redis_server, store, ["r-1", "r-2"])
    assert store.unstored == 2
    # Stored within the 1 s rest after the failure: the retries do not wait it out.
    loop = asyncio.get_running_loop()
    resumed = loop.time()
    await wait_until(lambda: store.unstored == 0, "both outcomes stored", limit_seconds=5)
    assert loop.time() - resumed < 0.9
    assert [await stored_status(redis_state, r) for r in ("r-1", "r-2")] == [DONE, DONE]
    await store.close()


async def test_a_graceful_stop_tries_once_more_to_store_kept_outcomes(
    redis_server: RedisServer, redis_state: RedisState, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_results, "UNSTORED_RETRY_INITIAL_SECONDS", 3600.0)
    store = RedisResultStore(redis_state, capacity=10, ttl_seconds=60, retry_max_seconds=3600)
    await finish_while_stalled(redis_server, store, ["s-1"])
    assert store.unstored == 1  # the retry task sleeps for up to an hour
    await store.close()
    assert store.unstored == 0
    assert await stored_status(redis_state, "s-1") == DONE


async def test_kept_outcomes_are_bounded_the_oldest_let_go_first(
    redis_server: RedisServer,
    redis_state: RedisState,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(state_results, "MAX_UNSTORED_RESULTS", 2)
    store = RedisResultStore(redis_state, capacity=10, ttl_seconds=60, retry_max_seconds=0.2)
    await finish_while_stalled(redis_server, store, ["b-1", "b-2", "b-3"])
    assert store.unstored == 2
    assert "too many results wait to be stored again" in caplog.text
    await wait_until(lambda: store.unstored == 0, "the kept outcomes stored", limit_seconds=5)
    statuses = [await stored_status(redis_state, r) for r in ("b-1", "b-2", "b-3")]
    assert statuses == [PROCESSING, DONE, DONE]
    await store.close()


async def test_state_unavailable_carries_the_time_left_before_redis_is_asked_again(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    """A client that honours RetryInfo polls again when the server will ask Redis,
    not into the rest window, where it would fail unasked."""
    server = await start_shared(capability, burst=100, state_retry_seconds=5)
    redis_server.stop()
    failed = await refusal(get_result(server, "anything"))  # the rate limit failed first
    assert error_reason(failed) == "STATE_UNAVAILABLE"
    assert 4 < retry_delay_seconds(failed) <= 5
    await asyncio.sleep(0.5)
    skipped = await refusal(get_result(server, "anything"))
    assert error_reason(skipped) == "STATE_UNAVAILABLE"
    assert 3.5 < retry_delay_seconds(skipped) < retry_delay_seconds(failed) - 0.4


async def test_while_redis_is_away_each_process_grants_its_share_of_a_tenants_bucket(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    """Two processes share the Redis: each falls back to half the burst (and rate), so
    together they grant about what the one bucket would, not twice it."""
    server = await start_shared(capability, burst=4, state_processes=2)
    redis_server.stop()
    codes = [await code_of(classify(server)) for _ in range(3)]
    assert codes == [grpc.StatusCode.OK] * 2 + [grpc.StatusCode.RESOURCE_EXHAUSTED]


def test_the_processes_sharing_redis_default_to_the_sets_count_in_each_worker() -> None:
    settings = orchestrator_settings(state_url="redis://127.0.0.1:6379/0", processes=3)
    assert settings.state_processes == 3
    worker = one_worker_of(settings, port=50051)
    assert (worker.processes, worker.state_processes) == (1, 3)
    across_hosts = replace(settings, state_processes=12)
    assert one_worker_of(across_hosts, port=50051).state_processes == 12


async def test_state_up_follows_the_probe_while_no_call_needs_redis(
    capability: CapabilityServer, start_shared: StartShared, redis_server: RedisServer
) -> None:
    """No call is made: the gauge alone says Redis went and came back."""
    server = await start_shared(capability, state_retry_seconds=0.05)
    assert metric_sum(server.registry, STATE_UP) == 1
    redis_server.stop()
    await wait_until(lambda: metric_sum(server.registry, STATE_UP) == 0, "state_up 0")
    redis_server.start()
    await wait_until(lambda: metric_sum(server.registry, STATE_UP) == 1, "state_up 1 again")


def unstarted_orchestrator(tmp_path: Path, state_url: str | None) -> OrchestratorServer:
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\nbackends:\n  model: {model: topic-static, targets: ['127.0.0.1:1']}\n"
        "routes:\n  - name: default\n    backend: model\n"
    )
    settings = orchestrator_settings(routes_file=routes, state_url=state_url)
    return OrchestratorServer(settings, registry=CollectorRegistry())


async def test_an_orchestrator_without_redis_exports_no_state_up(tmp_path: Path) -> None:
    """Exported at 0 by every orchestrator, it paged ClassifySharedStateUnavailable for
    each one that has no Redis at all."""
    server = unstarted_orchestrator(tmp_path, None)
    names = {sample.name for family in server.registry.collect() for sample in family.samples}
    assert STATE_UP not in names


@pytest.mark.parametrize(
    "form", ["redis://:S3cret@127.0.0.1:{port}/0", "redis://127.0.0.1:{port}/0?password=S3cret"]
)
async def test_the_redis_url_is_logged_without_its_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, form: str
) -> None:
    """redis-py reads a password from the URL's query too; the start-up warning logged
    the URL whole but for what came before an @."""
    port = closed_port()
    server = unstarted_orchestrator(tmp_path, form.format(port=port))
    await server.start()
    try:
        [warning] = [
            r
            for r in caplog.records
            if r.getMessage() == "shared state store did not answer at start"
        ]
    finally:
        await server.stop(grace_seconds=0)
    assert vars(warning)["url"] == f"redis://127.0.0.1:{port}/0"
    assert "S3cret" not in caplog.text


async def test_a_cancelled_command_stays_cancelled_though_the_client_made_it_an_error(
    redis_state: RedisState,
) -> None:
    """A client library that turns a cancellation into its own error (here a stand-in
    for one: nothing real does it on demand) made run() count it as Redis failing:
    the probe and the lease's renewal went on, and the close() awaiting them hung a
    test run's teardown until CI's limit."""
    started = asyncio.Event()

    async def turns_cancel_into_an_error() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RedisConnectionError("Connection closed by server.") from None

    running = asyncio.ensure_future(redis_state.run("ping", turns_cancel_into_an_error))
    await started.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


def test_the_backoff_between_tries_to_store_again_stops_growing_at_its_longest() -> None:
    """2**n of the failed tries in a row, uncapped, overflowed a float after about 1,024
    (an outage of minutes), and the task storing kept outcomes again died."""
    assert [backoff_ceiling(tries, 1.0) for tries in (0, 1, 3, 5)] == [0.05, 0.1, 0.4, 1.0]
    assert backoff_ceiling(5_000, 1.0) == 1.0


@pytest.mark.parametrize(
    ("credentials", "database", "cause"),
    [
        (":wrong@", "0", "AuthenticationError: invalid username-password pair"),
        (":sekret@", "99", "ResponseError: DB index is out of range"),
    ],
)
async def test_a_redis_that_refuses_the_connection_stops_start_up_naming_the_settings(
    tmp_path: Path, redis_server: RedisServer, credentials: str, database: str, cause: str
) -> None:
    """A wrong password or database number never mends itself: not served degraded."""
    assert redis_server.command("CONFIG", "SET", "requirepass", "sekret") == "+OK"
    url = f"redis://{credentials}127.0.0.1:{redis_server.port}/{database}"
    server = unstarted_orchestrator(tmp_path, url)
    try:
        with pytest.raises(SettingsError) as refused:
            await server.start()
    finally:
        await server.state.close()
    assert SettingsError in START_ERRORS  # one line on stderr and exit status 2
    message = str(refused.value)
    assert message.startswith("--state-url / ORCHESTRATOR_STATE_URL: Redis refused")
    assert cause in message
    assert "--state-password-file" in message
    assert "sekret" not in message
    assert "wrong" not in message


@pytest.mark.parametrize(
    ("setup", "user", "cause"),
    [
        (
            ("ACL", "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", "-@scripting"),
            "limited:pw@",
            "NoPermissionError: this user has no permissions to run the 'script|load' command",
        ),
        (("REPLICAOF", "127.0.0.1", "1"), "", "ReadOnlyError: You can't write against a read only"),
    ],
    ids=["user_without_scripting", "read_only_replica"],
)
async def test_a_redis_that_refuses_the_commands_calls_need_stops_start_up(
    tmp_path: Path, redis_server: RedisServer, setup: tuple[str, ...], user: str, cause: str
) -> None:
    """A PING alone passed for these; then every rate-limit check was refused (NOPERM,
    READONLY) and fell back to the process's share for as long as it ran."""
    assert redis_server.command(*setup) == "+OK"
    server = unstarted_orchestrator(tmp_path, f"redis://{user}127.0.0.1:{redis_server.port}/0")
    try:
        with pytest.raises(SettingsError) as refused:
            await server.start()
    finally:
        await server.state.close()
    message = str(refused.value)
    assert message.startswith("--state-url / ORCHESTRATOR_STATE_URL: Redis refused")
    assert cause in message
    assert "may run scripts" in message


async def test_the_password_file_wins_over_a_password_in_the_url(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """redis-py's from_url lets the URL's options override those passed to it: the
    URL's old password was sent, and a rotated one in --state-password-file ignored."""
    assert redis_server.command("CONFIG", "SET", "requirepass", "newpw") == "+OK"
    password_file = tmp_path / "state-password"
    password_file.write_text("newpw\n")
    settings = orchestrator_settings(
        state_url=f"redis://:oldpw@127.0.0.1:{redis_server.port}/0",
        state_password_file=password_file,
    )
    state = RedisState.from_settings(settings, StateMetrics(CollectorRegistry()))
    try:
        assert await state.check_at_start() is True
        assert await state.run("ping", state.client.ping) is True
    finally:
        await state.close()


async def test_a_refused_command_says_so_and_its_cause_is_logged_with_its_message(
    redis_state: RedisState, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "orchestrator.state.connection")
    client = redis_state.client
    await client.set("classify:v1:a-string", "v")
    with pytest.raises(StateUnavailable) as refused:  # a hash command on a string
        await redis_state.run("result_get", lambda: client.hgetall("classify:v1:a-string"))
    assert refused.value.message == "the shared state store refused the command (error)"
    (record,) = [r for r in caplog.records if r.getMessage() == "shared state store failed"]
    assert record.__dict__["error"].startswith("ResponseError: WRONGTYPE Operation against a key")


async def test_a_deadline_just_past_the_budget_is_answered_processing_with_redis(
    capability: CapabilityServer, start_shared: StartShared
) -> None:
    """A 300 ms deadline on a 200 ms budget: the budget comes first, so the answer is
    PROCESSING at 200 ms. Counting the store's 100 ms to hold a place into which came
    first made it DEADLINE_EXCEEDED (result kept) at 280 ms."""
    server = await start_shared(capability, model="topic-minilm", burst=100)
    async with device_occupied(capability.pool.workers[0]):
        answer = await classify(server, request_id="processing-1", within=0.3)
    assert (answer.status, answer.request_id) == (PROCESSING, "processing-1")


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # A rate cut: the bucket the limit before set to lapse 1.5 s on came back full.
        (TokenBucketSettings(200, 100), TokenBucketSettings(0.01, 100)),
        # A burst raised: the same, with the whole new burst granted.
        (TokenBucketSettings(200, 100), TokenBucketSettings(0.01, 1000)),
    ],
    ids=["rate-cut", "burst-raised"],
)
async def test_an_edited_limit_rebases_the_tenants_redis_bucket(
    redis_server: RedisServer, before: TokenBucketSettings, after: TokenBucketSettings
) -> None:
    """As in one process: the bucket keeps what it held, refilled at the limit before
    up to the edit, capped at the new burst; not a full bucket once the key, set to
    lapse when the limit before would have filled it, had lapsed."""
    registry = CollectorRegistry()
    state = RedisState.from_settings(
        orchestrator_settings(state_url=redis_server.url), StateMetrics(registry)
    )
    tenant = f"edited-{after.burst}"
    limits = RedisRateLimits(state, {tenant: before}, sharers=1)
    try:
        assert (await limits.try_acquire(tenant, 100))[1] == 100
        limits.set_limits({tenant: after})
        await asyncio.sleep(1.6)  # past the lapse the limit before set
        granted = (await limits.try_acquire(tenant, 1000))[1]
    finally:
        await state.close()
    # What 200 a second refilled between the spending and the rebase (milliseconds;
    # 50 would take a quarter of a second), not the 100 or 1,000 of a new bucket.
    assert granted < 50
    edits = metric_sum(registry, STATE_OPERATIONS_TOTAL, operation="rate_limit_edit", outcome="ok")
    assert edits == 1


async def test_a_bucket_that_takes_ages_to_refill_is_kept_in_redis(
    redis_server: RedisServer,
) -> None:
    """Its key lapses once the bucket would be full again: a million calls spent at one
    every three years (1e-8 a second) is 10^17 ms, which Redis reads as `1e+17` (it
    reads a Lua number handed to a command as its text), no integer to PEXPIRE: every
    check of the bucket failed, and the tenant's calls went by the process's share.
    The lapse is capped."""
    registry = CollectorRegistry()
    state = RedisState.from_settings(
        orchestrator_settings(state_url=redis_server.url), StateMetrics(registry)
    )
    limits = RedisRateLimits(state, {"patient": TokenBucketSettings(1e-8, 10**6)}, sharers=1)
    try:
        assert (await limits.try_acquire("patient", 10**6))[1] == 10**6
        assert (await limits.try_acquire("patient", 1))[1] == 0  # spent, for three years
        limits.set_limits({"patient": TokenBucketSettings(1e-9, 10**6)})  # rebased
        await wait_until(
            lambda: metric_sum(registry, STATE_OPERATIONS_TOTAL, operation="rate_limit_edit") == 1,
            "the rebase",
        )
        lapse_ms = await state.client.pttl(BUCKET_PREFIX + "patient")
    finally:
        await state.close()
    assert 0 < lapse_ms <= MAX_BUCKET_LAPSE_MS
    outcomes = {
        (s.labels["operation"], s.labels["outcome"]): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == STATE_OPERATIONS_TOTAL and s.value
    }
    assert outcomes == {("rate_limit", "ok"): 2, ("rate_limit_edit", "ok"): 1}


async def test_calls_too_hurried_to_ask_redis_are_paid_for_by_its_bucket_later(
    redis_server: RedisServer,
) -> None:
    """A call with under 30 ms left is not sent to Redis and takes a token from the
    process's stand-in bucket instead. Redis's bucket never paid for it, so a tenant
    that spent its stand-in share with such deadlines, then its Redis bucket with
    ordinary ones, got twice its burst (a review helper: 6 calls past a burst of 3)."""
    state = RedisState.from_settings(
        orchestrator_settings(state_url=redis_server.url), StateMetrics(CollectorRegistry())
    )
    limits = RedisRateLimits(state, {"t": TokenBucketSettings(0.001, 3)}, sharers=1)

    async def granted(time_left: float) -> int:
        async def acquire() -> int:
            bind_time_left_on_arrival(time_left)
            return (await limits.try_acquire("t"))[1]

        return await asyncio.get_running_loop().create_task(acquire())

    try:
        hurried = [await granted(0.02) for _ in range(4)]
        patient = [await granted(5.0) for _ in range(4)]
    finally:
        await state.close()
    assert hurried == [1, 1, 1, 0]  # the stand-in share: all of the burst, one process
    assert patient == [0, 0, 0, 0]  # Redis's bucket paid for those three first

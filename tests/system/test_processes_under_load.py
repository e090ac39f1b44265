"""Issue 16's acceptance over real processes and a real Redis: three orchestrator
workers on one port (`--processes 3`) sharing one Redis, driven from several
connections at once.

Which worker served a call is read from the log: every line a worker writes
carries its index (`worker`), and a call's access line its request ID. A
channel here is opened with its own subchannel pool, so each is one TCP
connection of its own (gRPC otherwise shares one connection between channels
to the same address) and the kernel picks a worker for each.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from orchestrator.security import hash_key, new_key
from orchestrator.state.connection import STATE_OPERATIONS_TOTAL
from orchestrator.workers import WORKER_RESTARTS_TOTAL, WORKERS
from tests.conftest import (
    BUDGETED_MODEL,
    STACK_API_KEY,
    STATIC_ONLY_FLAGS,
    STRIKER,
    RedisServer,
    ServerProcess,
    Stack,
    processing_routes,
    wait_until,
)
from tests.status_details import error_reason, refusal
from tests.system.test_metrics_scrape import Scrape, samples, value
from tests.system.test_processes import CLASSIFY, every_worker_logged, worker_pids

GET_RESULT = "/ai.classify.v1.ClassifyService/GetResult"
PROCESSES = 3
# Tenant `stack` (STACK_API_KEY) has a limit no test reaches, so that every call
# it makes asks Redis for a token (a tenant without a limit never does).
HUNDRED_KEY = new_key()  # tenant `hundred`: 100 calls a second, a burst of 10
HUNDRED_RATE = 100
HUNDRED_BURST = 10
FEW_KEY = new_key()  # tenant `few`: FEW_BURST calls, next to no refill
FEW_BURST = 6
# How long a load connection waits after an UNAVAILABLE before its next call.
UNAVAILABLE_PAUSE_SECONDS = 0.05
# A channel that is one TCP connection of its own.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def start_three_workers(
    start_stack: Callable[..., Stack],
    redis_server: RedisServer,
    tmp_path: Path,
    *flags: str,
) -> Stack:
    """topic-static (so the capability server is never the bottleneck) behind
    PROCESSES workers sharing `redis_server`; routes as `processing_routes`."""
    keys = tmp_path / "acceptance-keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{id: s, sha256: {hash_key(STACK_API_KEY)}, tenant: stack, role: user}}\n"
        f"  - {{id: h, sha256: {hash_key(HUNDRED_KEY)}, tenant: hundred, role: user}}\n"
        f"  - {{id: f, sha256: {hash_key(FEW_KEY)}, tenant: few, role: user}}\n"
        "tenants:\n"
        "  stack: {rate_per_second: 100000, burst: 100000}\n"
        f"  hundred: {{rate_per_second: {HUNDRED_RATE}, burst: {HUNDRED_BURST}}}\n"
        f"  few: {{rate_per_second: 0.001, burst: {FEW_BURST}}}\n"
    )
    return start_stack(
        api_key=STACK_API_KEY,
        routes=processing_routes,
        capability_flags=STATIC_ONLY_FLAGS,
        orchestrator_flags=(
            *("--processes", str(PROCESSES), "--state-url", redis_server.url),
            # Long: on a busy test machine a Redis round trip can take longer than the
            # default, and the check would then fall back to the process's own bucket.
            *("--state-timeout-ms", "5000"),
            *("--api-keys-file", str(keys)),
            *flags,
        ),
    )


def stub_for(channel: grpc.aio.Channel) -> classify_service_pb2_grpc.ClassifyServiceAsyncStub:
    return classify_service_pb2_grpc.ClassifyServiceStub(channel)


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


async def code_of(call: Awaitable[object]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def access_lines(orchestrator: ServerProcess, method: str, request_id: str) -> list[dict[str, Any]]:
    return [
        line
        for line in orchestrator.log_lines()
        if line.get("event") == "rpc"
        and line.get("method") == method
        and line.get("request_id") == request_id
    ]


async def worker_that_logged(orchestrator: ServerProcess, method: str, request_id: str) -> int:
    """The worker whose access line for `request_id` is the latest (waits for it)."""
    await wait_until(lambda: access_lines(orchestrator, method, request_id), request_id)
    return int(access_lines(orchestrator, method, request_id)[-1]["worker"])


async def classify_once(
    port: int, request_id: str, key: str = STACK_API_KEY, model: str = ""
) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION) as channel:
        response: pb.ClassifyResponse = await stub_for(channel).Classify(
            pb.ClassifyRequest(text=STRIKER, request_id=request_id, model=model),
            metadata=bearer(key),
            wait_for_ready=True,
            timeout=30,
        )
        return response


async def get_result_once(port: int, request_id: str) -> pb.ClassifyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION) as channel:
        response: pb.ClassifyResponse = await stub_for(channel).GetResult(
            pb.GetResultRequest(request_id=request_id),
            metadata=bearer(STACK_API_KEY),
            wait_for_ready=True,
            timeout=30,
        )
        return response


async def polled_to_done_on_other_workers(orchestrator: ServerProcess, request_id: str) -> None:
    """A budgeted call answered PROCESSING by one worker is polled, each poll on a
    new connection, until DONE answers have come from at least two workers, one of
    them not the worker that answered PROCESSING."""
    port = orchestrator.port
    answer = await classify_once(port, request_id, model=BUDGETED_MODEL)
    assert answer.status == pb.RESULT_STATUS_PROCESSING
    origin = await worker_that_logged(orchestrator, CLASSIFY, request_id)
    polls: list[tuple[int, pb.ClassifyResponse]] = []
    done_by: set[int] = set()
    while len(done_by) < 2 or not done_by - {origin}:
        assert len(polls) < 40, f"polls all landed on the same workers: {polls}"
        polled = await get_result_once(port, request_id)
        # Polls carry the polled request ID: the access lines of this ID's polls are
        # told apart by their count (one poll at a time, each waited for).
        await wait_until(
            lambda: len(access_lines(orchestrator, GET_RESULT, request_id)) == len(polls) + 1,
            "the poll's access line",
        )
        worker = int(access_lines(orchestrator, GET_RESULT, request_id)[-1]["worker"])
        polls.append((worker, polled))
        if polled.status == pb.RESULT_STATUS_DONE:
            assert (polled.request_id, polled.trace_id) == (request_id, answer.trace_id)
            assert polled.labels[0].name == "sports"
            done_by.add(worker)
        else:
            assert polled.status == pb.RESULT_STATUS_PROCESSING
            assert not done_by, "a poll went back from DONE to PROCESSING"


async def test_a_processing_answer_is_polled_to_done_through_connections_on_other_workers(
    start_stack: Callable[..., Stack], redis_server: RedisServer, tmp_path: Path
) -> None:
    stack = start_three_workers(start_stack, redis_server, tmp_path)
    await every_worker_logged(stack.orchestrator, PROCESSES)
    await polled_to_done_on_other_workers(stack.orchestrator, "polled-1")


@dataclass(frozen=True)
class Outcome:
    connection: int
    sent: float  # this process's monotonic clock when the call was sent
    code: grpc.StatusCode


class Load:
    """Calls from `connections` connections of their own, `in_flight` at a time on
    each, until stop(); every call's outcome kept."""

    def __init__(
        self, orchestrator: ServerProcess, key: str, *, connections: int, in_flight: int, tag: str
    ) -> None:
        self._orchestrator = orchestrator
        self.channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}", options=OWN_CONNECTION)
            for _ in range(connections)
        ]
        self.outcomes: list[Outcome] = []
        self._key = key
        self._in_flight = in_flight
        self._tag = tag
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sent = 0

    async def warm_up(self) -> list[int]:
        """One call per connection; the worker each connection landed on."""
        workers = []
        for number, channel in enumerate(self.channels):
            await channel.channel_ready()
            request_id = f"{self._tag}-warm-{number}"
            await stub_for(channel).Classify(
                pb.ClassifyRequest(text=STRIKER, request_id=request_id),
                metadata=bearer(self._key),
                timeout=30,
            )
            workers.append(await worker_that_logged(self._orchestrator, CLASSIFY, request_id))
        return workers

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._calls(number))
            for number in range(len(self.channels))
            for _ in range(self._in_flight)
        ]

    async def stop(self) -> list[Outcome]:
        self._stopping.set()
        await asyncio.gather(*self._tasks)
        for channel in self.channels:
            await channel.close()
        return self.outcomes

    async def _calls(self, number: int) -> None:
        stub = stub_for(self.channels[number])
        while not self._stopping.is_set():
            self._sent += 1
            sent = time.monotonic()
            code = await code_of(
                stub.Classify(
                    pb.ClassifyRequest(text=STRIKER, request_id=f"{self._tag}-{self._sent}"),
                    metadata=bearer(self._key),
                    timeout=30,
                )
            )
            self.outcomes.append(Outcome(number, sent, code))
            if code == grpc.StatusCode.UNAVAILABLE:
                # A connection that went (its worker killed) fails calls at once
                # until it reconnects: back off, as a client would, not spin.
                await asyncio.sleep(UNAVAILABLE_PAUSE_SECONDS)


# How long the rate test drives the tenant before it counts (the burst is spent in
# a fraction of that), and how long it counts.
SPEND_BURST_SECONDS = 1.0
MEASURE_SECONDS = 3.0


async def test_a_tenant_limited_to_100_per_second_is_admitted_100_per_second_across_workers(
    start_stack: Callable[..., Stack], redis_server: RedisServer, tmp_path: Path
) -> None:
    """The one timing assertion the issue asks for, made robust: the tenant is asked
    for more than its rate (18 calls in flight on 6 connections, refusals cost a
    millisecond or two), so its bucket in Redis is empty whenever the window is
    counted, and every token Redis's clock adds is taken within the few milliseconds
    between calls. The OK calls sent within a window of W seconds (client clock) are
    then RATE x W, give or take the tokens of one call's latency at each edge (tens
    of milliseconds: a few tokens) and the fraction of one token: well inside ±10%
    of 300. A machine too slow to ask for 100 calls a second would show as too few
    OKs, so the assertion below first checks that the demand was there: half as much
    again as the rate, which a CI machine under load (226 calls a second from 12 in
    flight, 2026-12-02) still asks for."""
    stack = start_three_workers(start_stack, redis_server, tmp_path)
    await every_worker_logged(stack.orchestrator, PROCESSES)
    load = Load(stack.orchestrator, HUNDRED_KEY, connections=6, in_flight=3, tag="hundred")
    for channel in load.channels:
        await channel.channel_ready()
    started = time.monotonic()
    load.start()
    await asyncio.sleep(SPEND_BURST_SECONDS + MEASURE_SECONDS)
    outcomes = await load.stop()
    window_start = started + SPEND_BURST_SECONDS
    window = [o for o in outcomes if window_start <= o.sent < window_start + MEASURE_SECONDS]
    assert {o.code for o in outcomes} == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len(window) > 1.5 * HUNDRED_RATE * MEASURE_SECONDS, "not driven above the rate"
    admitted = sum(1 for o in window if o.code == grpc.StatusCode.OK)
    expected = HUNDRED_RATE * MEASURE_SECONDS
    assert abs(admitted - expected) <= 0.1 * expected, (admitted, expected, len(window))
    # Spread over the workers: more than one of them admitted calls of the tenant.
    workers = {
        line["worker"]
        for line in stack.orchestrator.log_lines()
        if line.get("event") == "rpc"
        and line.get("code") == "OK"
        and str(line.get("request_id", "")).startswith("hundred-")
    }
    assert len(workers) >= 2


def state_failures(scrape: Scrape, operation: str) -> float:
    """Commands of `operation` that Redis did not answer (failed, timed out or skipped)."""
    return sum(
        value(scrape, STATE_OPERATIONS_TOTAL, operation=operation, outcome=outcome)
        for outcome in ("error", "timeout", "skipped")
    )


async def test_redis_stopped_under_load_calls_are_answered_counted_and_state_recovers(
    start_stack: Callable[..., Stack], redis_server: RedisServer, tmp_path: Path
) -> None:
    # A short retry period: the workers find Redis back soon after it returns.
    stack = start_three_workers(start_stack, redis_server, tmp_path, "--state-retry-seconds", "0.2")
    orchestrator = stack.orchestrator
    await every_worker_logged(orchestrator, PROCESSES)
    port = orchestrator.port
    load = Load(orchestrator, STACK_API_KEY, connections=6, in_flight=1, tag="load")
    await load.warm_up()
    load.start()
    await wait_until(lambda: len(load.outcomes) >= 20, "calls under way")

    redis_server.stop()
    stopped_at = time.monotonic()
    # While Redis is away: rate limits fall back to each process's bucket (the calls
    # go on being answered), a poll is UNAVAILABLE (STATE_UNAVAILABLE), and a call
    # past its route's budget is answered when done instead of PROCESSING.
    away = await refusal(get_result_once(port, "anything"))
    assert away.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(away) == "STATE_UNAVAILABLE"
    unheld = await classify_once(port, "unheld-1", model=BUDGETED_MODEL)
    assert (unheld.status, unheld.labels[0].name) == (pb.RESULT_STATUS_DONE, "sports")
    await wait_until(
        lambda: sum(1 for o in load.outcomes if o.sent > stopped_at + 0.5) >= 20,
        "calls while Redis is away",
    )
    failed = samples(orchestrator)
    assert state_failures(failed, "rate_limit") > 0
    assert state_failures(failed, "result_get") >= 1
    assert state_failures(failed, "result_hold") >= 1

    redis_server.start()  # back, empty
    ok_before = value(
        samples(orchestrator), STATE_OPERATIONS_TOTAL, operation="rate_limit", outcome="ok"
    )
    await wait_until(
        lambda: (
            value(
                samples(orchestrator), STATE_OPERATIONS_TOTAL, operation="rate_limit", outcome="ok"
            )
            > ok_before + 20
        ),
        "rate-limit checks answered by Redis again",
    )
    outcomes = await load.stop()
    assert {o.code for o in outcomes} == {grpc.StatusCode.OK}, "a call under load failed"

    # Shared again: tenant `few` gets its burst across the workers, then no more,
    # and a PROCESSING answer is polled to DONE on other workers.
    codes = [
        await code_of(classify_once(port, f"few-{n}", key=FEW_KEY)) for n in range(FEW_BURST + 2)
    ]
    assert codes == [grpc.StatusCode.OK] * FEW_BURST + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    await polled_to_done_on_other_workers(orchestrator, "polled-after")


async def test_killed_worker_is_restarted_under_load_and_sigterm_drains_every_worker(
    start_stack: Callable[..., Stack], redis_server: RedisServer, tmp_path: Path
) -> None:
    """One stack for two behaviours, as starting one costs seconds."""
    stack = start_three_workers(start_stack, redis_server, tmp_path)
    orchestrator = stack.orchestrator
    before = await every_worker_logged(orchestrator, PROCESSES)
    load = Load(orchestrator, STACK_API_KEY, connections=9, in_flight=1, tag="load")
    landed_on = await load.warm_up()
    victim = landed_on[0]
    survivors = [n for n, worker in enumerate(landed_on) if worker != victim]
    assert survivors, f"every connection landed on worker {victim}"
    load.start()
    await wait_until(lambda: len(load.outcomes) >= 20, "calls under way")

    os.kill(before[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    await wait_until(
        lambda: worker_pids(orchestrator)[victim] != before[victim], "the worker back", 60
    )
    await wait_until(lambda: value(samples(orchestrator), WORKERS) == PROCESSES, "all serving")
    await wait_until(
        lambda: sum(1 for o in load.outcomes if o.sent > killed_at) >= 20, "calls since"
    )
    outcomes = await load.stop()
    on_survivors = [o for o in outcomes if o.connection in survivors]
    assert {o.code for o in on_survivors} == {grpc.StatusCode.OK}
    assert any(o.sent > killed_at for o in on_survivors)
    # The killed worker's own connections: calls in flight on it, and calls sent
    # before the channel saw the connection go, fail UNAVAILABLE; the rest reconnect.
    on_victim = {o.code for o in outcomes if o.connection not in survivors}
    assert on_victim <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
    assert value(samples(orchestrator), WORKER_RESTARTS_TOTAL) == 1
    assert {w: p for w, p in worker_pids(orchestrator).items() if w != victim} == {
        w: p for w, p in before.items() if w != victim
    }

    drained = await calls_then_sigterm(orchestrator, connections=12, calls_each=4)
    assert orchestrator.process.wait(timeout=60) == 0
    lines = orchestrator.log_lines()
    # The supervisor, the two workers that lived, the one that replaced the killed one.
    assert sum(1 for line in lines if line.get("event") == "stopped") == PROCESSES + 1
    # A call either was admitted and answered, or never reached a handler: gRPC
    # cancels calls not yet started when a worker begins to drain (CANCELLED), and a
    # draining worker refuses new ones (UNAVAILABLE). Nothing admitted is lost: every
    # call with an access line was answered OK, and every OK has its line.
    answered = sum(1 for outcome in drained if isinstance(outcome, pb.ClassifyResponse))
    refused = {o.code() for o in drained if isinstance(o, grpc.aio.AioRpcError)}
    assert refused <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}
    admitted = [
        line
        for line in lines
        if line.get("event") == "rpc"
        and line.get("method") == CLASSIFY
        and str(line.get("request_id", "")).startswith("drain-")
    ]
    assert {line["code"] for line in admitted} <= {"OK"}
    assert len(admitted) == answered
    assert answered > 0


async def calls_then_sigterm(
    orchestrator: ServerProcess, *, connections: int, calls_each: int
) -> list[object]:
    """Start calls on `connections` ready connections of their own (spread over the
    workers), SIGTERM the supervisor at once, and return every call's outcome."""
    port = orchestrator.port
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION)
        for _ in range(connections)
    ]
    try:
        for channel in channels:
            await channel.channel_ready()
        calls = [
            stub_for(channel).Classify(
                pb.ClassifyRequest(text=STRIKER, request_id=f"drain-{number}-{n}"),
                metadata=bearer(STACK_API_KEY),
                timeout=60,
            )
            for number, channel in enumerate(channels)
            for n in range(calls_each)
        ]
        await asyncio.sleep(0)  # sent
        orchestrator.process.send_signal(signal.SIGTERM)
        return list(await asyncio.gather(*calls, return_exceptions=True))
    finally:
        for channel in channels:
            await channel.close()

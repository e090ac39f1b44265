"""The overload scenario of `make bench-overload`, short: two real processes, far more
callers with short deadlines than they can serve, and the stack keeps answering.

The bounds are loose on purpose (a shared 2-core machine runs the suite); the
benchmark reports the real figures. What must hold whatever the machine: a good
share of capacity still answered OK, refusals answered promptly and carrying a
retry hint, no call failing any other way, and full service right after.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness import SHORT_TEXTS
from bench.load_clients import PhaseRecord, percentile, run_phase
from tests.conftest import STACK_API_KEY, ServerProcess, Stack, closed_port, write_routes

CAPACITY_CALLERS = 16
OVERLOAD_CALLERS = 256
DEADLINE_SECONDS = 0.3
RAMP_SECONDS = 1.0
# Goodput under overload, as a share of capacity; the first quarter of refusals at
# the front door, as a share of the median served call in the same phase. The share
# is a floor against collapse (0.04 before the overload work), not the target (0.8,
# `make bench-overload`): capacity and overload are measured seconds apart, and on
# the shared 2-core machine 25 runs of this test put it at 0.39-1.18, median 0.81
# (2026-12-02), so a floor of 0.4 failed one fresh clone's run.
MIN_GOODPUT_SHARE = 0.3
REFUSAL_SHARE_OF_OK_P50 = 0.5
REFUSED_AT_THE_DOOR = "RESOURCE_EXHAUSTED: CONCURRENCY_LIMITED"
# More calls than gRPC core's default backlog (past 1,000 waiting calls, core drops
# each new one with a chance that rises to certainty at 3,000), over several
# connections as from several clients. The server is started with a core wait limit as
# long as the calls' deadline: the limit drops calls the loop is slow to take, on
# purpose, and a slow machine's loop takes over a second to take this many in (926 of
# 2,400 calls stopped for 1 s CANCELLED that way, 2026-12-02);
# tests/unit/test_intake_queue.py tests that limit.
BACKLOG_CALLS = 2_400
BACKLOG_STOP_SECONDS = 1.0
BACKLOG_CONNECTIONS = 8
BACKLOG_DEADLINE_SECONDS = 60.0
EXPECTED_OUTCOMES = (
    "OK",
    "RESOURCE_EXHAUSTED: CONCURRENCY_LIMITED",
    "RESOURCE_EXHAUSTED: FRONT_DOOR_BUSY",  # calls reached the front door late
    "DEADLINE_EXCEEDED",  # any reason: unreachable, expired, the client's own deadline
)


def ok_per_second(record: PhaseRecord, seconds: float) -> float:
    return record.outcomes.get("OK", 0) / seconds


def test_overload_keeps_goodput_and_refuses_promptly(stack: Stack) -> None:
    target = f"127.0.0.1:{stack.orchestrator.port}"
    metadata = (("authorization", f"Bearer {STACK_API_KEY}"),)
    capacity_record = run_phase(target, metadata, SHORT_TEXTS, CAPACITY_CALLERS, 3.0, None)
    capacity = ok_per_second(capacity_record, 3.0)
    assert capacity_record.outcomes == {"OK": capacity_record.calls}
    # The callers arrive over the first second, as in `make bench-overload`: all 256 in
    # one millisecond, the refusals made while the limit first engages wait for the
    # whole burst to be read, and they may be most of the phase's refusals.
    overload = run_phase(
        target,
        metadata,
        SHORT_TEXTS,
        OVERLOAD_CALLERS,
        4.0,
        DEADLINE_SECONDS,
        ramp_seconds=RAMP_SECONDS,
    )
    seconds = 4.0
    healthy = run_phase(target, metadata, SHORT_TEXTS, CAPACITY_CALLERS, 2.0, None)
    summary = f"capacity {capacity:.0f}/s; overload: {dict(overload.outcomes)}"
    # Every call ended OK, refused, or out of time: nothing else broke.
    assert all(outcome.startswith(EXPECTED_OUTCOMES) for outcome in overload.outcomes), summary
    # Far more callers than capacity, yet a good share of capacity answered in time...
    assert ok_per_second(overload, seconds) >= MIN_GOODPUT_SHARE * capacity, summary
    # ...and the excess was refused at the front door, promptly, each refusal with a
    # retry hint (run_phase's callers wait it out; without one they would call again
    # at once). Calls refused further in, after waiting (DEADLINE_UNREACHABLE at the
    # capability's admission), are not what this measures.
    at_the_door = overload.latencies.get(REFUSED_AT_THE_DOOR, [])
    assert at_the_door, summary
    # Prompt as a ratio to this run's own served calls (a shared machine's load moves
    # both), and inside the deadline. The first quarter, not the median: on a loaded
    # machine some calls wait for a core before any handler runs (docs/benchmark.md),
    # refusals and served calls alike; what the servers decide shows in the quick ones.
    # `make bench-overload` reports the percentiles.
    door_p25 = percentile(at_the_door, 0.25)
    assert door_p25 <= REFUSAL_SHARE_OF_OK_P50 * percentile(overload.ok_latencies, 0.5), summary
    assert percentile(at_the_door, 0.5) < DEADLINE_SECONDS, summary
    assert overload.refused_without_hint == 0, summary
    # Healthy right after.
    assert healthy.outcomes == {"OK": healthy.calls}, dict(healthy.outcomes)


def outcome_of(result: object) -> str:
    if isinstance(result, grpc.aio.AioRpcError):
        return result.code().name
    return "OK" if isinstance(result, health_pb2.HealthCheckResponse) else repr(result)


def test_a_deep_backlog_of_calls_is_served_not_cancelled(
    tmp_path: Path, start_process: Callable[..., ServerProcess]
) -> None:
    """Calls that pile up before the server's event loop takes them in (here: the
    process is stopped while they arrive) wait their turn in gRPC core. Left at its
    defaults, core drops calls at random once more than 1,000 wait, answering a bare
    CANCELLED that names no reason and carries no retry hint; callers call again at
    once, and under overload that storm took the front door down to nothing served.
    With the caps raised, every call is served."""
    routes = write_routes(tmp_path / "routes.yaml", [f"127.0.0.1:{closed_port()}"])
    server = start_process(
        "orchestrator",
        *("--port", "0", "--metrics-port", "0", "--routes-file", str(routes)),
        *("--auth", "disabled"),
        *("--core-wait-limit-seconds", str(int(BACKLOG_DEADLINE_SECONDS))),
    )

    async def backlog() -> Counter[str]:
        target = f"127.0.0.1:{server.port}"
        channels = [grpc.aio.insecure_channel(target) for _ in range(BACKLOG_CONNECTIONS)]
        try:
            for channel in channels:
                await asyncio.wait_for(channel.channel_ready(), timeout=30)
            # typeshed's HealthStub declares no methods; Check is generated at runtime.
            stubs: list[Any] = [health_pb2_grpc.HealthStub(channel) for channel in channels]
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                calls = [
                    asyncio.ensure_future(
                        stubs[n % len(stubs)].Check(
                            health_pb2.HealthCheckRequest(), timeout=BACKLOG_DEADLINE_SECONDS
                        )
                    )
                    for n in range(BACKLOG_CALLS)
                ]
                # Every call written to the server's sockets before it runs again.
                await asyncio.sleep(BACKLOG_STOP_SECONDS)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            results = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            for channel in channels:
                await channel.close()
        return Counter(map(outcome_of, results))

    outcomes = asyncio.run(backlog())
    assert outcomes == {"OK": BACKLOG_CALLS}, dict(outcomes)

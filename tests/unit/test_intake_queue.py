"""Calls that wait in gRPC core's intake queue: the servers' options have core drop a
call that waited there longer than --core-wait-limit-seconds (1 s unless set), before
any of our code sees it.

gRPC core takes calls in on its own threads and queues each until the server's event
loop asks for it. When the loop falls behind (blocked, starved of a core), the queue
grows in arrival order, so every call taken from it has waited behind all the others.
Under overload after a stall of a few seconds, every call the front door took was one
its caller had already given up on, and it served nothing until the crowd left
(docs/benchmark.md, 2026-12-02). Here a real orchestrator's event loop is blocked on
purpose while calls arrive from another thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from classify_common.server_settings import DEFAULT_INTAKE_LOOPS
from orchestrator.server import OrchestratorServer
from tests.conftest import orchestrator_settings, write_routes

BLOCK = "block the event loop"
CALLS_DURING_THE_BLOCK = 8
# Long enough that no call ends at its own deadline: what ends them is the server.
CALL_TIMEOUT_SECONDS = 30.0


def send_calls_while_blocked(port: int, outcomes: Counter[str], blocked: threading.Event) -> None:
    """One call that blocks the loop, then calls that arrive while it is blocked (once
    the handler has set `blocked`), then one after it all (in a thread: the test's
    event loop is the one blocked)."""

    def outcome(call: Any) -> str:
        try:
            call.result()
            return "OK"
        except grpc.RpcError as error:
            return str(error.code().name)

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        blocking = stub.Classify.future(
            pb.ClassifyRequest(text=BLOCK), timeout=CALL_TIMEOUT_SECONDS
        )
        # NOTE: not a fixed sleep (0.3 s): on a loaded machine the blocking call could
        # reach the handler after the others, which were then served before the block.
        assert blocked.wait(CALL_TIMEOUT_SECONDS), "the blocking call reached the handler"
        waiting = [
            stub.Classify.future(pb.ClassifyRequest(text=f"call {n}"), timeout=CALL_TIMEOUT_SECONDS)
            for n in range(CALLS_DURING_THE_BLOCK)
        ]
        outcomes.update(outcome(call) for call in waiting)
        outcomes[f"blocking: {outcome(blocking)}"] += 1
        after = stub.Classify.future(pb.ClassifyRequest(text="after"), timeout=CALL_TIMEOUT_SECONDS)
        outcomes[f"after: {outcome(after)}"] += 1


async def outcomes_while_blocked(
    orchestrator: OrchestratorServer, block_seconds: float, monkeypatch: pytest.MonkeyPatch
) -> tuple[Counter[str], list[str]]:
    """The outcomes of send_calls_while_blocked, and the texts the handler saw."""
    seen: list[str] = []
    blocked = threading.Event()

    async def planted(request: pb.ClassifyRequest, *args: object) -> pb.ClassifyResponse:
        if request.text == BLOCK:
            blocked.set()
            time.sleep(block_seconds)  # noqa: ASYNC251 - the blocked loop is the point
        else:
            seen.append(request.text)
        return pb.ClassifyResponse(status=pb.RESULT_STATUS_DONE)

    monkeypatch.setattr(orchestrator.dispatcher, "classify", planted)
    outcomes: Counter[str] = Counter()
    await asyncio.to_thread(send_calls_while_blocked, orchestrator.port, outcomes, blocked)
    return outcomes, seen


@pytest.mark.parametrize(
    ("block_seconds", "served_at_least", "served_at_most"),
    [
        # The calls core may hand to the loop's standing requests as they arrive (grpc's
        # own and the extra intake loops') are served; the rest waited over a second in
        # the queue and core drops them.
        (2.5, 0, 1 + DEFAULT_INTAKE_LOOPS),
        # Under a second in the queue: every call is taken in and served.
        (0.5, CALLS_DURING_THE_BLOCK, CALLS_DURING_THE_BLOCK),
    ],
)
async def test_calls_left_waiting_over_a_second_are_dropped_by_core_unseen(
    block_seconds: float,
    served_at_least: int,
    served_at_most: int,
    orchestrator: OrchestratorServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outcomes, seen = await outcomes_while_blocked(orchestrator, block_seconds, monkeypatch)
    during = {key: count for key, count in outcomes.items() if ": " not in key}
    assert sum(during.values()) == CALLS_DURING_THE_BLOCK, outcomes
    assert set(during) <= {"OK", "CANCELLED"}, outcomes
    # What core dropped never reached the handler; what reached it was answered.
    assert len([text for text in seen if text.startswith("call ")]) == during.get("OK", 0), seen
    # The rest ended CANCELLED: dropped by core, the caller told at once.
    assert served_at_least <= during.get("OK", 0) <= served_at_most, outcomes
    # The blocking call itself, and a call once the loop runs again, are served.
    assert (outcomes["blocking: OK"], outcomes["after: OK"]) == (1, 1), outcomes


async def test_a_longer_core_wait_limit_keeps_calls_that_waited_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same 2.5 s block, with the limit set to 5 s: every call is served."""
    routes = write_routes(tmp_path / "routes.yaml", ["127.0.0.1:1"])
    orchestrator = OrchestratorServer(
        orchestrator_settings(routes_file=routes, core_wait_limit_seconds=5),
        registry=CollectorRegistry(),
    )
    await orchestrator.start()
    try:
        outcomes, seen = await outcomes_while_blocked(orchestrator, 2.5, monkeypatch)
    finally:
        await orchestrator.stop(grace_seconds=0)
    assert outcomes == {
        "OK": CALLS_DURING_THE_BLOCK,
        "blocking: OK": 1,
        "after: OK": 1,
    }, outcomes
    assert len(seen) == CALLS_DURING_THE_BLOCK + 1, seen  # and "after"

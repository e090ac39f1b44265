"""The extra intake loops (classify_common/intake_loops.py) over a real server: calls
they take in are handled exactly as grpc's own loop handles them, and the grpc
pinned has the internals they drive."""

from __future__ import annotations

import asyncio

import grpc

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from classify_common import intake_loops
from classify_common.intake_loops import EXTRA_INTAKE_CALLS_TOTAL
from classify_common.metrics import RPC_REQUESTS_TOTAL
from classify_common.server_settings import DEFAULT_INTAKE_LOOPS
from tests.conftest import STRIKER, StartCapability, metric_sum

CLASSIFY = "/ai.classify.v1.ClassifyService/Classify"
CALLS = 64


def test_the_pinned_grpc_has_the_internals_the_extra_loops_drive() -> None:
    """Fails on a grpc whose server internals changed: the loops would be left out
    (with a warning) and every call would pay grpc's one-at-a-time intake again."""
    assert intake_loops.available(), f"grpc {grpc.__version__}: see intake_loops.py"


async def classify_at_once(port: int, calls: int) -> list[pb.ClassifyResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)  # connected
        return await asyncio.gather(
            *(
                stub.Classify(pb.ClassifyRequest(text=f"{STRIKER} {n}"), timeout=30)
                for n in range(calls)
            )
        )


async def test_calls_taken_in_by_the_extra_loops_are_served_through_the_interceptor(
    start_capability: StartCapability,
) -> None:
    server = await start_capability()
    assert DEFAULT_INTAKE_LOOPS > 0
    answers = await classify_at_once(server.port, CALLS)
    assert {answer.labels[0].name for answer in answers} == {"sports"}
    taken = metric_sum(server.registry, EXTRA_INTAKE_CALLS_TOTAL, method=CLASSIFY)
    # Some came through the extra requests (with 64 at once, most do), and every call,
    # whichever request took it in, went through the lifecycle (counted there once).
    assert taken > 0
    counted = metric_sum(server.registry, RPC_REQUESTS_TOTAL, method=CLASSIFY, code="OK")
    assert counted == CALLS + 1


async def test_with_no_extra_loops_grpc_takes_every_call_in(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(intake_loops=0)
    answers = await classify_at_once(server.port, CALLS)
    assert len(answers) == CALLS
    assert metric_sum(server.registry, EXTRA_INTAKE_CALLS_TOTAL) == 0


async def test_a_server_with_extra_loops_stops_within_its_grace(
    start_capability: StartCapability,
) -> None:
    """The loops' open requests are failed by core when the server shuts down, and
    the loops end: the stop does not wait for them."""
    server = await start_capability(intake_loops=8)
    await classify_at_once(server.port, 8)
    loops = set(server.serving._intake_loops._loops)
    assert len(loops) == 8 * 2  # Classify and ClassifyBatch
    await asyncio.wait_for(server.stop(grace_seconds=1), timeout=10)
    assert not server.serving._intake_loops._loops
    # Each ended when core failed its request, none by the cancel `close` keeps for
    # one left over (which would leave its request open in core).
    assert not [loop for loop in loops if loop.cancelled() or loop.exception()]

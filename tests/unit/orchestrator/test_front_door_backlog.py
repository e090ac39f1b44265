"""Calls that reach the front door with their deadlines spent: while many of a tenant's
do, its call that still has time is refused at once with RESOURCE_EXHAUSTED and a retry
hint (orchestrator.policy.backlog), over a real orchestrator and capability."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.errors import FrontDoorBusy
from orchestrator.metrics import FRONT_DOOR_BUSY_TOTAL
from orchestrator.policy.backlog import (
    JITTER,
    MAX_HINT_SECONDS,
    MIN_HINT_SECONDS,
    RECENT_LATE_SECONDS,
    BacklogSettings,
    FrontDoorBacklog,
)
from orchestrator.security.gate import ANONYMOUS
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, metric_sum, orchestrator_for
from tests.status_details import error_reason, refusal, retry_delay_seconds

TENANT = ANONYMOUS.tenant  # the test orchestrator does not authenticate


@pytest_asyncio.fixture
async def own_orchestrator(
    capability: CapabilityServer, tmp_path: Path
) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator of this module's own: the share it keeps must not leak into others."""
    async with orchestrator_for(capability, tmp_path) as server:
        yield server


async def test_a_call_with_time_left_is_refused_while_calls_arrive_without(
    own_orchestrator: OrchestratorServer,
) -> None:
    """Calls sent with 5 ms deadlines reach the handler with under 10 ms left, as calls
    that waited to be taken in do; the server cannot tell them apart. Past a tenth of
    the tenant's recent calls, its call with time left is refused, then served again
    once calls in time bring the share down."""
    server = own_orchestrator
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        request = pb.ClassifyRequest(text=STRIKER)
        for _ in range(200):
            if server.backlog.behind(TENANT):
                break
            late = await refusal(stub.Classify(request, timeout=0.005))
            # DEADLINE_EXCEEDED, or FRONT_DOOR_BUSY for the call that tips the share.
            assert late.code() in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        assert server.backlog.behind(TENANT)
        refused_before = metric_sum(server.registry, FRONT_DOOR_BUSY_TOTAL)
        error = await refusal(stub.Classify(request, timeout=10))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_reason(error) == "FRONT_DOOR_BUSY"
        assert MIN_HINT_SECONDS * 0.8 <= retry_delay_seconds(error) <= MAX_HINT_SECONDS * 1.2
        assert metric_sum(server.registry, FRONT_DOOR_BUSY_TOTAL) == refused_before + 1
        reasons, answer = [], None
        for _ in range(200):
            try:
                answer = await stub.Classify(request, timeout=10)
            except grpc.aio.AioRpcError as refused_again:
                reasons.append(error_reason(refused_again))
                continue
            break
    assert answer is not None, "still refused after 200 calls that arrived in time"
    assert set(reasons) <= {"FRONT_DOOR_BUSY"}
    assert answer.labels[0].name == "sports"
    assert not server.backlog.behind(TENANT)


def test_while_behind_every_call_of_the_tenant_is_refused_and_in_time_ones_catch_up() -> None:
    backlog = FrontDoorBacklog(
        BacklogSettings(max_late_share=0.1), clock=lambda: 0.0, rng=random.Random(1)
    )
    for _ in range(4):
        backlog.admit("a", 0.2)  # in time
    for _ in range(5):
        backlog.admit("a", 0.0)  # late, not yet behind: not refused here
    assert not backlog.behind("a")
    refused = 0
    for _ in range(10):  # late with a few ms left: refused too once behind
        try:
            backlog.admit("a", 0.005)
        except FrontDoorBusy:
            refused += 1
    assert refused > 0
    assert backlog.behind("a")
    share = backlog.late_share("a")
    with pytest.raises(FrontDoorBusy):
        backlog.admit("a", None)  # a call without a deadline is refused too...
    assert backlog.late_share("a") < share  # ...and counts as in time, catching up
    share = backlog.late_share("a")
    with pytest.raises(FrontDoorBusy):
        backlog.admit("a", 0.2)
    assert backlog.late_share("a") < share


def test_a_tenant_sending_deadlines_too_short_to_serve_gets_no_one_else_refused() -> None:
    backlog = FrontDoorBacklog(BacklogSettings(max_late_share=0.1))
    for _ in range(100):
        with contextlib.suppress(FrontDoorBusy):  # its own calls are refused
            backlog.admit("hurried", 0.002)
    assert backlog.behind("hurried")
    backlog.admit("patient", 1.0)  # not refused
    assert not backlog.behind("patient")
    assert backlog.worst_late_share > 0.1


def test_hints_spread_the_refused_callers_over_the_rate_calls_get_past_the_door() -> None:
    """With 100 calls let through a second, the k-th caller refused comes back after about
    k/100 s (within the jitter), so they do not return together."""
    now = [0.0]
    backlog = FrontDoorBacklog(
        BacklogSettings(max_late_share=0.1), clock=lambda: now[0], rng=random.Random(2)
    )
    for index in range(100):  # a second of calls taken in, in time, another tenant's
        now[0] = index / 100
        backlog.admit("b", 1.0)
    now[0] = 1.0
    hints = []
    for _ in range(60):  # late calls: refused once the tenant is behind
        try:
            backlog.admit("a", 0.0)
        except FrontDoorBusy as refused:
            hints.append(refused.retry_after_seconds)
    assert len(hints) > 40
    assert hints[0] == pytest.approx(MIN_HINT_SECONDS, rel=0.25)
    assert hints[-1] == pytest.approx((len(hints) - 1) / 100, rel=0.25)


def test_while_nothing_gets_past_the_door_the_refused_wait_the_longest_hint() -> None:
    """The refusals themselves do not count as calls getting through: after a second in
    which every call was refused, hundreds of them, the next refused caller is told to
    wait the longest hint, not its place among the refused over the refusals' rate."""
    now = [0.0]
    backlog = FrontDoorBacklog(
        BacklogSettings(max_late_share=0.1), clock=lambda: now[0], rng=random.Random(3)
    )
    for index in range(500):  # two seconds of late calls, refused once the share is up
        now[0] = index / 250
        with contextlib.suppress(FrontDoorBusy):
            backlog.admit("a", 0.0)
    now[0] = 2.0
    with pytest.raises(FrontDoorBusy) as refused:
        backlog.admit("a", 0.0)
    assert refused.value.retry_after_seconds >= MAX_HINT_SECONDS * (1 - JITTER)


def test_the_share_fades_with_time_so_old_news_refuses_no_one() -> None:
    """Behind, then the tenant's calls stop: half a minute later its call is admitted,
    though no call in time brought the share down."""
    now = [0.0]
    backlog = FrontDoorBacklog(BacklogSettings(max_late_share=0.1), clock=lambda: now[0])
    for _ in range(20):
        with contextlib.suppress(FrontDoorBusy):
            backlog.admit("a", 0.0)
    assert backlog.behind("a")
    now[0] = 30.0
    backlog.admit("a", 0.2)
    assert not backlog.behind("a")


def test_once_no_call_arrives_late_the_door_opens_whatever_the_share() -> None:
    """A crowd arrived late, then left: its share stays high (calls in time bring it
    down one by one, and time slowly), but no late call comes any more. The callers
    that come then, in time, were all refused for the seconds after, told to wait
    up to 5 s each (`make bench-overload`: 0 OK in its "healthy right after" phase);
    they are let in a second after the last late call. While late calls still come,
    the door stays shut."""
    now = [0.0]
    backlog = FrontDoorBacklog(BacklogSettings(max_late_share=0.1), clock=lambda: now[0])
    for index in range(200):  # two seconds of a crowd whose calls arrive late
        now[0] = index / 100
        with contextlib.suppress(FrontDoorBusy):
            backlog.admit("a", 0.0)
    assert backlog.late_share("a") > 0.8
    now[0] = 2.5  # half a second after the last late call: still behind
    with pytest.raises(FrontDoorBusy):
        backlog.admit("a", None)
    now[0] = 3.0 + RECENT_LATE_SECONDS / 2
    with pytest.raises(FrontDoorBusy):
        backlog.admit("a", 0.005)  # late again: the crowd is still there
    now[0] += RECENT_LATE_SECONDS + 0.01
    assert backlog.late_share("a") > 0.5
    for _ in range(32):
        backlog.admit("a", None)  # none refused
    assert not backlog.behind("a")


def test_a_share_of_zero_never_refuses() -> None:
    backlog = FrontDoorBacklog(BacklogSettings(max_late_share=0.0))
    for _ in range(100):
        backlog.admit("a", 0.0)
    backlog.admit("a", 1.0)
    assert not backlog.behind("a")


def test_the_share_must_be_a_share() -> None:
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        BacklogSettings(max_late_share=1.5)

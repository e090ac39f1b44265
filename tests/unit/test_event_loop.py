"""The servers' event loop: uvloop with a full-resolution clock, or asyncio's on request."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvloop

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.config import CapabilitySettings
from classify_common.context import REQUEST_ID_HEADER, TRACE_ID_HEADER
from classify_common.event_loop import ASYNCIO, UVLOOP, FineClockLoop, loop_factory
from classify_common.settings import SettingsError
from orchestrator.config import OrchestratorSettings
from tests.conftest import closed_port, routes_text


def distinct_readings(clock: Callable[[], float], seconds: float) -> list[float]:
    """The distinct values `clock` gives while spinning for `seconds`."""
    readings: set[float] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        readings.add(clock())
    return sorted(readings)


def steps(readings: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(readings)]


async def test_the_tests_run_on_the_loop_the_servers_run_on() -> None:
    # The in-process servers of the other tests are then the servers users run.
    assert type(asyncio.get_running_loop()) is FineClockLoop


async def test_the_loop_clock_reads_well_under_a_millisecond() -> None:
    # Medians and minimums: the spinning thread may be descheduled for a while on a
    # busy machine, which makes a few steps long but none short.
    loop = asyncio.get_running_loop()
    fine = steps(distinct_readings(loop.time, 0.005))
    assert len(fine) >= 10
    assert statistics.median(fine) < 0.0001
    # uvloop's own clock steps in whole milliseconds: the reason for the subclass.
    plain = uvloop.new_event_loop()
    try:
        coarse = steps(distinct_readings(plain.time, 0.005))
        assert coarse
        assert min(coarse) >= 0.0009
    finally:
        plain.close()


async def test_a_timer_set_on_the_fine_clock_does_not_fire_early() -> None:
    loop = asyncio.get_running_loop()
    fired = loop.create_future()
    started = time.monotonic()
    loop.call_at(loop.time() + 0.02, fired.set_result, None)
    await fired
    # uvloop rounds a timer to its millisecond; never more than that early.
    assert time.monotonic() - started >= 0.019


def test_loop_factory_makes_each_kind_and_refuses_others() -> None:
    for kind, expected in ((UVLOOP, FineClockLoop), (ASYNCIO, asyncio.BaseEventLoop)):
        loop = loop_factory(kind)()
        try:
            assert isinstance(loop, expected)
            assert isinstance(loop, uvloop.Loop) is (kind == UVLOOP)
        finally:
            loop.close()
    with pytest.raises(ValueError, match="unknown event loop 'trio'"):
        loop_factory("trio")


@pytest.mark.parametrize(
    ("settings_class", "prefix"),
    [(CapabilitySettings, "CAPABILITY_"), (OrchestratorSettings, "ORCHESTRATOR_")],
)
def test_event_loop_setting_defaults_to_uvloop_and_names_the_choices(
    settings_class: Any, prefix: str
) -> None:
    # The orchestrator's own checks want a keys file or auth off; not what is tested.
    given = ["--auth", "disabled"] if settings_class is OrchestratorSettings else []
    assert settings_class.from_args(given, environ={}).event_loop == UVLOOP
    chosen = settings_class.from_args(given, environ={f"{prefix}EVENT_LOOP": "asyncio"})
    assert chosen.event_loop == ASYNCIO
    with pytest.raises(
        SettingsError, match=rf"--event-loop / {prefix}EVENT_LOOP: 'trio' is not uvloop or asyncio"
    ):
        settings_class.from_args([*given, "--event-loop", "trio"], environ={})


async def test_a_server_started_on_asyncios_loop_serves_and_says_so(
    start_process: Callable[..., Any], tmp_path: Path
) -> None:
    """`--event-loop asyncio` is the way to rule uvloop out: the orchestrator serves on
    it (a call to a backend that is not there is answered UNAVAILABLE, with IDs)."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_text([f"127.0.0.1:{closed_port()}"], timeout="1s"))
    server = start_process(
        "orchestrator",
        *("--event-loop", "asyncio", "--auth", "disabled", "--port", "0"),
        *("--metrics-port", "-1", "--routes-file", str(routes)),
    )
    assert server.ready["event_loop"] == ASYNCIO
    # Metrics off: null, not 0, which reads as "any free port".
    assert server.ready["metrics_port"] is None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ready['port']}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.Classify(pb.ClassifyRequest(text="a headline"), timeout=30)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    metadata = dict(failure.value.trailing_metadata() or ())
    assert metadata.get(REQUEST_ID_HEADER)
    assert metadata.get(TRACE_ID_HEADER)

"""The benchmarks' own machinery, against real servers: the closed-loop client, the
stack files the front-door bench writes, CPU accounting, the report and the plot.

No timing is asserted: these pin what is counted and written, not how fast.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from bench import echo_server, front_door, gate
from bench.harness import (
    LATENCY_BUCKETS_MS,
    CpuWindow,
    Progress,
    batch_call,
    drive,
    latency_counts,
    process_cpu_seconds,
    unary_call,
)
from bench.load_clients import UNANSWERED, ProcessShare, is_late, percentile
from bench.naive_server import NaiveServicer
from capability.config import CapabilitySettings
from capability.server import CapabilityServer
from classify_common.settings import SettingsError
from orchestrator.routing import load_routes
from orchestrator.security import load_api_keys
from orchestrator.server import OrchestratorServer
from tests.conftest import StartOrchestrator, closed_port
from tests.unit.orchestrator.test_policy import dead_primary_with_fallback


@pytest_asyncio.fixture(scope="module")
async def naive_target(model_root: Path) -> AsyncIterator[str]:
    """The naive one-request-one-forward server, in process, on a free port."""
    server = grpc.aio.server()
    classify_service_pb2_grpc.add_ClassifyServiceServicer_to_server(
        NaiveServicer(model_root / "topic-minilm" / "1", "cpu"), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(grace=0)


async def test_closed_loop_client_counts_every_answered_call(naive_target: str) -> None:
    result = await drive(naive_target, 2, 0.3, unary_call())

    assert result["calls"] > 0
    assert result["texts"] == result["calls"]
    assert result["errors"] == 0
    assert result["first_error"] == ""
    assert result["p50_ms"] <= result["p99_ms"]


async def test_failed_calls_count_in_the_latencies_and_the_warm_up_as_an_error() -> None:
    """Against a front hop whose back hop is gone every call fails UNAVAILABLE: each is
    a call with a latency (a timed-out call once vanished from the percentiles), not
    an answered one, and the failed warm-up call is an error too."""
    front, front_port = await echo_server.start_echo(0, f"127.0.0.1:{closed_port()}")
    try:
        result = await drive(f"127.0.0.1:{front_port}", 1, 0.3, unary_call())
    finally:
        await front.stop(grace=0)

    assert result["calls"] > 0
    assert result["texts"] == 0
    assert result["errors"] == result["calls"] + 1
    # The request rate is of answered calls; every call is in calls_per_second.
    assert result["requests_per_second"] == 0
    assert result["calls_per_second"] > 0
    assert result["first_error"].startswith("UNAVAILABLE")
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert percentile([10.0, 50.0], 0.5) == 10.0
    assert percentile([float(n) for n in range(1, 101)], 0.99) == 99.0


async def test_answers_of_a_fallback_model_count_as_failed_not_served(
    orchestrator_with: StartOrchestrator, capability: CapabilityServer
) -> None:
    """The front door's primary is down and its fallback answers: a benchmark of the
    primary counted those answers as its own throughput. Warm-up items count too."""
    server = await orchestrator_with(dead_primary_with_fallback(capability.port))
    target = f"127.0.0.1:{server.port}"
    unary = await drive(target, 1, 0.3, unary_call())
    batch = await drive(target, 1, 0.3, batch_call(4), items_per_call=4)

    assert (unary["texts"], unary["errors"]) == (0, unary["calls"] + 1)
    assert unary["first_error"] == "answered by the fallback model topic-static"
    assert (batch["texts"], batch["errors"]) == (0, (batch["calls"] + 1) * 4)


def test_a_call_that_ran_out_unanswered_is_not_counted_late_as_well() -> None:
    assert is_late("OK", 0.36, 0.3)
    assert is_late("RESOURCE_EXHAUSTED: OVERLOADED", 0.36, 0.3)
    assert not is_late("OK", 0.34, 0.3)
    assert not is_late(UNANSWERED, 0.36, 0.3)
    assert not is_late("OK", 10.0, None)


async def test_unimplemented_batch_call_is_raised_not_counted(naive_target: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await drive(naive_target, 1, 0.2, batch_call(4), items_per_call=4)

    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_echo_hops_pass_each_call_on_to_the_back_hop_and_do_nothing_else() -> None:
    back, back_port = await echo_server.start_echo(0, None)
    front, front_port = await echo_server.start_echo(0, f"127.0.0.1:{back_port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{front_port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            answer = await stub.Classify(pb.ClassifyRequest(text="anything"), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as unoffered:
                await stub.ClassifyBatch(pb.ClassifyBatchRequest(), timeout=10)
        await back.stop(grace=0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{front_port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as passed_on:
                await stub.Classify(pb.ClassifyRequest(text="anything"), timeout=10)
    finally:
        await front.stop(grace=0)
        await back.stop(grace=0)
    assert answer == echo_server.FIXED_ANSWER
    assert unoffered.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # With the back hop gone the front one has nothing to answer from, and says why.
    assert passed_on.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed to connect" in (passed_on.value.details() or "")


async def test_batch_call_accounts_for_every_item(orchestrator: OrchestratorServer) -> None:
    result = await drive(f"127.0.0.1:{orchestrator.port}", 1, 0.3, batch_call(8), items_per_call=8)

    # Each item of each answered call is either answered or counted as an error.
    assert result["calls"] > 0
    assert result["texts"] + result["errors"] == result["calls"] * 8


def test_front_door_routes_send_every_backend_to_the_bench_capability(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(front_door, "STACK_DIR", tmp_path)

    table = load_routes(front_door.write_routes("127.0.0.1:40001"))

    assert {backend.targets for backend in table.backends.values()} == {("127.0.0.1:40001",)}
    assert front_door.STATIC_MODEL in table.backends


def test_front_door_key_belongs_to_a_tenant_without_rate_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(front_door, "STACK_DIR", tmp_path)

    key, environment = front_door.write_credentials()

    keys = load_api_keys(Path(environment["ORCHESTRATOR_API_KEYS_FILE"]))
    caller = keys.identify(key)
    assert caller is not None
    assert caller.tenant == front_door.TENANT
    assert front_door.TENANT not in keys.tenant_limits
    assert (
        environment["ORCHESTRATOR_INTERNAL_TOKEN_FILE"]
        == environment["CAPABILITY_INTERNAL_TOKEN_FILE"]
    )


def test_cpu_window_charges_this_process_as_the_client() -> None:
    window = CpuWindow({"self": os.getpid()})
    sum(i * i for i in range(300_000))

    spent = window.spent()

    assert spent["client"] > 0
    assert set(spent) == {"self", "client", "others", "wall"}
    assert process_cpu_seconds(os.getpid()) > 0


def test_progress_rewrites_one_line_and_clears_it() -> None:
    stream = io.StringIO()
    progress = Progress(2, stream)

    progress.step("first")
    progress.step("second")
    progress.clear()

    written = stream.getvalue()
    assert "\n" not in written
    assert written.count("\r") == 4  # two steps, and the clear's two
    assert "[2/2" in written
    assert written.endswith("\r")


def synthetic_level(system: str, model: str, clients: int, **extra: Any) -> dict[str, Any]:
    return {
        "system": system,
        "model": model,
        "concurrency": clients,
        "available": True,
        "requests_per_second": 100.0,
        "texts_per_second": 100.0,
        "p50_ms": 10.0,
        "p99_ms": 20.0,
        "errors": 0,
        "first_error": "",
        "ratio_to_ceiling": 0.5,
        "ratio_to_served_threads_ceiling": 0.8,
        "adjacent_ceiling": 200.0,
        "cpu_us_per_text": {"orchestrator": 900.0, "capability": 1200.0, "client": 300.0},
        "other_processes_cores": 0.1,
        "mean_batch": math.nan,
        **extra,
    }


def test_report_table_json_and_plot_are_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ceiling = {
        "texts_per_second_by_batch_size": {1: 50.0, 64: 200.0},
        "best_batch_size": 64,
        "ceiling_texts_per_second": 200.0,
    }
    levels = [
        synthetic_level(front_door.FRONT_DOOR, front_door.MODEL, 1),
        synthetic_level(front_door.FRONT_DOOR, front_door.STATIC_MODEL, 64),
        synthetic_level(
            front_door.ECHO,
            front_door.NO_MODEL,
            64,
            cpu_us_per_text={front_door.ECHO_FRONT: 600, front_door.ECHO_BACK: 450, "client": 1},
        ),
        {
            "system": front_door.FRONT_DOOR_BATCH,
            "model": front_door.MODEL,
            "concurrency": 1,
            "available": False,
            "refused": "UNIMPLEMENTED: not yet",
        },
    ]
    forward = {front_door.MODEL: [5.0], front_door.STATIC_MODEL: [0.1]}
    report: dict[str, Any] = {
        "machine": {
            "cpus": 2,
            "device": "cpu",
            "ceiling_torch_threads": 2,
            "served_torch_threads": 1,
        },
        "seconds_per_level": 1.0,
        "ceiling": {front_door.MODEL: ceiling, front_door.STATIC_MODEL: ceiling},
        "ceiling_served_threads": {front_door.MODEL: ceiling},
        "one_forward_batch_1_ms": {
            model: {"all_cores_mean": ms[0], "served_threads_mean": ms[0]}
            for model, ms in forward.items()
        },
        "levels": levels,
        "targets": front_door.targets(levels, forward),
    }

    front_door.print_report(report)
    front_door.plot(report, tmp_path / "plot.png")

    table = capsys.readouterr().out
    row = "| front door | topic-minilm | 1 | 100 | 100 | 10.0 | 20.0 | 0 | 0.50 | 0.80 | 200 |"
    assert row in table
    assert "not available: UNIMPLEMENTED: not yet" in table
    assert "orchestrator + capability 2,100 µs of CPU per request (target 750: NOT met)" in table
    assert "1.5 ms = 6.5 ms: NOT met" in table
    # A target whose level was not measured (NaN) is not met.
    assert report["targets"]["met"] == {
        "one_client_p50": False,
        "unary_32_ratio": False,
        "unary_128_ratio": False,
        "zero_front_door_errors": True,
        "batch_ratio": False,
        "static_64_servers_cpu_us": False,
    }
    assert "| two echo hops | none | 64 | 600 | 450 | 1,050 | 1 |" in table
    assert "two echo hops at 64 clients 1,050 µs at 100 req/s" in table
    assert "(2.00x; not like with like" in table
    assert json.loads(front_door.json_text(report))["levels"][0]["mean_batch"] is None
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_latency_counts_put_each_call_in_its_bucket() -> None:
    counts = latency_counts([0.0004, 0.001, 0.0011, 0.0011, 5.0])

    assert len(counts) == len(LATENCY_BUCKETS_MS) + 1
    assert counts[:3] == [1, 1, 2]  # up to 0.5 ms, up to 1 ms, up to 2 ms
    assert counts[-1] == 1  # past the last edge
    assert sum(counts) == 5


def test_gate_routes_shadow_every_call_with_the_header(tmp_path: Path) -> None:
    table = load_routes(front_door.write_routes("127.0.0.1:40001", tmp_path, [gate.SHADOW_ROUTE]))

    route = table.routes[0]
    assert route.name == "gate-shadow"
    assert route.shadow is not None
    assert (route.shadow.backend.model, route.shadow.percent) == (gate.STATIC_MODEL, 100)
    assert [r.name for r in table.routes[1:]] == ["static-hint", "default"]


def gate_level(name: str, model: str, **figures: float) -> dict[str, Any]:
    return {
        "level": name,
        "model": model,
        "concurrency": 1,
        "texts_per_second": 100.0,
        "p50_ms": 10.0,
        "p99_ms": 20.0,
        "errors": 0,
        "latency_counts": [0] * 6 + [5, 3] + [0] * (len(LATENCY_BUCKETS_MS) - 7),
        **figures,
    }


def test_gate_checks_read_their_levels_and_the_plots_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = gate.Gate(1.0, runner=None)  # type: ignore[arg-type]  # nothing is driven
    run.ceiling = {"best_batch_size": 16, "ceiling_texts_per_second": 320.0}
    run.levels = {
        "topic-minilm x32": gate_level(
            "topic-minilm x32", gate.MODEL, ratio_to_ceiling=0.9, p99_in_ceiling_batches=4.0
        ),
        "topic-minilm ClassifyBatch x64": gate_level(
            "topic-minilm ClassifyBatch x64", gate.MODEL, ratio_to_ceiling=0.2
        ),
        "topic-static x1": gate_level(
            "topic-static x1", gate.STATIC_MODEL, p50_over_capability=2.0
        ),
        "topic-static x32": gate_level(
            "topic-static x32", gate.STATIC_MODEL, ratio_to_capability=0.8, errors=1
        ),
    }
    run.errors = 1  # counted as each measurement is driven (the x32 level's)
    run.shadow_windows = [
        {"topic-minilm x1, not shadowed": 10.0, "topic-minilm x1, shadowed": ratio * 10}
        for ratio in (1.0, 1.5, 1.1)
    ]

    outcomes = {check["check"]: check for check in run.outcomes()}

    failed = {name for name, check in outcomes.items() if not check["passed"]}
    assert failed == {"ClassifyBatch x64: texts/s / adjacent ceiling", "errors at every level"}
    assert outcomes["shadowed p50 / not shadowed p50 at one client"]["value"] == pytest.approx(1.1)
    # A shadow check measured twice reports its first measurement too, as a level's does.
    run.shadow_first_ratio = 1.5
    shadow = {check["check"]: check for check in run.outcomes()}[
        "shadowed p50 / not shadowed p50 at one client"
    ]
    assert (shadow["first_measurement"], shadow["passed"]) == (1.5, True)
    report = {
        "ceiling": run.ceiling,
        "levels": list(run.levels.values()),
        "latency_buckets_ms": list(LATENCY_BUCKETS_MS),
    }
    gate.plot_heatmap(report, tmp_path / "heatmap.png")
    gate.plot_throughput(report, tmp_path / "throughput.png")
    for name in ("heatmap.png", "throughput.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_a_ramped_phase_starts_its_callers_evenly_across_processes() -> None:
    """Caller k of n sends its first call k/n of the ramp into the phase, whichever
    client process drives it; without a ramp, all start at once."""
    shares = [
        ProcessShare(
            "t",
            (),
            ["x"],
            callers=2,
            first_caller=first,
            starts_at=0.0,
            seconds=1.0,
            deadline=None,
            total_callers=4,
            ramp_seconds=1.0,
        )
        for first in (0, 2)
    ]
    starts = [share.first_call_after(index) for share in shares for index in range(2)]
    assert starts == [0.0, 0.25, 0.5, 0.75]
    unramped = ProcessShare("t", (), ["x"], 2, 0, 0.0, 1.0, None, total_callers=2)
    assert [unramped.first_call_after(index) for index in range(2)] == [0.0, 0.0]


def test_time_before_handlers_reads_the_phase_lines_of_the_orchestrator_log(
    tmp_path: Path,
) -> None:
    from bench.overload import time_before_handlers

    def line(ts: str, code: str, left_ms: float | None, took_ms: float, **extra: str) -> bytes:
        fields: dict[str, Any] = {
            "ts": ts,
            "event": "rpc",
            "method": extra.pop("method", "/ai.classify.v1.ClassifyService/Classify"),
            "code": code,
            "duration_ms": took_ms,
            **extra,
        }
        if left_ms is not None:
            fields["time_left_on_arrival_ms"] = left_ms
        return json.dumps(fields).encode() + b"\n"

    earlier = line("2026-12-01T10:00:01.000Z", "RESOURCE_EXHAUSTED", 10.0, 1.0)
    log = tmp_path / "orchestrator.log"
    log.write_bytes(
        earlier  # written before the phase: skipped by the offset
        + line("2026-12-01T10:00:05.000Z", "RESOURCE_EXHAUSTED", 250.0, 1.0)
        + line(
            "2026-12-01T10:00:06.000Z",
            "DEADLINE_EXCEEDED",
            290.0,
            200.0,
            reason="DEADLINE_UNREACHABLE",
        )
        + line("2026-12-01T10:00:07.000Z", "OK", 299.0, 100.0)
        # The caller's deadline passing is no refusal.
        + line("2026-12-01T10:00:07.500Z", "DEADLINE_EXCEEDED", 100.0, 300.0)
        # Not counted: another method, no deadline, after the window, a line cut short.
        + line("2026-12-01T10:00:08.000Z", "OK", 1.0, 1.0, method="/grpc.health.v1.Health/Check")
        + line("2026-12-01T10:00:08.000Z", "OK", None, 1.0)
        + line("2026-12-01T10:00:30.000Z", "RESOURCE_EXHAUSTED", 0.0, 1.0)
        + b'{"ts": "2026-12-01T10:00:09.000Z", "event": "rpc", "method": "/ai.classify.v1.Cla'
    )
    start = 1796119204.0  # 2026-12-01T10:00:04Z
    found = time_before_handlers(log, len(earlier), (start, start + 10), deadline=0.3)

    # Refusals: RESOURCE_EXHAUSTED and DEADLINE_UNREACHABLE, waited 50 and 10 ms (the
    # nearest-rank median of two is the lower).
    assert found["refusals_before_handler_ms"]["p50"] == pytest.approx(10.0)
    assert found["refusals_before_handler_ms"]["p99"] == pytest.approx(50.0)
    assert found["refusals_in_handler_ms"]["p99"] == pytest.approx(200.0)
    # All four Classify calls with a deadline in the window: waited 1, 10, 50, 200 ms.
    assert found["all_before_handler_ms"]["p50"] == pytest.approx(10.0)
    assert found["all_before_handler_ms"]["p99"] == pytest.approx(200.0)
    # In their handlers 1, 100, 200 and 300 ms.
    assert found["all_in_handler_ms"]["p50"] == pytest.approx(100.0)
    assert found["calls_taken_in"] == 4


def test_the_stall_phase_counts_from_the_end_of_the_stop_to_the_first_second_served_again() -> None:
    from bench.overload import RECOVERED_SHARE, recovered_after

    # OK answers from i to i + 1 s into the phase; stopped from 5 to 8 s.
    by_second: list[float | None] = [0, 100, 200, 200, 200, None, None, None, 0, 40, 150, 220]
    assert RECOVERED_SHARE == 0.5
    # Half of 200 a second: first reached from 10 to 11 s, 3 s after the stop ended.
    assert recovered_after(by_second, 8, 200.0) == 3
    # A second right after the stop counts as the first.
    assert recovered_after([*by_second[:8], 120, 0], 8, 200.0) == 1
    # Never back to half: None.
    assert recovered_after([*by_second[:8], 0, 99, 10], 8, 200.0) is None
    # Nothing answered before the stall (the crowd's arrival swamped it): None.
    assert recovered_after(by_second, 8, 0.0) is None


def test_the_scaled_deadline_is_the_issues_300_ms_on_the_machine_it_was_written_on() -> None:
    from bench.overload import CAPACITY_CALLERS, scaled_deadline

    # 32 callers at 320 OK/s: 100 ms a call, three times that.
    assert CAPACITY_CALLERS == 32
    assert scaled_deadline(320.0) == pytest.approx(0.3)
    # Half the capacity: twice the deadline. No capacity at all: bounded, not infinite.
    assert scaled_deadline(160.0) == pytest.approx(0.6)
    assert scaled_deadline(0.0) == pytest.approx(96.0)


def test_an_overload_phase_meets_the_targets_only_with_all_three() -> None:
    from bench.overload import meets_targets

    good = {
        "ok_per_second": 80.0,
        "late_share": 0.0005,
        "unanswered_share": 0.0005,
        "refusal_p99_ms": 10.0,
    }
    assert meets_targets(good, capacity=100.0)
    assert not meets_targets({**good, "ok_per_second": 79.0}, capacity=100.0)
    assert not meets_targets({**good, "late_share": 0.002}, capacity=100.0)
    assert not meets_targets({**good, "refusal_p99_ms": 10.5}, capacity=100.0)
    # A call that ran out at its deadline unanswered is past it: judged on the callers'
    # lateness alone (gRPC ends a call at its deadline), 0.16% of them passed.
    assert not meets_targets({**good, "unanswered_share": 0.0016}, capacity=100.0)
    # No refusal at all (p99 of nothing is NaN) is no refusal too slow, unless calls
    # ran out meanwhile: the excess was then neither served nor refused.
    nothing_refused = {**good, "refusal_p99_ms": float("nan")}
    assert meets_targets({**nothing_refused, "unanswered_share": 0.0}, capacity=100.0)
    assert not meets_targets(nothing_refused, capacity=100.0)


def test_a_phase_whose_callers_took_the_machine_says_so() -> None:
    from bench.overload import callers_caveat

    assert callers_caveat({"cores_used": {"client": 0.9}}, cpus=2) == ""
    caveat = callers_caveat({"cores_used": {"client": 1.35}}, cpus=2)
    assert "took 1.35 of the 2 cores" in caveat
    assert callers_caveat({"cores_used": {"client": 1.35}}, cpus=8) == ""


@pytest.mark.parametrize(("asked", "served_on"), [("cpu", "cpu"), ("cuda", "cuda:0")])
def test_the_front_door_bench_starts_the_capability_on_a_device_it_accepts(
    asked: str, served_on: str
) -> None:
    """`make gpu-check`'s sweep asks for `--device cuda`, which the capability refuses
    (it takes cuda:N): the sweep failed on every GPU machine, healthy or not. What the
    bench hands on names one device, the one its in-process ceiling measures."""
    device = front_door.bench_device(asked)
    assert device == served_on
    if device == "cpu":
        assert CapabilitySettings(device=device).device == "cpu"
        return
    # No GPU here: refused for want of the device, not for the way it is written.
    with pytest.raises(SettingsError, match="this machine has"):
        CapabilitySettings(device=device)

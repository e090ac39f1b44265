"""A service-time fit that refuses texts on its own word is checked by timing a forward:
a stale one learns again, so a replica cannot refuse every short deadline for ever."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.batching import PRIORITY_INTERACTIVE, Admission
from capability.batching.probe import (
    CONFIRMED,
    MAX_GAP_SECONDS,
    MIN_GAP_SECONDS,
    PROBE_FAILED,
    STALE,
    STALE_PAST_WEIGHT,
    FitProbe,
)
from capability.batching.service_time import FORGETTING
from capability.metrics import FIT_PROBES_TOTAL, MODEL_TEXTS_TOTAL
from classify_common.errors import DeadlineUnreachable
from tests.conftest import StartCapability, metric_sum, wait_until
from tests.status_details import error_reason, refusal

HEADLINE = "The striker scored twice in the final minutes of the cup match"


def test_a_probe_that_bears_the_fit_out_doubles_the_gap_and_a_stale_one_resets_it() -> None:
    probe = FitProbe()
    assert probe.due(0.0)
    now = 0.0
    for gap in (0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0):
        verdict = probe.judge(predicted=0.010, seconds=0.009, now=now)
        assert (verdict.outcome, verdict.past_weight) == (CONFIRMED, FORGETTING)
        assert not probe.due(now + gap - 0.001)
        assert probe.due(now + gap)
        now += gap
    assert MAX_GAP_SECONDS == 5.0
    stale = probe.judge(predicted=0.010, seconds=0.004, now=now)
    assert (stale.outcome, stale.past_weight) == (STALE, STALE_PAST_WEIGHT)
    assert not probe.due(now + MIN_GAP_SECONDS - 0.01)
    assert probe.due(now + MIN_GAP_SECONDS)
    probe.failed(now)
    assert not probe.due(now + MAX_GAP_SECONDS - 0.01)
    assert probe.due(now + MAX_GAP_SECONDS)
    probe.running = True
    assert not probe.due(now + 60)


async def test_a_fit_that_refuses_every_text_of_an_idle_replica_is_probed_and_learns_again(
    start_capability: StartCapability,
) -> None:
    """The fit learns only from texts it lets through. After a stall (here: batches of
    one recorded at 2 s each, what a device taken by another process measures), it
    predicted more than any caller gave, refused them all, and so never saw the device
    was fast again: every call with a shorter deadline was refused for as long as the
    server ran. Measured with topic-minilm after warm-up ran beside another process's
    work: 136 ms predicted for a text that takes 10, every 150 ms call refused for 12 s.
    One refusal is enough: the probes go on while they find the fit stale."""
    server = await start_capability(models=("topic-static",))
    replica = server.pool.workers[0].replicas["topic-static"]
    fit = replica.predictor.service_time
    for _ in range(20):
        fit.record(1, 16, 2.0)
    assert fit.predict(1, 16) > 1.5
    texts_before = metric_sum(server.registry, MODEL_TEXTS_TOTAL, model="topic-static")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        refused = await refusal(stub.Classify(pb.ClassifyRequest(text=HEADLINE), timeout=0.5))
        assert refused.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert error_reason(refused) == "DEADLINE_UNREACHABLE"
        await wait_until(lambda: fit.predict(1, 16) < 0.2, "the fit back near the truth")
        answer = await stub.Classify(pb.ClassifyRequest(text=HEADLINE), timeout=0.5)
    assert answer.labels
    stale = metric_sum(server.registry, FIT_PROBES_TOTAL, model="topic-static", outcome=STALE)
    assert stale >= 3  # 2 s to under 0.2 s halves the past at least three times
    # The probes' stand-in texts are not served texts.
    assert metric_sum(server.registry, MODEL_TEXTS_TOTAL, model="topic-static") == texts_before + 1


async def test_a_refusal_the_device_bears_out_is_confirmed_and_the_fit_kept(
    start_capability: StartCapability,
) -> None:
    """A deadline shorter than the forward really takes: the probe confirms the fit,
    which keeps its past, and the text stays refused."""
    server = await start_capability(models=("topic-minilm",))
    replica = server.pool.workers[0].replicas["topic-minilm"]
    encoded = replica.bundle.classifier.tokenize([HEADLINE])[0]
    fit = replica.predictor.service_time
    # One forward of a headline takes about 10 ms here (some 0.7 GFLOP: several ms on
    # any CPU); predict 2 ms for it, so a probe taking at least 1 ms bears the fit out,
    # and refuse a text with 1 ms left.
    for _ in range(20):
        fit.record(1, 16, 0.002)
    observations = fit.observations
    loop = asyncio.get_running_loop()
    refused = replica.admit(
        [Admission(encoded, PRIORITY_INTERACTIVE, "hurried", loop.time() + 0.001)]
    )
    assert isinstance(refused[0], DeadlineUnreachable), refused

    def probes(outcome: str) -> float:
        return metric_sum(server.registry, FIT_PROBES_TOTAL, model="topic-minilm", outcome=outcome)

    await wait_until(lambda: probes(CONFIRMED) == 1, "the probe's verdict")
    assert probes(STALE) == 0
    assert fit.observations == observations + 1


async def test_a_stale_fit_of_a_model_off_the_device_is_probed_after_a_cold_start(
    start_capability: StartCapability,
) -> None:
    """An on_demand model off the device: a text whose deadline leaves time for the
    copy but not for the forward the fit predicts after it is refused before the
    queue, and the model stays off. With the fit stale, every such call was refused
    (75 of 75 calls with 500 ms deadlines in 4 s, no probe, no cold start)."""
    server = await start_capability(
        models=("topic-static",), residency="on_demand", idle_seconds=3600
    )
    replica = server.pool.workers[0].replicas["topic-static"]
    assert not replica.is_resident
    fit = replica.predictor.service_time
    for _ in range(20):
        fit.record(1, 16, 2.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        refused = await refusal(stub.Classify(pb.ClassifyRequest(text=HEADLINE), timeout=0.5))
        assert error_reason(refused) == "DEADLINE_UNREACHABLE"
        await wait_until(lambda: fit.predict(1, 16) < 0.2, "the fit back near the truth")
        answer = await stub.Classify(pb.ClassifyRequest(text=HEADLINE), timeout=0.5)
    assert answer.labels
    assert server.pool.workers[0].replicas["topic-static"].is_resident  # brought on
    assert metric_sum(server.registry, FIT_PROBES_TOTAL, model="topic-static", outcome=STALE) >= 3
    assert metric_sum(server.registry, FIT_PROBES_TOTAL, outcome=PROBE_FAILED) == 0


async def test_probes_stop_when_an_idle_model_leaves_the_device_between_them(
    start_capability: StartCapability, caplog: pytest.LogCaptureFixture
) -> None:
    """Idle for its idle_seconds between two probes, an on_demand model was taken off
    the device, and the next probe's forward failed on weights no longer there
    (`Tensor on device cpu is not on the expected device meta`)."""
    # Idle 0.4 s after its last text: the evictor (looking every 0.1 s) takes it off
    # well inside the probes' run (16 probes at least 0.1 s apart). Should it go before
    # the first probe, the probe brings it back, and it goes again after that one.
    server = await start_capability(
        models=("topic-static",), residency="on_demand", idle_seconds=0.4
    )
    replica = server.pool.workers[0].replicas["topic-static"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=HEADLINE), timeout=30)  # its cold start
        fit = replica.predictor.service_time
        for _ in range(20):
            fit.record(1, 16, 100.0)  # so far off that the probes go on, 0.1 s apart
        await refusal(stub.Classify(pb.ClassifyRequest(text=HEADLINE), timeout=1.0))
        await wait_until(
            lambda: metric_sum(server.registry, FIT_PROBES_TOTAL, outcome=STALE) >= 1,
            "a first probe found the fit stale",
        )
        with caplog.at_level(logging.WARNING):
            await wait_until(lambda: not replica.is_resident, "the model taken off the device")
            await wait_until(lambda: not replica._fit_probe.running, "the probes over")
    assert metric_sum(server.registry, FIT_PROBES_TOTAL, outcome=PROBE_FAILED) == 0
    assert not [r for r in caplog.records if r.getMessage() == "service-time fit probe failed"]
    assert metric_sum(server.registry, FIT_PROBES_TOTAL, outcome=STALE) < 16  # cut short

"""After a burst of traffic, both processes' /metrics move by exactly the right amounts."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Callable

import grpc
from prometheus_client.parser import text_string_to_metric_families

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.metrics import (
    BATCH_PADDING_RATIO,
    BATCH_SIZE,
    MODEL_FORWARD_TOTAL,
    MODEL_TEXTS_TOTAL,
    QUEUE_DEPTH,
    RPC_ITEMS,
    WORKER_BUSY_SECONDS_TOTAL,
)
from classify_common.metrics import NODE_DURATION_SECONDS, RPC_DURATION_SECONDS, RPC_REQUESTS_TOTAL
from classify_common.nodes import NODES, RESPONSE_SEND
from orchestrator.metrics import REQUEST_DURATION_SECONDS
from tests.conftest import STRIKER, ServerProcess, Stack, static_routes, wait_until
from tests.status_details import refusal

CLASSIFY = "/ai.classify.v1.ClassifyService/Classify"
CLASSIFY_BATCH = "/ai.classify.v1.ClassifyService/ClassifyBatch"
BURST = 24
# (sample name, its labels) -> value, from one read of /metrics.
Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_text(process: ServerProcess, openmetrics: bool = False) -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{process.ready['metrics_port']}/metrics",
        headers={"Accept": "application/openmetrics-text"} if openmetrics else {},
    )
    with urllib.request.urlopen(request, timeout=10) as page:
        return str(page.read().decode())


def samples(process: ServerProcess) -> Scrape:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(scrape_text(process))
        for sample in family.samples
    }


def value(scrape: Scrape, name: str, **labels: str) -> float:
    return sum(
        v
        for (sample, sample_labels), v in scrape.items()
        if sample == name and set(labels.items()) <= sample_labels
    )


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


async def burst(orchestrator: ServerProcess) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        responses = await asyncio.gather(
            *(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30) for _ in range(BURST))
        )
        assert all(r.labels[0].name == "sports" for r in responses)
        error = await refusal(stub.Classify(pb.ClassifyRequest(text=""), timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_burst_moves_both_endpoints_by_the_right_amounts(
    start_stack: Callable[..., Stack],
) -> None:
    stack = start_stack(
        routes=static_routes,
        capability_flags=(
            *("--models", "topic-static", "--default-model", "topic-static"),
            *("--max-wait-ms", "20"),
        ),
    )
    orchestrator, capability = stack.orchestrator, stack.capability
    front_before, back_before = samples(orchestrator), samples(capability)
    await burst(orchestrator)
    # response_send ends when gRPC reports the call done, after the client has its answer.
    await wait_until(
        lambda: (
            delta(
                front_before,
                samples(orchestrator),
                NODE_DURATION_SECONDS + "_count",
                lifecycle_node=RESPONSE_SEND,
            )
            == BURST + 1
        ),
        "response_send counted for every call",
    )
    front, back = samples(orchestrator), samples(capability)

    requests = RPC_REQUESTS_TOTAL
    assert delta(front_before, front, requests, method=CLASSIFY, code="OK") == BURST
    assert delta(front_before, front, requests, method=CLASSIFY, code="INVALID_ARGUMENT") == 1
    # The capability got every request once, in fewer RPCs: concurrent calls are
    # coalesced into ClassifyBatch calls, and RPC_ITEMS says how many each carried.
    upstream_rpcs = sum(
        delta(back_before, back, requests, method=method, code="OK")
        for method in (CLASSIFY, CLASSIFY_BATCH)
    )
    assert delta(back_before, back, RPC_ITEMS + "_sum") == BURST
    assert delta(back_before, back, RPC_ITEMS + "_count") == upstream_rpcs
    assert 1 <= upstream_rpcs < BURST
    assert delta(back_before, back, requests, code="INVALID_ARGUMENT") == 0
    assert (
        delta(
            front_before,
            front,
            REQUEST_DURATION_SECONDS + "_count",
            route="default",
            model="topic-static",
            code="OK",
        )
        == BURST
    )

    # Every node once per request; the invalid one stopped at input_validate.
    for node in NODES:
        before, after = (
            (front_before, front) if node.service == "orchestrator" else (back_before, back)
        )
        invalid = node.name in {"grpc_receive", "auth_validate", "rate_limit_check"} | {
            "input_validate",
            "response_send",
        }
        assert delta(before, after, NODE_DURATION_SECONDS + "_count", lifecycle_node=node.name) == (
            BURST + invalid
        ), node.name

    # The capability computed every text once, in batches the histograms describe.
    forwards = delta(back_before, back, MODEL_FORWARD_TOTAL, model="topic-static")
    assert delta(back_before, back, MODEL_TEXTS_TOTAL, model="topic-static") == BURST
    assert delta(back_before, back, BATCH_SIZE + "_sum", model="topic-static") == BURST
    assert delta(back_before, back, BATCH_SIZE + "_count", model="topic-static") == forwards
    assert delta(back_before, back, BATCH_PADDING_RATIO + "_count", model="topic-static") == (
        forwards
    )
    assert 1 <= forwards <= BURST
    assert delta(back_before, back, WORKER_BUSY_SECONDS_TOTAL, worker="cpu:0") > 0
    assert value(back, QUEUE_DEPTH, model="topic-static", worker="cpu:0") == 0

    # Latency buckets carry a trace ID (OpenMetrics exemplars) only where the trace can
    # be opened: these processes export no spans (no --otlp-endpoint), so none. With an
    # exporter they do: tests/unit/orchestrator/test_upstream.py.
    exemplar = re.compile(r'# \{trace_id="[0-9a-f]{32}"\}')
    for process, metric in (
        (orchestrator, REQUEST_DURATION_SECONDS),
        (capability, RPC_DURATION_SECONDS),
    ):
        buckets = [
            line
            for line in scrape_text(process, openmetrics=True).splitlines()
            if line.startswith(metric + "_bucket")
        ]
        assert buckets, metric
        assert not any(exemplar.search(line) for line in buckets), metric

"""The lifecycle's histograms, kept as plain counts, read exactly as prometheus_client's."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from classify_common.metrics import (
    NODE_BUCKETS,
    NODE_DURATION_SECONDS,
    RPC_BUCKETS,
    RPC_DURATION_SECONDS,
    RpcMetrics,
)

CLASSIFY = "/ai.classify.v1.ClassifyService/Classify"
NODE_OBSERVATIONS = [
    ("grpc_receive", 0.00005),
    ("grpc_receive", 0.0001),  # exactly on a bound: that bucket (`le`)
    ("grpc_receive", 0.00010000001),
    ("upstream_call", 0.0),
    ("upstream_call", 0.003),
    ("upstream_call", 10.0),
    ("upstream_call", 12.5),  # past the last bound: +Inf only
    ("response_send", 0.2),
]
RPC_OBSERVATIONS = [
    ("OK", 0.0008, "a" * 32),
    ("OK", 0.0009, "b" * 32),  # the bucket keeps the latest exemplar
    ("OK", 0.004, ""),  # no trace ID: no exemplar
    ("OK", 30.0, "c" * 32),
    ("INVALID_ARGUMENT", 0.002, "d" * 32),
]
Generate = Callable[[CollectorRegistry], bytes]


def comparable(exposition: bytes, name: str) -> list[str]:
    """The lines of metric `name`, without the wall-clock times in them (`_created`
    values, exemplar timestamps)."""
    text = re.sub(r"(_created\{[^}]*\}) \S+", r"\1 <created>", exposition.decode())
    text = re.sub(r"(# \{[^}]*\} \S+) \S+$", r"\1 <time>", text, flags=re.MULTILINE)
    return [line for line in text.splitlines() if name in line]


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics])
def test_node_histogram_exposes_what_a_prometheus_histogram_would(generate: Generate) -> None:
    ours, reference = CollectorRegistry(), CollectorRegistry()
    metrics = RpcMetrics(ours)
    histogram = Histogram(
        NODE_DURATION_SECONDS,
        "Time spent in each request lifecycle node (classify_common.nodes), in seconds.",
        ["lifecycle_node"],
        registry=reference,
        buckets=NODE_BUCKETS,
    )
    for node, seconds in NODE_OBSERVATIONS:
        metrics.observe_node(node, seconds)
        histogram.labels(node).observe(seconds)

    exposed = comparable(generate(ours), NODE_DURATION_SECONDS)
    assert exposed == comparable(generate(reference), NODE_DURATION_SECONDS)
    assert len([line for line in exposed if "_created{" in line]) == 3


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics])
def test_rpc_histogram_exposes_what_a_prometheus_histogram_would(generate: Generate) -> None:
    ours, reference = CollectorRegistry(), CollectorRegistry()
    metrics = RpcMetrics(ours)
    histogram = Histogram(
        RPC_DURATION_SECONDS,
        "Time from receiving an RPC to its answer, in seconds.",
        ["method", "code"],
        registry=reference,
        buckets=RPC_BUCKETS,
    )
    for code, seconds, trace_id in RPC_OBSERVATIONS:
        exemplar = {"trace_id": trace_id} if trace_id else None
        metrics.observe(CLASSIFY, code, seconds, exemplar)
        histogram.labels(CLASSIFY, code).observe(seconds, exemplar=exemplar)

    exposed = comparable(generate(ours), RPC_DURATION_SECONDS)
    assert exposed == comparable(generate(reference), RPC_DURATION_SECONDS)
    if generate is generate_openmetrics:
        exemplars = [line for line in exposed if "# {" in line]
        assert [line.split("# ")[1] for line in exemplars] == [
            '{trace_id="' + "b" * 32 + '"} 0.0009 <time>',
            '{trace_id="' + "c" * 32 + '"} 30.0 <time>',
            '{trace_id="' + "d" * 32 + '"} 0.002 <time>',
        ]


def test_lifecycle_histograms_cannot_be_registered_twice_on_one_registry() -> None:
    registry = CollectorRegistry()
    RpcMetrics(registry)
    for name in (NODE_DURATION_SECONDS, RPC_DURATION_SECONDS):
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            Histogram(name, "again", registry=registry)

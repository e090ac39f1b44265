"""The node histogram, kept as plain counts, reads exactly as prometheus_client's Histogram."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from classify_common.metrics import NODE_BUCKETS, NODE_DURATION_SECONDS, RpcMetrics

OBSERVATIONS = [
    ("grpc_receive", 0.00005),
    ("grpc_receive", 0.0001),  # exactly on a bound: that bucket (`le`)
    ("grpc_receive", 0.00010000001),
    ("upstream_call", 0.0),
    ("upstream_call", 0.003),
    ("upstream_call", 10.0),
    ("upstream_call", 12.5),  # past the last bound: +Inf only
    ("response_send", 0.2),
]


def without_created(exposition: bytes) -> str:
    """The exposition without its `_created` values, which are wall-clock times."""
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 <created>", exposition.decode())


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics])
def test_node_histogram_exposes_what_a_prometheus_histogram_would(generate: object) -> None:
    ours, reference = CollectorRegistry(), CollectorRegistry()
    metrics = RpcMetrics(ours)
    histogram = Histogram(
        NODE_DURATION_SECONDS,
        "Time spent in each request lifecycle node (classify_common.nodes), in seconds.",
        ["lifecycle_node"],
        registry=reference,
        buckets=NODE_BUCKETS,
    )
    for node, seconds in OBSERVATIONS:
        metrics.observe_node(node, seconds)
        histogram.labels(node).observe(seconds)
    assert callable(generate)

    exposed = without_created(generate(ours))
    expected = without_created(generate(reference))

    node_lines = [line for line in exposed.splitlines() if NODE_DURATION_SECONDS in line]
    assert node_lines == [line for line in expected.splitlines() if NODE_DURATION_SECONDS in line]
    assert len([line for line in node_lines if "_created{" in line]) == 3


def test_node_histogram_cannot_be_registered_twice_on_one_registry() -> None:
    registry = CollectorRegistry()
    RpcMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram(NODE_DURATION_SECONDS, "again", registry=registry)

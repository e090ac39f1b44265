"""Prometheus metrics every gRPC server of ours exports, and the /metrics endpoint.

Metric names are module constants; each server owns its CollectorRegistry
(tests make a fresh one per server, so deltas are exact).
"""

from __future__ import annotations

from http.server import HTTPServer
from threading import Thread

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

RPC_REQUESTS_TOTAL = "classify_rpc_requests_total"
RPC_DURATION_SECONDS = "classify_rpc_duration_seconds"
NODE_DURATION_SECONDS = "classify_node_duration_seconds"
# Nodes range from microseconds (a rate-limit check) to seconds (a queue wait).
NODE_BUCKETS = (
    *(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025),
    *(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


class RpcMetrics:
    """Requests by method and final status code, and their latency."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            RPC_REQUESTS_TOTAL,
            "RPCs handled, by full method name and gRPC status code.",
            ["method", "code"],
            registry=registry,
        )
        self.duration = Histogram(
            RPC_DURATION_SECONDS,
            "Time from receiving an RPC to its answer, in seconds.",
            ["method", "code"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.node_duration = Histogram(
            NODE_DURATION_SECONDS,
            "Time spent in each request lifecycle node (classify_common.nodes), in seconds.",
            ["lifecycle_node"],
            registry=registry,
            buckets=NODE_BUCKETS,
        )
        # Labelled children, looked up once each (see observe_node).
        self._node_children: dict[str, Histogram] = {}
        self._rpc_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}

    def observe_node(self, node: str, seconds: float) -> None:
        """One lifecycle node's duration. The labelled child is looked up once per node:
        `labels()` costs more than the observation, ten times per request."""
        child = self._node_children.get(node)
        if child is None:
            child = self._node_children[node] = self.node_duration.labels(node)
        child.observe(seconds)

    def observe(self, method: str, code: str, seconds: float, trace_id: str = "") -> None:
        """Count the call; its latency carries the trace ID as an OpenMetrics exemplar,
        so a slow bucket on a dashboard links to a trace of a request in it."""
        children = self._rpc_children.get((method, code))
        if children is None:
            children = (self.requests.labels(method, code), self.duration.labels(method, code))
            self._rpc_children[(method, code)] = children
        requests, duration = children
        requests.inc()
        exemplar = {"trace_id": trace_id} if trace_id else None
        duration.observe(seconds, exemplar=exemplar)


class MetricsEndpoint:
    """An HTTP /metrics endpoint on its own thread; port 0 picks a free port."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server: HTTPServer
        self._thread: Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

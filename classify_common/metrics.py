"""Prometheus metrics every gRPC server of ours exports, and the /metrics endpoint.

Metric names are module constants; each server owns its CollectorRegistry
(tests make a fresh one per server, so deltas are exact).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import HTTPServer
from threading import Thread
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

RPC_REQUESTS_TOTAL = "classify_rpc_requests_total"
RPC_DURATION_SECONDS = "classify_rpc_duration_seconds"
NODE_DURATION_SECONDS = "classify_node_duration_seconds"
# How prometheus_client writes a bucket's bound (`le`); the library leaves it untyped.
_go_float = cast(Callable[[float], str], floatToGoString)
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
        self.node_duration = LabelledHistogram(
            NODE_DURATION_SECONDS,
            "Time spent in each request lifecycle node (classify_common.nodes), in seconds.",
            "lifecycle_node",
            NODE_BUCKETS,
            registry,
        )
        # Labelled children, looked up once each (see observe).
        self._rpc_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        # One lifecycle node's duration, about ten times per request in each process.
        self.observe_node = self.node_duration.observe

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


class LabelledHistogram:
    """A Prometheus histogram with one label, kept as plain counts and exposed as a
    collector, exactly as prometheus_client's Histogram exposes it.

    NOTE: for histograms observed several times per request. Histogram.observe takes
    two locks and walks the buckets in Python on every call; here an observation is a
    bisect and one lock.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._label = label
        self._bounds = tuple(sorted(float(bound) for bound in buckets))
        self._lock = threading.Lock()
        # Per label value: the count in each bucket (not cumulative; +Inf last), then
        # the sum of the observations.
        self._series: dict[str, list[float]] = {}
        self._created: dict[str, float] = {}
        registry.register(self)

    def observe(self, label_value: str, amount: float) -> None:
        series = self._series.get(label_value)
        if series is None:
            series = self._add_series(label_value)
        # The first bucket whose upper bound is at least `amount` (`le` buckets).
        index = bisect.bisect_left(self._bounds, amount)
        with self._lock:
            series[index] += 1
            series[-1] += amount

    def _add_series(self, label_value: str) -> list[float]:
        with self._lock:
            if label_value not in self._series:
                self._created[label_value] = time.time()
                self._series[label_value] = [0.0] * (len(self._bounds) + 2)
            return self._series[label_value]

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=[self._label])

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = [(value, list(series)) for value, series in self._series.items()]
        family = HistogramMetricFamily(self._name, self._documentation, labels=[self._label])
        bounds = [*(_go_float(bound) for bound in self._bounds), "+Inf"]
        for label_value, series in snapshot:
            cumulative, buckets = 0.0, []
            for bound, count in zip(bounds, series[:-1], strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([label_value], buckets, series[-1])
            family.samples.append(
                Sample(
                    self._name + "_created",
                    {self._label: label_value},
                    self._created[label_value],
                )
            )
        yield family

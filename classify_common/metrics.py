"""Prometheus metrics every gRPC server of ours exports, and the /metrics endpoint.

Metric names are module constants; each server owns its CollectorRegistry
(tests make a fresh one per server, so deltas are exact).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from http.server import HTTPServer
from threading import Thread
from typing import cast

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.samples import Exemplar, Sample
from prometheus_client.utils import floatToGoString

RPC_REQUESTS_TOTAL = "classify_rpc_requests_total"
REQUESTS_TOTAL = "classify_requests_total"
INTERNAL_ERRORS_TOTAL = "classify_internal_errors_total"
RPC_DURATION_SECONDS = "classify_rpc_duration_seconds"
NODE_DURATION_SECONDS = "classify_node_duration_seconds"
RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# How prometheus_client writes a bucket's bound (`le`); the library leaves it untyped.
_go_float = cast(Callable[[float], str], floatToGoString)
# Nodes range from microseconds (a rate-limit check) to seconds (a queue wait). 0.15
# and 0.2 let ClassifyGpuQueueWaitHigh's 200 ms be read: between 0.1 and 0.25 alone,
# waits of 105 ms estimated a p99 over 200 ms and paged, and 240 ms read as 190.
NODE_BUCKETS = (
    *(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025),
    *(0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 1, 2.5, 5, 10),
)


# A histogram series: its label value, or its label values in order.
SeriesKey = str | tuple[str, ...]


class RpcMetrics:
    """Requests by method and final status code, their latency, and the bugs among them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            RPC_REQUESTS_TOTAL,
            "RPCs handled, by full method name and gRPC status code.",
            ["method", "code"],
            registry=registry,
        )
        # Unlabelled, so it is exported at 0 from the start: a labelled child made on
        # the first bug would make that bug invisible to increase() in an alert.
        self.internal_errors = Counter(
            INTERNAL_ERRORS_TOTAL,
            "RPCs, and items of batch calls, answered INTERNAL for a bug (an exception no "
            "layer expected) or a fault of the deployment (a capability server answered "
            "the orchestrator a code it should not, such as UNAUTHENTICATED for a wrong "
            "internal token); the server's error log line has the cause.",
            registry=registry,
        )
        self.duration = LabelledHistogram(
            RPC_DURATION_SECONDS,
            "Time from receiving an RPC to its answer, in seconds.",
            ["method", "code"],
            RPC_BUCKETS,
            registry,
        )
        self.node_duration = LabelledHistogram(
            NODE_DURATION_SECONDS,
            "Time spent in each request lifecycle node (classify_common.nodes), in seconds.",
            ["lifecycle_node"],
            NODE_BUCKETS,
            registry,
        )
        # Labelled counters, looked up once each (see observe).
        self._requests: dict[tuple[str, str], Counter] = {}
        # One lifecycle node's duration, about ten times per request in each process.
        self.observe_node = self.node_duration.observe

    def observe(
        self, method: str, code: str, seconds: float, exemplar: Mapping[str, str] | None = None
    ) -> None:
        """Count the call; its latency carries `exemplar` (a trace ID, where that trace is
        exported: classify_common.tracing.exemplar_for) as an OpenMetrics exemplar, so a
        slow bucket on a dashboard links to a trace of a request in it."""
        key = (method, code)
        requests = self._requests.get(key)
        if requests is None:
            requests = self._requests[key] = self.requests.labels(method, code)
        requests.inc()
        self.duration.observe(key, seconds, exemplar)


class RequestOutcomes:
    """Requests by the outcome their caller got, at the front door: one per Classify
    call and one per ClassifyBatch item, each counted once, when its outcome is final.

    The availability objective reads this and not classify_rpc_requests_total, which
    counts RPCs: a ClassifyBatch call whose items all failed is one RPC answered OK,
    and one GetResult poll per failed PROCESSING call would count its failure once a
    poll (or never, with no poll). A PROCESSING answer is counted when its work ends,
    with the work's outcome (orchestrator.dispatch)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            REQUESTS_TOTAL,
            "Requests (a Classify call, or one item of a ClassifyBatch call) by route "
            "(empty when refused before routing), final gRPC status code, and the "
            "ErrorInfo reason (empty for an answer); a PROCESSING answer is counted "
            "when its work ends, with that outcome.",
            ["route", "code", "reason"],
            registry=registry,
        )
        # Looked up once each: a labels() call per request costs more than the count.
        self._children: dict[tuple[str, str, str], Counter] = {}

    def count(self, route: str, code: str, reason: str = "", requests: int = 1) -> None:
        key = (route, code, reason)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(*key)
        child.inc(requests)


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
    """A Prometheus histogram kept as plain counts and exposed as a collector, exactly
    as prometheus_client's Histogram exposes it (exemplars included).

    NOTE: for histograms observed once or more per request. Histogram.observe takes
    two locks and walks the buckets in Python on every call, and validates every
    exemplar; here an observation is a bisect and one lock. A series is keyed by its
    label value (one label) or its tuple of label values (several).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = tuple(labels)
        self._bounds = tuple(sorted(float(bound) for bound in buckets))
        self._lock = threading.Lock()
        # Per series: the count in each bucket (not cumulative; +Inf last), then the
        # sum of the observations.
        self._series: dict[SeriesKey, list[float]] = {}
        # Per series: each bucket's latest exemplar, as prometheus_client keeps them.
        self._exemplars: dict[SeriesKey, list[Exemplar | None]] = {}
        self._created: dict[SeriesKey, float] = {}
        registry.register(self)

    def observe(
        self, key: SeriesKey, amount: float, exemplar: Mapping[str, str] | None = None
    ) -> None:
        """Observe `amount` in the series `key`; `exemplar`'s labels (a trace ID, say)
        must be valid label names of at most 128 characters in all."""
        series = self._series.get(key)
        if series is None:
            series = self._add_series(key)
        # The first bucket whose upper bound is at least `amount` (`le` buckets).
        index = bisect.bisect_left(self._bounds, amount)
        with self._lock:
            series[index] += 1
            series[-1] += amount
            if exemplar:
                self._exemplars[key][index] = Exemplar(dict(exemplar), amount, time.time())

    def _add_series(self, key: SeriesKey) -> list[float]:
        with self._lock:
            if key not in self._series:
                self._created[key] = time.time()
                self._exemplars[key] = [None] * (len(self._bounds) + 1)
                self._series[key] = [0.0] * (len(self._bounds) + 2)
            return self._series[key]

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=self._labels)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = [
                (key, list(series), list(self._exemplars[key]), self._created[key])
                for key, series in self._series.items()
            ]
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labels)
        bounds = [*(_go_float(bound) for bound in self._bounds), "+Inf"]
        for key, series, exemplars, created in snapshot:
            values = (key,) if isinstance(key, str) else key
            cumulative = 0.0
            buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
            for bound, count, exemplar in zip(bounds, series[:-1], exemplars, strict=True):
                cumulative += count
                if exemplar is None:
                    buckets.append((bound, cumulative))
                else:
                    buckets.append((bound, cumulative, exemplar))
            family.add_metric(values, buckets, series[-1])
            labels = dict(zip(self._labels, values, strict=True))
            family.samples.append(Sample(self._name + "_created", labels, created))
        yield family

"""What the supervisor hands each of its --processes workers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from classify_common.serving import METRICS_DISABLED
from orchestrator.metrics import LATE_ARRIVAL_SHARE
from orchestrator.state.connection import STATE_UP
from orchestrator.workers import WorkerMetrics, one_worker_of
from tests.conftest import orchestrator_settings


def test_each_worker_gets_its_share_of_the_sets_limits_rounded_up() -> None:
    settings = orchestrator_settings(
        processes=3,
        state_url="redis://127.0.0.1:6379/0",
        concurrency_min_limit=32,
        concurrency_max_limit=1024,
        upstream_calls_in_flight=2,
        metrics_port=9100,
    )
    worker = one_worker_of(settings, 50051)
    assert (worker.processes, worker.port, worker.metrics_port) == (1, 50051, METRICS_DISABLED)
    assert (worker.concurrency_min_limit, worker.concurrency_max_limit) == (11, 342)
    assert worker.upstream_calls_in_flight == 1
    assert worker.concurrency().max_limit == 342


def test_a_single_call_in_flight_is_not_divided_to_none() -> None:
    settings = orchestrator_settings(
        processes=4,
        state_url="redis://127.0.0.1:6379/0",
        concurrency_min_limit=1,
        concurrency_max_limit=1,
        upstream_calls_in_flight=1,
    )
    worker = one_worker_of(settings, 50051)
    assert (worker.concurrency_min_limit, worker.concurrency_max_limit) == (1, 1)
    assert worker.upstream_calls_in_flight == 1


class _Workers:
    """What WorkerMetrics asks of its supervisor: each slot's process and /metrics port
    (None while it is not serving)."""

    def __init__(self, sources: list[tuple[int, int | None, int | None]]) -> None:
        self.sources = sources

    def worker_metrics_sources(self) -> list[tuple[int, int | None, int | None]]:
        return self.sources


def test_merged_metrics_add_counts_and_keep_a_share_a_share() -> None:
    """Two workers' /metrics, each served over HTTP as a worker serves its own: a share
    of calls (0 to 1) summed read as 1.2, and a yes-or-no as 2; counts still add up."""
    registries, servers, ports = [], [], []
    for share, calls, state_up in ((0.6, 3, 1), (0.4, 4, 0)):
        registry = CollectorRegistry()
        Gauge(LATE_ARRIVAL_SHARE, "share", registry=registry).set(share)
        Gauge(STATE_UP, "up", registry=registry).set(state_up)
        Counter("classify_things", "count", registry=registry).inc(calls)
        server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        registries.append(registry)
        servers.append(server)
        ports.append(server.server_port)
    try:
        merged = CollectorRegistry()
        merged.register(WorkerMetrics(_Workers([(0, 100, ports[0]), (1, 101, ports[1])])))  # type: ignore[arg-type]
        assert merged.get_sample_value(LATE_ARRIVAL_SHARE) == 0.6
        # One worker without Redis: the set's state is down (summed, it read 1: up).
        assert merged.get_sample_value(STATE_UP) == 0
        assert merged.get_sample_value("classify_things_total") == 7
    finally:
        for server in servers:
            server.shutdown()


def test_a_workers_counts_stay_in_the_sets_after_it_exits_or_stops_answering() -> None:
    """Summed over the live workers only, every merged counter dipped when a worker
    was restarted (or its scrape failed), which Prometheus takes for a counter reset:
    increase() alerts fired with no event."""
    servers = {}
    for name, calls in (("first", 3), ("second", 4), ("replacement", 1)):
        registry = CollectorRegistry()
        Counter("classify_things", "count", registry=registry).inc(calls)
        Gauge("classify_in_flight", "now", registry=registry).set(calls)
        servers[name], _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = {name: server.server_port for name, server in servers.items()}
    workers = _Workers([(0, 100, port["first"]), (1, 101, port["second"])])
    merged = CollectorRegistry()
    merged.register(WorkerMetrics(workers))  # type: ignore[arg-type]
    try:
        assert merged.get_sample_value("classify_things_total") == 7
        # Slot 1 restarting: its new process has not reported its port yet.
        workers.sources = [(0, 100, port["first"]), (1, 102, None)]
        assert merged.get_sample_value("classify_things_total") == 7
        assert merged.get_sample_value("classify_in_flight") == 3  # gauges: live only
        # The new process serves, counting from 0 (1 so far).
        workers.sources = [(0, 100, port["first"]), (1, 102, port["replacement"])]
        assert merged.get_sample_value("classify_things_total") == 8
        # Slot 0 does not answer a scrape: it counts at its last one.
        servers["first"].shutdown()
        servers["first"].server_close()
        assert merged.get_sample_value("classify_things_total") == 8
    finally:
        for name in ("second", "replacement"):
            servers[name].shutdown()

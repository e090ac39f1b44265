"""What the supervisor hands each of its --processes workers."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)

from classify_common.serving import METRICS_DISABLED
from orchestrator import workers
from orchestrator.metrics import LATE_ARRIVAL_SHARE
from orchestrator.policy import OutlierSettings
from orchestrator.policy.concurrency import ConcurrencySettings, share_of
from orchestrator.routing import Backend
from orchestrator.state.connection import STATE_UP
from orchestrator.upstream.pool import BackendPool
from orchestrator.workers import LOOP_HEARTBEAT, WorkerMetrics, one_worker_of
from tests.conftest import REPO_ROOT, closed_port, orchestrator_settings


async def test_each_worker_gets_its_share_of_the_sets_limits_rounded_up() -> None:
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
    # What the file and the other flags give for the set, too: each worker read
    # routes.yaml's max_concurrency and held the whole of it, and 64 shadow calls.
    assert worker.shadow_max_in_flight == share_of(settings.shadow_max_in_flight, 3)
    assert worker.coalescing().processes == 3  # each sends a third of a replica's queue
    backend = Backend("capped", "topic-minilm", ("127.0.0.1:1",), 5.0, max_concurrency=10)
    static_only = replace(worker.concurrency(), adaptive=False)
    async with _pool_of(backend, static_only) as pool:
        assert (pool.max_concurrency, pool.concurrency_limit()) == (4, 4.0)
    async with _pool_of(backend, settings.concurrency()) as alone:
        assert alone.max_concurrency == 10


@contextlib.asynccontextmanager
async def _pool_of(
    backend: Backend, concurrency: ConcurrencySettings
) -> AsyncIterator[BackendPool]:
    pool = BackendPool(backend, OutlierSettings(), concurrency=concurrency)
    try:
        yield pool
    finally:
        await pool.close()


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


def test_merged_metrics_are_valid_openmetrics_with_each_families_earliest_creation() -> None:
    """Prometheus asks for OpenMetrics. Each worker's `*_created` came back as a gauge
    family of its own beside its counter, a name clash that OpenMetrics parsers
    refuse: the whole scrape was lost. It is the counter's own sample again, the
    earliest worker's."""
    servers, ports, created = [], [], list[float]()
    for calls in (3, 4):
        registry = CollectorRegistry()
        Counter("classify_things", "count", ["kind"], registry=registry).labels("a").inc(calls)
        Histogram("classify_wait_seconds", "wait", registry=registry).observe(0.1)
        created_at = registry.get_sample_value("classify_things_created", {"kind": "a"})
        assert created_at is not None
        created.append(created_at)
        server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        servers.append(server)
        ports.append(server.server_port)
        time.sleep(0.01)  # the second worker's counter is created later
    try:
        merged = CollectorRegistry()
        merged.register(WorkerMetrics(_Workers([(0, 100, ports[0]), (1, 101, ports[1])])))  # type: ignore[arg-type]
        exposition = generate_openmetrics(merged).decode()  # type: ignore[no-untyped-call]
        parsed = openmetrics_families(exposition)  # type: ignore[no-untyped-call]
        families = {family.name: family for family in parsed}
        things = {s.name: s.value for s in families["classify_things"].samples}
        assert things == {"classify_things_total": 7, "classify_things_created": min(created)}
        assert "classify_things_created" not in families
        wait = {s.name for s in families["classify_wait_seconds"].samples}
        assert "classify_wait_seconds_created" in wait
        # The classic text format still has them as one process serves them.
        assert merged.get_sample_value("classify_things_created", {"kind": "a"}) == min(created)
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


def serve_held_metrics(
    registry: CollectorRegistry, before_answering: Callable[[], object]
) -> ThreadingHTTPServer:
    """`registry` served over HTTP as a worker serves its /metrics (a thread per
    request), each request first calling `before_answering`, which may hold it; one
    that raises is answered with a closed connection."""

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            before_answering()
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def counting(calls: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("classify_things", "count", registry=registry).inc(calls)
    return registry


def test_the_workers_are_scraped_at_once_not_in_turn() -> None:
    """In turn, each worker that did not answer cost the set's scrape SCRAPE_TIMEOUT_SECONDS
    (5 s), and two stuck workers took it past Prometheus's 10 s timeout. Here each worker
    answers only once the other has been asked too: asked in turn, the first waits for
    the second in vain and neither answers."""
    both_asked = threading.Barrier(2, timeout=4)  # under SCRAPE_TIMEOUT_SECONDS
    servers = [serve_held_metrics(counting(calls), both_asked.wait) for calls in (3, 4)]
    try:
        merged = CollectorRegistry()
        sources = [(slot, 100 + slot, server.server_port) for slot, server in enumerate(servers)]
        merged.register(WorkerMetrics(_Workers(sources)))  # type: ignore[arg-type]
        assert merged.get_sample_value("classify_things_total") == 7
    finally:
        for server in servers:
            server.shutdown()


def test_scrapes_at_once_while_a_slot_changes_process_neither_dip_nor_count_twice() -> None:
    """prometheus_client serves each scrape on a thread of its own. A scrape still reading
    the old process of a slot finished after one that had seen its replacement, and
    carried the replacement's counts into the set's for good (double counting); in other
    interleavings merged counters dipped, or a scrape failed with KeyError (HTTP 500).
    A scrape that comes while one is under way now shares its answer (so the two never
    do the bookkeeping at once); the next one sees the replacement."""
    asked = itertools.count()
    held, release = threading.Event(), threading.Event()

    def hold_the_second_scrape() -> None:
        if next(asked) == 1:
            held.set()
            release.wait(timeout=10)

    servers = {
        "steady": serve_held_metrics(counting(3), hold_the_second_scrape),
        "old": serve_held_metrics(counting(4), lambda: None),
        "replacement": serve_held_metrics(counting(1), lambda: None),
    }
    port = {name: server.server_port for name, server in servers.items()}
    workers = _Workers([(0, 100, port["steady"]), (1, 101, port["old"])])
    merged = CollectorRegistry()
    merged.register(WorkerMetrics(workers))  # type: ignore[arg-type]
    totals: dict[str, float | None] = {}

    def scrape(name: str) -> threading.Thread:
        def read() -> None:
            totals[name] = merged.get_sample_value("classify_things_total")

        thread = threading.Thread(target=read)
        thread.start()
        return thread

    try:
        assert merged.get_sample_value("classify_things_total") == 7
        # A scrape that saw slot 1's old process is held reading slot 0...
        first = scrape("first")
        assert held.wait(timeout=10)
        # ...when slot 1's process is replaced, and a second scrape comes.
        workers.sources = [(0, 100, port["steady"]), (1, 102, port["replacement"])]
        second = scrape("second")
        second.join(timeout=1)  # unserialised, it finished meanwhile
        release.set()
        first.join(timeout=10)
        second.join(timeout=10)
        assert totals == {"first": 7, "second": 7}
        assert merged.get_sample_value("classify_things_total") == 8
    finally:
        release.set()
        for server in servers.values():
            server.shutdown()


def test_scrapes_that_come_while_one_waits_on_a_stopped_worker_share_it() -> None:
    """Queued behind one lock, each scrape waited for the one before it to give up on
    a stopped worker (5 s each): the third of three took 15 s, past Prometheus's 10."""
    asked = itertools.count()
    held, release = threading.Event(), threading.Event()

    def stopped_until_released() -> None:
        next(asked)
        held.set()
        release.wait(timeout=10)

    stopped = serve_held_metrics(counting(4), stopped_until_released)
    steady = serve_held_metrics(counting(3), lambda: None)
    sources = [(0, 100, steady.server_port), (1, 101, stopped.server_port)]
    merged = CollectorRegistry()
    merged.register(WorkerMetrics(_Workers(sources)))  # type: ignore[arg-type]
    totals: list[float | None] = []
    scrapes = [
        threading.Thread(
            target=lambda: totals.append(merged.get_sample_value("classify_things_total"))
        )
        for _ in range(3)
    ]
    try:
        scrapes[0].start()
        assert held.wait(timeout=10)
        for later in scrapes[1:]:
            later.start()
        # The later two are waiting for the first, not asking the stopped worker.
        scrapes[1].join(timeout=0.5)
        assert scrapes[1].is_alive()
        assert scrapes[2].is_alive()
        release.set()
        for thread in scrapes:
            thread.join(timeout=10)
        assert totals == [7, 7, 7]
        assert next(asked) == 1
    finally:
        release.set()
        stopped.shutdown()
        steady.shutdown()


# A worker's first step, in a process of its own: then the signal it gets when its
# parent dies, as prctl(PR_GET_PDEATHSIG) reads it.
STOP_WITH_PARENT = """
import ctypes, sys
from orchestrator.workers import stop_with_parent
stop_with_parent(int(sys.argv[1]))
signal = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(signal))
print(signal.value)
"""


def test_a_worker_stops_with_its_supervisor_or_at_once_when_it_is_gone() -> None:
    """Its supervisor killed, a worker served on unsupervised. The kernel now sends it
    SIGTERM when its parent dies; a parent that died before that was set leaves a
    worker whose parent is no longer the supervisor, and it exits before starting."""
    command = [sys.executable, "-c", STOP_WITH_PARENT]
    with_parent = subprocess.run(
        [*command, str(os.getpid())], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert (with_parent.returncode, with_parent.stdout) == (0, f"{int(signal.SIGTERM)}\n")
    orphaned = subprocess.run(
        [*command, str(os.getpid() + 1)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert orphaned.returncode == 1
    assert orphaned.stdout == ""
    assert orphaned.stderr == (
        f"orchestrator worker: its supervisor (process {os.getpid() + 1}) has exited\n"
    )


class _Answering(BaseHTTPRequestHandler):
    """Answers /metrics with the class's `status` and `body`; with `short`, promises more
    bytes than it sends and hangs up (a worker dying mid-answer)."""

    status = 200
    body = b""
    short = False

    def do_GET(self) -> None:
        self.send_response(self.status)
        length = len(self.body) + (100 if self.short else 0)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def answering(status: int, body: bytes, *, short: bool = False) -> ThreadingHTTPServer:
    handler = type("Handler", (_Answering,), {"status": status, "body": body, "short": short})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def test_a_worker_is_alive_while_its_loop_beats_and_its_metrics_answer_at_all() -> None:
    """/metrics is served by a thread of its own: it answered while the worker's event
    loop was stuck, so the heartbeat the loop sets is what tells. Any HTTP answer
    counts as one (a collector that raises makes it answer 500: every worker was to
    be restarted for one metrics bug)."""
    now = time.time()
    fresh = f"# TYPE {LOOP_HEARTBEAT} gauge\n{LOOP_HEARTBEAT} {now - 1}\n".encode()
    stale = f"# TYPE {LOOP_HEARTBEAT} gauge\n{LOOP_HEARTBEAT} {now - 60}\n".encode()
    servers = {
        "fresh": answering(200, fresh),
        "stale": answering(200, stale),
        "no heartbeat": answering(200, b"classify_things_total 3\n"),
        "collector raised": answering(500, b"error"),
    }
    try:
        alive = {
            name: await workers._alive(server.server_address[1]) for name, server in servers.items()
        }
    finally:
        for server in servers.values():
            server.shutdown()
            server.server_close()
    assert alive == {"fresh": True, "stale": False, "no heartbeat": True, "collector raised": True}
    assert not await workers._alive(closed_port())


def test_a_worker_scraped_through_no_proxy_and_cut_short_counts_as_unanswered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """urlopen sent loopback scrapes to $http_proxy (every worker unscraped), and an
    answer cut short (IncompleteRead, no OSError) failed the set's whole scrape."""
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    whole, cut = answering(200, b"classify_things_total 3\n"), answering(200, b"x", short=True)
    try:
        assert workers._scrape(whole.server_address[1]) == "classify_things_total 3\n"
        assert workers._scrape(cut.server_address[1]) is None
    finally:
        for server in (whole, cut):
            server.shutdown()
            server.server_close()

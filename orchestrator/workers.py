"""Several orchestrator processes on one port: a small supervisor and its workers.

    python -m orchestrator --processes N --state-url redis://...   (N or auto)

One Python process is one event loop: about a core of serving. With
`--processes N` this process becomes a supervisor that
- reserves the port (when it is 0, picks one) and starts N worker processes,
  each a whole orchestrator bound to that port with SO_REUSEPORT (gRPC sets it
  on Linux), so the kernel spreads new connections over them;
- restarts a worker that exits without being asked to, counted in
  `classify_worker_restarts_total`, after a pause if it had just started;
- passes SIGTERM (and SIGINT) on, so each worker drains as a lone server does,
  and exits once they have, killing any still there after the grace period;
- serves one /metrics for the set: at each scrape it reads every worker's own
  /metrics (on a loopback port each reported at start) and adds the samples up;
  a worker's counts stay in the set's after it exits (WorkerMetrics).

Each worker gets its share (1/N, rounded up) of the per-backend adaptive
concurrency limits and of the calls in flight per capability replica
(`one_worker_of`): those are per process, and the flags say what the set may
hold, so N workers do not send a backend N times what one process would.

What the merged /metrics loses: exemplars (a histogram bucket's trace ID), and
the difference between gauges that add up (calls in flight: the set's total)
and those that do not (a backend's adaptive concurrency limit reads as the sum
of the workers' limits: about the flags' value while none is engaged). Only the
few samples whose sum means nothing are merged otherwise: each `*_created` and
`process_start_time_seconds` is the earliest worker's, `process_max_fds` and
`classify_late_arrival_share` (a share of calls, 0 to 1) and
`classify_routes_file_refused` (1 or 0) the largest worker's,
`classify_state_up` (1 or 0) the lowest: 0 when any worker cannot reach Redis.
Health is per worker: a probe lands on one of them.

Workers share results and rate limits only through Redis (orchestrator.state),
which is why more than one process needs --state-url.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import operator
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from classify_common.metrics import MetricsEndpoint
from classify_common.serving import METRICS_DISABLED, serve_until_signal, wait_for_signal
from orchestrator.config import OrchestratorSettings
from orchestrator.metrics import LATE_ARRIVAL_SHARE, ROUTES_FILE_REFUSED
from orchestrator.state.connection import STATE_UP

WORKER_RESTARTS_TOTAL = "classify_worker_restarts_total"
WORKERS = "classify_workers"
# How long a new worker may take to serve (imports, routes, keys) before start fails.
WORKER_START_SECONDS = 120.0
# A worker that exits sooner than this after starting is restarted after a pause,
# so a worker that cannot start does not spin.
QUICK_EXIT_SECONDS = 5.0
RESTART_PAUSE_SECONDS = 1.0
# How often the supervisor looks for exited workers.
WATCH_SECONDS = 0.1
# Beyond --grace-seconds, how long a worker has to exit after SIGTERM before it is killed.
STOP_SLACK_SECONDS = 10.0
SCRAPE_TIMEOUT_SECONDS = 5.0

log = logging.getLogger(__name__)


class WorkerStartFailed(RuntimeError):
    """A worker exited, or did not report ready in time, while the set was starting."""


@dataclass
class Worker:
    index: int
    process: BaseProcess
    started: float
    metrics_port: int | None = None  # known once it reports ready


class WorkerSupervisor:
    """Starts, watches, restarts and stops the workers; serves their merged /metrics."""

    def __init__(self, settings: OrchestratorSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self._restarts = Counter(
            WORKER_RESTARTS_TOTAL,
            "Orchestrator worker processes that exited unasked and were started again.",
            registry=self.registry,
        )
        self._live = Gauge(
            WORKERS, "Orchestrator worker processes serving.", registry=self.registry
        )
        self._live.set_function(lambda: sum(1 for w in self._workers if w.metrics_port))
        self.registry.register(WorkerMetrics(self))
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[Worker] = []
        # The receiving end of each worker's ready pipe, by worker index.
        self._pipes: dict[int, Connection] = {}
        self._reserved: socket.socket | None = None
        self._metrics: MetricsEndpoint | None = None
        self._stopping = False
        self.port = settings.port
        self.metrics_port = 0

    def worker_metrics_sources(self) -> list[tuple[int, int | None, int | None]]:
        """(slot, process ID, metrics port or None until it reports ready) of each
        worker, for WorkerMetrics."""
        return [(w.index, w.process.pid, w.metrics_port) for w in self._workers]

    async def start(self) -> None:
        self._reserve_port()
        self._workers = [self._spawn(index) for index in range(self.settings.processes)]
        for worker in self._workers:
            await self._wait_ready(worker)
        if self.settings.metrics_port != METRICS_DISABLED:
            self._metrics = MetricsEndpoint(
                self.registry, self.settings.host, self.settings.metrics_port
            )
            self.metrics_port = self._metrics.port

    def _reserve_port(self) -> None:
        """Port 0: pick a free port and hold it (bound, not listening, SO_REUSEPORT)
        so the workers can all bind it and nothing else takes it meanwhile."""
        if self.port != 0:
            return
        reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind((self.settings.host, 0))
        self._reserved = reserved
        self.port = reserved.getsockname()[1]

    def _spawn(self, index: int) -> Worker:
        worker_settings = one_worker_of(self.settings, self.port)
        receive, send = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=run_worker,
            args=(worker_settings, index, send),
            name=f"orchestrator-worker-{index}",
        )
        process.start()
        send.close()  # the worker holds the only sending end: its exit closes the pipe
        worker = Worker(index, process, time.monotonic())
        self._pipes[index] = receive
        return worker

    async def _wait_ready(self, worker: Worker) -> None:
        pipe = self._pipes[worker.index]
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, pipe.poll, WORKER_START_SECONDS)
        try:
            message = pipe.recv() if ready else None
        except EOFError:
            message = None
        pipe.close()
        if not isinstance(message, dict):
            raise WorkerStartFailed(
                f"orchestrator worker {worker.index} did not start "
                f"(exit status {worker.process.exitcode}); its log says why"
            )
        worker.metrics_port = int(message["metrics_port"])

    async def watch(self) -> None:
        """Restart workers that exit unasked, until stop() is called."""
        while not self._stopping:
            await asyncio.sleep(WATCH_SECONDS)
            for position, worker in enumerate(self._workers):
                if worker.process.is_alive() or self._stopping:
                    continue
                log.warning(
                    "worker exited",
                    extra={
                        "worker": worker.index,
                        "pid": worker.process.pid,
                        "exit_status": worker.process.exitcode,
                    },
                )
                self._restarts.inc()
                if time.monotonic() - worker.started < QUICK_EXIT_SECONDS:
                    await asyncio.sleep(RESTART_PAUSE_SECONDS)
                replacement = self._spawn(worker.index)
                self._workers[position] = replacement
                try:
                    await self._wait_ready(replacement)
                except WorkerStartFailed as exc:
                    log.error("worker restart failed", extra={"error": str(exc)})

    async def stop(self, grace_seconds: float | None = None) -> None:
        """SIGTERM to every worker (each drains), then wait; kill what is left after the
        grace period and some slack."""
        self._stopping = True
        grace = self.settings.grace_seconds if grace_seconds is None else grace_seconds
        for worker in self._workers:
            if worker.process.is_alive() and worker.process.pid is not None:
                os.kill(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace + STOP_SLACK_SECONDS
        loop = asyncio.get_running_loop()
        for worker in self._workers:
            left = max(deadline - time.monotonic(), 0)
            await loop.run_in_executor(None, worker.process.join, left)
            if worker.process.is_alive():
                log.warning("worker killed after the grace period", extra={"worker": worker.index})
                worker.process.kill()
                await loop.run_in_executor(None, worker.process.join)
        if self._metrics is not None:
            self._metrics.close()
        if self._reserved is not None:
            self._reserved.close()


def one_worker_of(settings: OrchestratorSettings, port: int) -> OrchestratorSettings:
    """A worker's settings: one process on the set's `port`, its /metrics on a port of
    its own, and its share of what the flags set for the whole set.

    Each worker keeps its own adaptive concurrency limit per backend and its own
    coalescers, so N workers would hold N times the calls in flight a backend (or a
    replica) should see. The flags' values are therefore for the set, and each of N
    workers gets 1/N of them, rounded up (at least 1): the lowest and highest
    adaptive limits and the calls in flight per replica."""
    workers = settings.processes
    return replace(
        settings,
        processes=1,
        port=port,
        metrics_port=METRICS_DISABLED,
        concurrency_min_limit=share_of(settings.concurrency_min_limit, workers),
        concurrency_max_limit=share_of(settings.concurrency_max_limit, workers),
        upstream_calls_in_flight=share_of(settings.upstream_calls_in_flight, workers),
    )


def share_of(total: int, workers: int) -> int:
    """One worker's part of `total`: total / workers rounded up, at least 1."""
    return max(1, -(-total // workers))


# One sample of the merged /metrics: (family, sample name, sorted labels).
SampleKey = tuple[str, str, tuple[tuple[str, str], ...]]
# Families whose samples only grow within a process: a worker that goes takes them along.
_CUMULATIVE_TYPES = frozenset({"counter", "histogram", "summary"})


class WorkerMetrics(Collector):
    """The workers' own /metrics, added up sample by sample (see the module docstring).

    Counts do not go backwards when a worker does: the last counts of a worker that
    exited are carried into the set's from then on, and a worker that cannot be
    scraped (restarting, slow) counts at its last scrape. Summed over the live
    workers only, every merged counter dipped at a restart, which Prometheus takes
    for a reset: increase() alerts (a refused routes edit, internal errors) fired
    with no event. Gauges are the live workers' only."""

    def __init__(self, supervisor: WorkerSupervisor) -> None:
        self._supervisor = supervisor
        # Slot -> (its process, that process's cumulative samples at its last scrape).
        self._last: dict[int, tuple[int | None, dict[SampleKey, float]]] = {}
        # Cumulative samples of the processes that have left their slots.
        self._carried: dict[SampleKey, float] = {}
        self._families: dict[str, tuple[str, str]] = {}

    def collect(self) -> Iterator[Metric]:
        values: dict[SampleKey, float] = dict(self._carried)
        for slot, process, port in self._supervisor.worker_metrics_sources():
            last = self._last.get(slot)
            if last is not None and last[0] != process:
                for key, value in last[1].items():  # its process was replaced
                    self._carried[key] = self._carried.get(key, 0.0) + value
                    values[key] = values.get(key, 0.0) + value
                del self._last[slot]
                last = None
            text = None if port is None else _scrape(port)
            if text is None:
                for key, value in (last[1] if last is not None else {}).items():
                    values[key] = values.get(key, 0.0) + value
                continue
            self._last[slot] = (process, self._merge(text, values))
        merged: dict[str, Metric] = {}
        for (family_name, sample_name, labels), value in values.items():
            if family_name not in merged:
                documentation, kind = self._families[family_name]
                merged[family_name] = Metric(family_name, documentation, kind)
            merged[family_name].add_sample(sample_name, dict(labels), value)
        yield from merged.values()

    def _merge(self, text: str, values: dict[SampleKey, float]) -> dict[SampleKey, float]:
        """Merge one worker's /metrics into `values`; return its cumulative samples."""
        cumulative: dict[SampleKey, float] = {}
        for family in text_string_to_metric_families(text):
            self._families.setdefault(family.name, (family.documentation, family.type))
            merge = merge_rule(family)
            counts = family.type in _CUMULATIVE_TYPES
            for sample in family.samples:
                key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                created = sample.name.endswith("_created")
                if counts and not created:
                    cumulative[key] = sample.value
                earlier = values.get(key)
                if earlier is None:
                    values[key] = sample.value
                elif created:  # the earliest start
                    values[key] = min(earlier, sample.value)
                else:
                    values[key] = merge(earlier, sample.value)
        return cumulative


def _scrape(port: int) -> str | None:
    """A worker's own /metrics, or None when it does not answer."""
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_SECONDS) as answer:
            text: str = answer.read().decode()
    except OSError:
        return None
    return text


# Samples whose sum means nothing: a start time, a per-process limit, a share (0-1),
# a yes or no (summed, classify_state_up read 2 with two workers, and the alert's
# `== 0` fired only once every worker had lost Redis).
_EARLIEST = {"process_start_time_seconds"}
_LARGEST = {"process_max_fds", LATE_ARRIVAL_SHARE, ROUTES_FILE_REFUSED}
_LOWEST = {STATE_UP}


def merge_rule(family: Metric) -> Callable[[float, float], float]:
    """How one sample of `family` from two workers becomes the set's: added up,
    except for the few whose sum means nothing (see the module docstring)."""
    if family.name in _EARLIEST or family.name in _LOWEST:
        return min
    if family.name in _LARGEST:
        return max
    return operator.add


def run_worker(settings: OrchestratorSettings, index: int, ready: Connection) -> None:
    """A worker process's main: one orchestrator on the shared port; reports its
    metrics port to the supervisor once serving."""
    # Imported here: the supervisor itself never builds a server.
    from orchestrator.server import main_worker

    main_worker(settings, index, ready)


async def supervise(settings: OrchestratorSettings) -> None:
    supervisor = WorkerSupervisor(settings)

    async def start() -> dict[str, object]:
        await supervisor.start()
        return {
            "port": supervisor.port,
            "metrics_port": supervisor.metrics_port,
            "processes": settings.processes,
        }

    async def serve_and_watch(signalled: asyncio.Event) -> None:
        watching = asyncio.create_task(supervisor.watch(), name="worker-watch")
        try:
            await wait_for_signal(signalled)
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching

    await serve_until_signal(supervisor, start, log, wait=serve_and_watch)

"""Several orchestrator processes on one port: a small supervisor and its workers.

    python -m orchestrator --processes N --state-url redis://...   (N or auto)

One Python process is one event loop: about a core of serving. With
`--processes N` this process becomes a supervisor that
- reserves the port (when it is 0, picks one; a fixed port something already
  listens on is refused) and starts N worker processes, each a whole
  orchestrator bound to that port with SO_REUSEPORT (gRPC sets it on Linux), so
  the kernel spreads new connections over them;
- restarts a worker that exits without being asked to, each slot on its own,
  counted in `classify_worker_restarts_total`: at once after a worker that had
  served a while, otherwise after a pause that doubles with each quick exit in a
  row (a worker that cannot start does not spin); a replacement that does not
  report ready in WORKER_START_SECONDS is killed and started again;
- stops a worker whose /metrics stops answering (a stopped or frozen process) or
  whose event loop stops beating (stuck in a blocking call): SIGCONT and SIGTERM, so
  it drains if it can, SIGKILL after the grace period; it is then restarted;
- on SIGTERM (SIGINT, SIGHUP) sends each worker SIGTERM, so each drains as a lone server
  does, and exits once they have, killing any still there after the grace
  period; a worker drains by itself when the supervisor dies (killed), so none
  serves unsupervised;
- serves one /metrics for the set: at each scrape it reads every worker's own
  /metrics (on a loopback port each reported at start) and adds the samples up;
  a worker's counts up to its last scrape stay in the set's after it exits
  (WorkerMetrics); what it counted after that scrape is lost with it.

Each worker gets its share (1/N, rounded up) of the per-backend adaptive
concurrency limits, of routes.yaml's `max_concurrency`, of the calls in flight
per capability replica and of the shadow calls in flight (`one_worker_of`):
those are per process, and the flags and the file say what the set may hold,
so N workers do not send a backend N times what one process would.

What the merged /metrics loses: exemplars (a histogram bucket's trace ID), and
the difference between gauges that add up (calls in flight: the set's total)
and those that do not (a backend's adaptive concurrency limit reads as the sum
of the workers' limits: about the flags' value while none is engaged). Only the
few samples whose sum means nothing are merged otherwise: each `*_created` and
`process_start_time_seconds` and `classify_event_loop_heartbeat_timestamp_seconds`
the earliest worker's, `process_max_fds` and
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
import http.client
import logging
import multiprocessing
import operator
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from classify_common.early_stop import stop_when_parent_dies
from classify_common.metrics import MetricsEndpoint
from classify_common.serving import (
    METRICS_DISABLED,
    ShutdownSignal,
    bare_host,
    listen_address,
    not_bound,
    open_metrics_endpoint,
    serve_until_signal,
    wait_for_signal,
)
from orchestrator.config import OrchestratorSettings
from orchestrator.metrics import API_KEYS_FILE_REFUSED, LATE_ARRIVAL_SHARE, ROUTES_FILE_REFUSED
from orchestrator.policy.concurrency import share_of
from orchestrator.state.connection import STATE_UP

WORKER_RESTARTS_TOTAL = "classify_worker_restarts_total"
WORKERS = "classify_workers"
# How long a new worker may take to serve (imports, routes, keys); one that takes longer
# is killed (a failed start: the set does not start, or its slot is started again).
WORKER_START_SECONDS = 120.0
# A worker that exits before it has served this long is restarted after a pause, so a
# worker that cannot start (a refused routes file on disk) does not spin: the first
# pause is RESTART_PAUSE_SECONDS, each next one in a row twice the last, up to
# RESTART_PAUSE_MAX_SECONDS. One that served longer is restarted at once.
QUICK_EXIT_SECONDS = 5.0
RESTART_PAUSE_SECONDS = 1.0
RESTART_PAUSE_MAX_SECONDS = 30.0
# How often the supervisor looks for exited workers.
WATCH_SECONDS = 0.1
# How often the supervisor asks each serving worker's /metrics whether it still answers
# and its event loop still beats, how long it waits, and after how many failed checks in
# a row it stops the worker (a stopped or frozen process, or a loop stuck in a blocking
# call: it holds its connections, and the calls and health checks on them hang).
LIVENESS_SECONDS = 5.0
LIVENESS_TIMEOUT_SECONDS = 3.0
LIVENESS_FAILURES = 3
# A worker's event loop sets LOOP_HEARTBEAT (Unix time) every LOOP_HEARTBEAT_SECONDS;
# one older than LOOP_STALL_SECONDS fails a liveness check. /metrics is served by a
# thread of its own, which answers while the loop is stuck; the heartbeat does not.
# Far above any lag of a loop that is merely overloaded (a worker that is only busy
# must not be restarted into more load).
LOOP_HEARTBEAT = "classify_event_loop_heartbeat_timestamp_seconds"
LOOP_HEARTBEAT_SECONDS = 1.0
LOOP_STALL_SECONDS = 20.0
# How long an exited (or killed) worker may take to be reaped, for its exit status.
REAP_SECONDS = 5.0
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
    metrics_port: int | None = None  # known once it reports ready
    serving_since: float | None = None  # time.monotonic() when it reported ready
    unanswered: int = 0  # liveness checks in a row it failed
    # time.monotonic() when the supervisor stopped it for failing them; None: it did not.
    retired_at: float | None = None

    def served_long(self) -> bool:
        """Whether it served QUICK_EXIT_SECONDS or longer (so its exit was no quick one).
        One stopped for failing its liveness checks did not: whatever froze it may
        freeze the next, which then waits its pause."""
        return (
            self.serving_since is not None
            and self.retired_at is None
            and time.monotonic() - self.serving_since >= QUICK_EXIT_SECONDS
        )


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
        # Alive, not only started: a dead worker keeps its port until its replacement
        # is started, and counted for its whole restart pause (up to 30 s), a crash
        # loop read as a full set.
        self._live.set_function(
            lambda: sum(1 for w in self._workers if w.metrics_port and w.process.is_alive())
        )
        self.registry.register(WorkerMetrics(self))
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[Worker] = []
        # The receiving end of each worker's ready pipe, by worker index.
        self._pipes: dict[int, Connection] = {}
        # Each slot's last pause before a restart (0: its last worker served long).
        self._pauses: dict[int, float] = {}
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
            self._metrics = open_metrics_endpoint(
                self.registry,
                self.settings.host,
                self.settings.metrics_port,
                self.settings.names("metrics_port"),
            )
            self.metrics_port = self._metrics.port

    def _reserve_port(self) -> None:
        """Hold the port (bound, not listening, SO_REUSEPORT) so that the workers can
        all bind it and nothing else takes it meanwhile; port 0 picks a free one.

        A fixed port something already listens on is refused, as a lone server refuses
        it: the workers bind with SO_REUSEPORT, which a port's other SO_REUSEPORT
        listeners allow, so a second supervisor started on the port served beside the
        first without a word, the kernel splitting connections between the two. The
        probe binds without SO_REUSEPORT, which any listener there refuses."""
        host = bare_host(self.settings.host)
        in_use = not_bound(self.settings.names("port"), listen_address(host, self.port))
        found = socket.getaddrinfo(
            host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        if self.port != 0:
            # Every address the host names: gRPC binds each (`localhost`: ::1 and
            # 127.0.0.1), so a listener on any one of them shares the port.
            for family, kind, protocol, _, address in dict.fromkeys(
                (f, k, p, "", a) for f, k, p, _, a in found
            ):
                _refuse_if_listened_on(family, kind, protocol, address, in_use)
        family, kind, protocol, _, address = found[0]
        reserved = socket.socket(family, kind, protocol)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            reserved.bind(address)
        except OSError as exc:
            reserved.close()
            raise in_use from exc
        self._reserved = reserved
        self.port = reserved.getsockname()[1]

    def _spawn(self, index: int) -> Worker:
        """Start worker `index`; OSError when no process could be started.

        NOTE: call it on the event loop's thread (the main thread), never from an
        executor: the kernel sends a worker its parent-death signal (run_worker) when
        the *thread* that forked it exits, so a worker forked by an executor thread
        would be stopped when that idle thread is retired."""
        worker_settings = one_worker_of(self.settings, self.port)
        receive, send = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=run_worker,
            args=(worker_settings, index, send, os.getpid()),
            name=f"orchestrator-worker-{index}",
        )
        process.start()
        send.close()  # the worker holds the only sending end: its exit closes the pipe
        worker = Worker(index, process)
        self._pipes[index] = receive
        return worker

    async def _wait_ready(self, worker: Worker) -> None:
        """Wait for `worker` to report ready. WorkerStartFailed when it exits first, or
        does not report within WORKER_START_SECONDS: then it is killed, so that a hung
        start neither holds its slot nor outlives the set."""
        pipe = self._pipes.pop(worker.index)
        process = worker.process
        hung = False
        try:
            message = await _receive(pipe, WORKER_START_SECONDS)
        except TimeoutError:
            message, hung = None, True
        except EOFError:
            message = None
        finally:
            pipe.close()
        if isinstance(message, dict):
            worker.metrics_port = int(message["metrics_port"])
            worker.serving_since = time.monotonic()
            return
        loop = asyncio.get_running_loop()
        if hung:
            process.kill()
        # Its end of the pipe closes as it exits, before it can be reaped: read at once,
        # its exit status was None.
        await loop.run_in_executor(None, process.join, REAP_SECONDS)
        if hung:
            raise WorkerStartFailed(
                f"orchestrator worker {worker.index} did not report ready in "
                f"{WORKER_START_SECONDS:g}s and was killed; its log says how far it got"
            )
        raise WorkerStartFailed(
            f"orchestrator worker {worker.index} did not start "
            f"(exit status {process.exitcode}); its log says why"
        )

    async def watch(self) -> None:
        """Restart workers that exit unasked, and kill those that stop answering, until
        stop() is called or this is cancelled.

        Each exited worker is restarted by a task of its own, so that a replacement
        that is slow to start (up to WORKER_START_SECONDS) does not keep the others'
        exits unnoticed meanwhile."""
        restarting: dict[int, asyncio.Task[None]] = {}
        liveness = asyncio.create_task(self._check_liveness(), name="worker-liveness")
        try:
            while True:
                await asyncio.sleep(WATCH_SECONDS)
                if self._stopping:
                    return
                for worker in self._workers:
                    task = restarting.get(worker.index)
                    if (task is not None and not task.done()) or worker.process.is_alive():
                        continue
                    if task is None or task.cancelled() or task.exception() is None:
                        log.warning(
                            "worker exited",
                            extra={
                                "worker": worker.index,
                                "pid": worker.process.pid,
                                "exit_status": worker.process.exitcode,
                            },
                        )
                    else:  # an error starting its replacement (a failed fork): once more
                        log.error("worker restart failed", exc_info=task.exception())
                    restarting[worker.index] = asyncio.create_task(
                        self._restart(worker), name=f"worker-restart-{worker.index}"
                    )
        finally:
            tasks = [liveness, *restarting.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _restart(self, exited: Worker) -> None:
        """Start `exited`'s slot again, after its pause (_restart_pause), until a
        replacement reports ready; one that does not is replaced in turn."""
        index = exited.index
        while True:
            pause = self._restart_pause(exited)
            log.warning("worker restarting", extra={"worker": index, "pause_seconds": pause})
            await asyncio.sleep(pause)
            if self._stopping:
                return
            try:
                replacement = self._spawn(index)
            except OSError as exc:
                # No process (EAGAIN, ENOMEM, EMFILE): nothing started, nothing counted,
                # and the next try waits longer, as after a quick exit.
                log.error("worker restart failed", extra={"worker": index, "error": str(exc)})
                exited = Worker(index, exited.process)
                continue
            self._restarts.inc()
            self._workers[index] = replacement
            try:
                await self._wait_ready(replacement)
            except WorkerStartFailed as exc:
                log.error("worker restart failed", extra={"worker": index, "error": str(exc)})
                exited = replacement
                continue
            return

    def _restart_pause(self, exited: Worker) -> float:
        """How long to wait before starting `exited`'s slot again: none after a worker
        that served long; otherwise RESTART_PAUSE_SECONDS, doubled for each quick exit
        in a row, up to RESTART_PAUSE_MAX_SECONDS. A worker that cannot start (a refused
        routes file stays on disk) failed over and over at a fixed 1 s pause: 6 restarts
        in 7 s, each a whole start's CPU."""
        if exited.served_long():
            pause = 0.0
        else:
            pause = min(
                max(2 * self._pauses.get(exited.index, 0.0), RESTART_PAUSE_SECONDS),
                RESTART_PAUSE_MAX_SECONDS,
            )
        self._pauses[exited.index] = pause
        return pause

    async def _check_liveness(self) -> None:
        """Every LIVENESS_SECONDS, ask each serving worker's /metrics, all at once, whether
        it answers and its loop still beats (_alive); stop a worker that has failed
        LIVENESS_FAILURES checks in a row (the watch loop then restarts it). A stopped or
        frozen worker was never noticed: it went on counting in classify_workers, and
        the calls and health checks the kernel gave its connections hung to their
        deadlines.

        Stopped as a stop stops it: SIGCONT (a stopped process runs again) and SIGTERM,
        so the calls it holds drain if it can; killed only if it is still there after
        the grace period and STOP_SLACK_SECONDS (a loop stuck for good never runs its
        SIGTERM handler)."""
        loop = asyncio.get_running_loop()
        next_check = loop.time()
        grace = self.settings.grace_seconds + STOP_SLACK_SECONDS
        while not self._stopping:
            next_check += LIVENESS_SECONDS
            await asyncio.sleep(max(next_check - loop.time(), 0.0))
            serving = [
                (worker, worker.metrics_port)
                for worker in self._workers
                if worker.metrics_port is not None and worker.process.is_alive()
            ]
            answers = await asyncio.gather(*(_alive(port) for _, port in serving))
            for (worker, _), answered in zip(serving, answers, strict=True):
                worker.unanswered = 0 if answered else worker.unanswered + 1
                if self._stopping or not worker.process.is_alive():
                    continue
                fields = {"worker": worker.index, "pid": worker.process.pid}
                if worker.retired_at is not None:
                    if time.monotonic() - worker.retired_at > grace:
                        log.error("worker killed after the grace period", extra=fields)
                        worker.process.kill()
                elif worker.unanswered >= LIVENESS_FAILURES:
                    log.error(
                        "worker not answering; stopping it",
                        extra={**fields, "checks": worker.unanswered},
                    )
                    worker.retired_at = time.monotonic()
                    _stop_process(worker.process)

    async def stop(self, grace_seconds: float | None = None) -> None:
        """SIGTERM to every worker (each drains), then wait; kill what is left after the
        grace period and some slack."""
        self._stopping = True
        grace = self.settings.grace_seconds if grace_seconds is None else grace_seconds
        for worker in self._workers:
            if worker.process.is_alive():
                # SIGCONT first: a stopped worker (SIGSTOP) drains too, rather than
                # being killed past the grace.
                _stop_process(worker.process)
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


def _refuse_if_listened_on(
    family: int, kind: int, protocol: int, address: Any, in_use: OSError
) -> None:
    """Raise `in_use` when something is bound to `address` (a probe bound without
    SO_REUSEPORT, which any listener there refuses, its SO_REUSEPORT included)."""
    with socket.socket(family, kind, protocol) as probe:
        # The last run's connections in TIME_WAIT do not count as in use.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # As gRPC binds [::]: both stacks, so an IPv4 listener is found too.
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            probe.bind(address)
        except OSError as exc:
            raise in_use from exc


async def _receive(pipe: Connection, seconds: float) -> object:
    """The next message on `pipe`, waited for on the event loop rather than on an
    executor thread: slots restarting at once would each hold one of the few executor
    threads for up to WORKER_START_SECONDS, and stop()'s joins would queue behind
    them. EOFError once the sending end has closed; TimeoutError after `seconds`."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(pipe.fileno(), ready)
    try:
        async with asyncio.timeout(seconds):
            await readable
    finally:
        loop.remove_reader(pipe.fileno())
    # Readable: the whole message (a few bytes, written at once) or the end of the pipe.
    return pipe.recv()


def _stop_process(process: BaseProcess) -> None:
    """SIGCONT, then SIGTERM: a stopped process runs again, and drains."""
    if process.pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGCONT)
        os.kill(process.pid, signal.SIGTERM)


async def _alive(port: int) -> bool:
    """Whether a worker's /metrics (on loopback `port`) answers, all of it, within
    LIVENESS_TIMEOUT_SECONDS, and its event loop's heartbeat (LOOP_HEARTBEAT) is no
    older than LOOP_STALL_SECONDS; asked without blocking the event loop. Any HTTP
    answer counts (a collector that raises makes /metrics answer 500: a bug to fix,
    not a reason to restart every worker); so does one without a heartbeat."""
    try:
        async with asyncio.timeout(LIVENESS_TIMEOUT_SECONDS):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                answer = await reader.read()  # to the end: the worker wrote all of it
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False
    if not answer.startswith(b"HTTP/"):
        return False
    beat = _heartbeat(answer)
    return beat is None or time.time() - beat <= LOOP_STALL_SECONDS


def _heartbeat(answer: bytes) -> float | None:
    """The LOOP_HEARTBEAT value in an HTTP answer holding /metrics text, or None."""
    start = answer.find(b"\n" + LOOP_HEARTBEAT.encode() + b" ")
    if start < 0:
        return None
    line = answer[start + 1 :].split(b"\n", 1)[0]
    try:
        return float(line.split()[1])
    except (IndexError, ValueError):
        return None


def one_worker_of(settings: OrchestratorSettings, port: int) -> OrchestratorSettings:
    """A worker's settings: one process on the set's `port`, its /metrics on a port of
    its own, and its share of what the flags set for the whole set.

    Each worker keeps its own adaptive concurrency limit per backend and its own
    coalescers, so N workers would hold N times the calls in flight a backend (or a
    replica) should see. The flags' values are therefore for the set, and each of N
    workers gets 1/N of them, rounded up (at least 1): the lowest and highest
    adaptive limits, the calls in flight per replica and the shadow calls in flight;
    and of each backend's routes.yaml `max_concurrency` (`set_processes`), which every
    worker reads from the file."""
    workers = settings.processes
    return replace(
        settings,
        processes=1,
        set_processes=workers,
        port=port,
        metrics_port=METRICS_DISABLED,
        concurrency_min_limit=share_of(settings.concurrency_min_limit, workers),
        concurrency_max_limit=share_of(settings.concurrency_max_limit, workers),
        upstream_calls_in_flight=share_of(settings.upstream_calls_in_flight, workers),
        shadow_max_in_flight=share_of(settings.shadow_max_in_flight, workers),
    )


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
    with no event. Gauges are the live workers' only.

    What no pull can keep: the counts a worker made after the last scrape before it
    exited (the set's counters miss them from then on)."""

    def __init__(self, supervisor: WorkerSupervisor) -> None:
        self._supervisor = supervisor
        # prometheus_client's HTTP server runs each scrape on a thread of its own, and
        # two at once (Prometheus and a person's curl) interleaved the bookkeeping below
        # while a slot's process changed: merged counters dipped, a worker's counts were
        # carried twice (for good), or the scrape failed (KeyError, HTTP 500).
        self._lock = threading.Lock()
        # The scrape under way, which a scrape arriving meanwhile waits for and shares:
        # queued behind the lock instead, each waited for the one before it, and with a
        # worker stopped (5 s to give up on it) the third of three took 15 s, past
        # Prometheus's 10. Only one scrape at a time does the bookkeeping below.
        self._under_way: Future[list[Metric]] | None = None
        # Slot -> (its process, that process's cumulative samples at its last scrape).
        self._last: dict[int, tuple[int | None, dict[SampleKey, float]]] = {}
        # Cumulative samples of the processes that have left their slots.
        self._carried: dict[SampleKey, float] = {}
        self._families: dict[str, tuple[str, str]] = {}

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            under_way = self._under_way
            leads = under_way is None
            if under_way is None:
                under_way = self._under_way = Future()
        if not leads:
            yield from under_way.result()
            return
        try:
            merged = self._merged()
        except BaseException as exc:
            under_way.set_exception(exc)
            raise
        else:
            under_way.set_result(merged)
        finally:
            with self._lock:
                self._under_way = None
        yield from merged

    def _merged(self) -> list[Metric]:
        """The set's metrics now; only the scrape under way calls it."""
        sources = self._supervisor.worker_metrics_sources()
        texts = _scrape_all([port for _, _, port in sources])
        values: dict[SampleKey, float] = dict(self._carried)
        for (slot, process, _), text in zip(sources, texts, strict=True):
            last = self._last.get(slot)
            if last is not None and last[0] != process:
                for key, value in last[1].items():  # its process was replaced
                    self._carried[key] = self._carried.get(key, 0.0) + value
                    values[key] = values.get(key, 0.0) + value
                del self._last[slot]
                last = None
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
        return list(merged.values())

    def _merge(self, text: str, values: dict[SampleKey, float]) -> dict[SampleKey, float]:
        """Merge one worker's /metrics into `values`; return its cumulative samples."""
        cumulative: dict[SampleKey, float] = {}
        types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            name = created_owner(family, types) or family.name
            self._families.setdefault(name, (family.documentation, family.type))
            merge = merge_rule(family)
            counts = family.type in _CUMULATIVE_TYPES
            for sample in family.samples:
                key = (name, sample.name, tuple(sorted(sample.labels.items())))
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


def created_owner(family: Metric, types: dict[str, str]) -> str | None:
    """The counter, histogram or summary whose creation times `family` holds, if it
    is one's `*_created`.

    The text format a worker serves puts `x_created` in a gauge family of its own;
    merged as such, the set's /metrics in OpenMetrics (what Prometheus asks for)
    had a gauge `x_created` beside the counter `x`, a name clash that OpenMetrics
    parsers refuse. Put back in `x`'s family, it is exposed as one process's is."""
    if family.type != "gauge" or not family.name.endswith("_created"):
        return None
    owner = family.name.removesuffix("_created")
    return owner if types.get(owner) in _CUMULATIVE_TYPES else None


def _scrape_all(ports: list[int | None]) -> list[str | None]:
    """Each worker's own /metrics (None for a port that is None), asked all at once: in
    turn, each worker that did not answer cost SCRAPE_TIMEOUT_SECONDS, and two stuck
    ones took the set's scrape past Prometheus's 10 s timeout."""
    asked = sorted({port for port in ports if port is not None})
    if not asked:
        return [None] * len(ports)
    with ThreadPoolExecutor(len(asked), thread_name_prefix="worker-scrape") as scraping:
        texts = dict(zip(asked, scraping.map(_scrape, asked), strict=True))
    return [None if port is None else texts[port] for port in ports]


# No proxy for loopback scrapes: with http_proxy set (and 127.0.0.1 not in no_proxy),
# urlopen sent every worker's scrape to the proxy, and the set's /metrics had none.
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _scrape(port: int) -> str | None:
    """A worker's own /metrics, or None when it does not answer, or not all of it (a
    worker that dies mid-answer raised IncompleteRead, which failed the set's scrape)."""
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with _LOOPBACK.open(url, timeout=SCRAPE_TIMEOUT_SECONDS) as answer:
            text: str = answer.read().decode()
    except (OSError, http.client.HTTPException, ValueError):
        return None
    return text


# Samples whose sum means nothing: a start time, a per-process limit, a share (0-1),
# a yes or no (summed, classify_state_up read 2 with two workers, and the alert's
# `== 0` fired only once every worker had lost Redis).
_EARLIEST = {"process_start_time_seconds", LOOP_HEARTBEAT}  # the heartbeat: the stalest
_LARGEST = {"process_max_fds", LATE_ARRIVAL_SHARE, ROUTES_FILE_REFUSED, API_KEYS_FILE_REFUSED}
_LOWEST = {STATE_UP}


def merge_rule(family: Metric) -> Callable[[float, float], float]:
    """How one sample of `family` from two workers becomes the set's: added up,
    except for the few whose sum means nothing (see the module docstring)."""
    if family.name in _EARLIEST or family.name in _LOWEST:
        return min
    if family.name in _LARGEST:
        return max
    return operator.add


def run_worker(
    settings: OrchestratorSettings, index: int, ready: Connection, supervisor: int
) -> None:
    """A worker process's main: one orchestrator on the shared port; reports its
    metrics port to the supervisor (process `supervisor`) once serving, and drains
    when the supervisor dies."""
    stop_with_parent(supervisor)
    # Imported here: the supervisor itself never builds a server.
    from orchestrator.server import main_worker

    main_worker(settings, index, ready)


def stop_with_parent(parent: int) -> None:
    """Have the kernel send this process SIGTERM (it drains) when its parent dies, or
    exit now if process `parent` is no longer its parent (it died before this ran).

    A supervisor that died (SIGKILL, the OOM killer; SIGHUP, before it was handled)
    left its workers serving the port unsupervised, with no /metrics for the set and
    nothing to restart them. Linux only; elsewhere, nothing."""
    if not stop_when_parent_dies(parent):
        sys.exit(f"orchestrator worker: its supervisor (process {parent}) has exited")


async def supervise(settings: OrchestratorSettings) -> None:
    supervisor = WorkerSupervisor(settings)

    async def start() -> dict[str, object]:
        await supervisor.start()
        return {
            "port": supervisor.port,
            # null with --metrics-port -1: 0 would read as "any free port".
            "metrics_port": supervisor.metrics_port or None,
            "processes": settings.processes,
        }

    async def serve_and_watch(signalled: ShutdownSignal) -> None:
        watching = asyncio.create_task(supervisor.watch(), name="worker-watch")
        try:
            await wait_for_signal(signalled)
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching

    await serve_until_signal(supervisor, start, log, wait=serve_and_watch)

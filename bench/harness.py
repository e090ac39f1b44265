"""What the benchmarks share: the texts, in-process ceiling probes, a closed-loop gRPC
client, server processes, CPU time from /proc, /metrics scrapes and a progress line.

The host these run on is shared and its speed drifts by a third within minutes,
so every server figure is compared with a ceiling probed right before and right
after it (`AdjacentCeiling`), and each load level records the CPU that every
process spent over it (`CpuWindow`), so a neighbour's load shows in the table.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from ai.classify.v1 import classify_service_pb2 as pb  # noqa: E402
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc  # noqa: E402
from bench.load_clients import CALLERS_PER_CONNECTION, OWN_CONNECTION, percentile  # noqa: E402
from capability.model import TextClassifier  # noqa: E402
from capability.workers.threads import CpuLanes  # noqa: E402
from classify_common.metrics import RPC_DURATION_SECONDS  # noqa: E402

RESULTS_DIR = REPO_ROOT / "build" / "bench"
MODEL_ROOT = REPO_ROOT / "build" / "models"
BATCH_SIZES = (1, 4, 8, 16, 32, 64)
# Seconds a server gets to start and load its models before the bench gives up.
START_TIMEOUT_SECONDS = 120.0
# Seconds a server gets to drain and exit after SIGTERM before it is killed.
STOP_TIMEOUT_SECONDS = 30.0
# Fewest connections drive() opens (as many as clients, below it).
DRIVE_CONNECTIONS = 8
# Seconds one benchmark call may take before it counts as an error.
CALL_TIMEOUT_SECONDS = 30.0
# A level is marked noisy when other processes used more than this many cores during
# it, or its two ceiling probes differ by more than this share of their mean. NOTE:
# on 2 cores, a forward on both cores slows down several times over while anything
# else runs (each parallel op waits for the thread the neighbour displaced), so the
# all-cores ceiling is the first figure a neighbour spoils.
NOISY_OTHER_CORES = 0.25
NOISY_CEILING_SPREAD = 0.25
# Upper edges of the latency buckets each level counts its calls into (milliseconds;
# the last bucket takes everything beyond): the reports' latency heatmaps.
LATENCY_BUCKETS_MS = (
    0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 2000,
)  # fmt: skip
SHORT_TEXTS = [
    "The striker scored twice in the final minutes of the cup match",
    "Shares fell sharply after the bank cut its profit forecast",
    "The new chip doubles battery life in laptops",
    "Rebels and the army agreed to a ceasefire in the capital",
    "The goalkeeper saved a penalty in extra time",
    "Central bank raises interest rates by half a point",
    "Astronomers detect water vapour on a distant exoplanet",
    "Parliament votes on the new election law today",
]


def short_texts(count: int, offset: int = 0) -> list[str]:
    """`count` of the short headlines, starting at `offset`, repeating in order."""
    return [SHORT_TEXTS[(offset + i) % len(SHORT_TEXTS)] for i in range(count)]


# ---------------------------------------------------------------------------------------
# In-process ceiling: the model alone, no server in the way.


def forward_rate(classifier: TextClassifier, size: int, seconds: float) -> float:
    """Texts/s of back-to-back forward passes of `size` short texts, no server in the way.

    On a CPU with several torch threads, the better of two ways to use them, half the
    time each: every op on all of them, and one part of the batch per thread side by
    side (capability.workers.threads.CpuLanes), as the capability runs batches.
    """
    threads = torch.get_num_threads()
    if classifier.device.type != "cpu" or threads < 2 or size < 2:
        return _forward_rate(classifier, size, seconds)
    lanes = CpuLanes("ceiling", threads)
    try:
        return max(
            _forward_rate(classifier, size, seconds / 2),
            _forward_rate(classifier, size, seconds / 2, lanes),
        )
    finally:
        lanes.close()


def _forward_rate(
    classifier: TextClassifier, size: int, seconds: float, lanes: CpuLanes | None = None
) -> float:
    encoded = classifier.tokenize(short_texts(size))
    classifier.run(encoded, lanes=lanes)  # warm this shape
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        classifier.run(encoded, lanes=lanes)
        done += size
    return done / (time.perf_counter() - started)


def forward_latency(classifier: TextClassifier, seconds: float) -> float:
    """Median seconds of one forward pass of one short text (batch size 1)."""
    encoded = classifier.tokenize(short_texts(1))
    classifier.run(encoded)  # warm this shape
    timings: list[float] = []
    stop_at = time.perf_counter() + seconds
    while time.perf_counter() < stop_at or len(timings) < 3:
        started = time.perf_counter()
        classifier.run(encoded)
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def measure_ceiling(
    classifier: TextClassifier,
    seconds_per_size: float,
    passes: int = 4,
    batch_sizes: Sequence[int] = BATCH_SIZES,
) -> dict[str, Any]:
    """Texts/s of back-to-back forward passes, per batch size, no server in the way.

    The sizes are swept `passes` times, interleaved. The best size is the one with
    the highest rate relative to the best of its own pass, averaged over passes: the
    host's speed drifts between passes, so comparing sizes within a pass is fairer,
    and a dip during one size's turn in one pass cannot make a worse size look best.
    Each size's ceiling is its best pass.
    """
    sweeps = [
        {size: forward_rate(classifier, size, seconds_per_size / passes) for size in batch_sizes}
        for _ in range(passes)
    ]
    relative = {
        size: statistics.mean(sweep[size] / max(sweep.values()) for sweep in sweeps)
        for size in batch_sizes
    }
    per_size = {size: max(sweep[size] for sweep in sweeps) for size in batch_sizes}
    best = max(relative, key=lambda size: relative[size])
    return {
        "texts_per_second_by_batch_size": per_size,
        "relative_rate_by_batch_size": relative,
        "best_batch_size": best,
        "ceiling_texts_per_second": per_size[best],
    }


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` torch intra-op threads (None: as they are)."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class AdjacentCeiling:
    """The ceiling probed right before and right after each load level.

    With `reuse_between_levels`, the probe after one level also serves as the probe
    before the next, when nothing else ran in between; `forget()` drops it (a
    server was started or stopped, say). `threads`: torch threads of the probe
    (None: this process's setting).
    """

    def __init__(
        self,
        classifier: TextClassifier,
        batch_size: int,
        seconds: float,
        *,
        reuse_between_levels: bool,
        threads: int | None = None,
    ) -> None:
        self.classifier = classifier
        self.batch_size = batch_size
        self.seconds = seconds
        self.threads = threads
        self._reuse = reuse_between_levels
        self._last: float | None = None

    def before(self) -> float:
        if self._reuse and self._last is not None:
            return self._last
        return self._probe()

    def after(self) -> float:
        self._last = self._probe()
        return self._last

    def forget(self) -> None:
        self._last = None

    def _probe(self) -> float:
        with torch_threads(self.threads):
            return forward_rate(self.classifier, self.batch_size, self.seconds)


# ---------------------------------------------------------------------------------------
# Progress: one status line on stderr, rewritten in place.


class Progress:
    """One status line on stderr, rewritten with a carriage return: the step, its name,
    the time since the start and, on a terminal, a running detail (seconds, calls).

    Call `clear()` before printing anything else, so the line does not mix with it.
    """

    def __init__(self, total_steps: int, stream: TextIO = sys.stderr) -> None:
        self.total_steps = total_steps
        self.stream = stream
        # Off a terminal (make's output in a log) the line changes once per step only.
        self.live = stream.isatty()
        self._step = 0
        self._label = ""
        self._width = 0
        self._started = time.perf_counter()

    def step(self, label: str) -> None:
        self._step += 1
        self._label = label
        self.show()

    def show(self, detail: str = "") -> None:
        elapsed = time.perf_counter() - self._started
        line = f"[{self._step}/{self.total_steps} {elapsed:4.0f} s] {self._label}"
        if detail:
            line += f" ({detail})"
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def skip(self, steps: int) -> None:
        """Count `steps` as done without running them (a sweep that cannot go on)."""
        self._step += steps

    def clear(self) -> None:
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


# ---------------------------------------------------------------------------------------
# The closed-loop client.

# Sends a client's n-th call on the stub and returns how many of its texts failed and
# the first failure's "CODE: message" ("" when none did); a call that fails as a
# whole raises grpc.aio.AioRpcError.
# NOTE: the async stub class exists in the generated .pyi only (ClassifyServiceStub
# on an aio channel is one at run time), hence the quotes.
SendCall = Callable[["pb_grpc.ClassifyServiceAsyncStub", int], Awaitable[tuple[int, str]]]


def status_name(code: int) -> str:
    """The name of a numeric gRPC status code (a google.rpc.Status's `code`)."""
    return next((status.name for status in grpc.StatusCode if status.value[0] == code), str(code))


def unary_call(model: str = "", metadata: Sequence[tuple[str, str]] = ()) -> SendCall:
    """Classify one short headline per call, the n-th call the n-th headline.

    The requests are built once: the client's own CPU per call is part of what
    the benchmarks report, and should be the gRPC call's, not protobuf building.
    """
    requests = [pb.ClassifyRequest(text=text, model=model) for text in SHORT_TEXTS]
    call_metadata = tuple(metadata) or None

    async def send(stub: pb_grpc.ClassifyServiceAsyncStub, n: int) -> tuple[int, str]:
        reply = await stub.Classify(
            requests[n % len(requests)], metadata=call_metadata, timeout=CALL_TIMEOUT_SECONDS
        )
        not_asked = answered_otherwise(reply)
        return (1, not_asked) if not_asked else (0, "")

    return send


def answered_otherwise(reply: pb.ClassifyResponse) -> str:
    """Why `reply` is not the answer the benchmark asks for (its route's own model,
    computed: DONE), or "". An answer of the route's fallback model, or a PROCESSING
    one, counted as served by the model measured, and flattered its figures: counted
    as failed instead, it fails the level's zero-errors target and the gate."""
    if reply.fallback:
        return f"answered by the fallback model {reply.model.name}"
    if reply.status != pb.RESULT_STATUS_DONE:
        return f"answered {pb.ResultStatus.Name(reply.status)}"
    return ""


def batch_call(items: int, model: str = "", metadata: Sequence[tuple[str, str]] = ()) -> SendCall:
    """ClassifyBatch of `items` short headlines per call; items answered with an error,
    or missing from the answer, are counted as failed."""
    requests = [
        pb.ClassifyBatchRequest(
            items=[pb.ClassifyRequest(text=text, model=model) for text in short_texts(items, n)]
        )
        for n in range(len(SHORT_TEXTS))
    ]
    call_metadata = tuple(metadata) or None

    async def send(stub: pb_grpc.ClassifyServiceAsyncStub, n: int) -> tuple[int, str]:
        reply = await stub.ClassifyBatch(
            requests[n % len(requests)], metadata=call_metadata, timeout=CALL_TIMEOUT_SECONDS
        )
        failed = [
            f"{status_name(result.error.code)}: {result.error.message}"
            if result.HasField("error")
            else answered_otherwise(result.response)
            for result in reply.results
        ]
        failed = [failure for failure in failed if failure]
        answered = len(reply.results) - len(failed)
        return items - answered, failed[0] if failed else ""

    return send


async def drive(
    target: str,
    concurrency: int,
    seconds: float,
    send: SendCall,
    *,
    items_per_call: int = 1,
    observation: contextlib.AbstractContextManager[Any] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """`concurrency` clients in closed loop for `seconds`: each sends its next call as
    soon as the last one is answered. Throughput (calls, and texts answered without
    an error), call latency (of every call, failed ones included), and errors
    (texts that failed, a failed call counting all its texts, warm-up calls
    included), with the first failure's code and message.

    One warm-up call per client comes first, so connection set-up is not measured.
    A warm-up call answered UNIMPLEMENTED is raised: the server does not offer the
    call. `observation` is entered right before the clients start and left right
    after they stop, so it covers the measured window only.
    """
    latencies: list[float] = []  # of every call, failed ones included
    errors = 0
    answered = 0
    # Calls ended by the window's end: the rates' numerators. (Divided by the time to
    # the last call's end, the rates counted the drain, when fewer clients were still
    # calling: one slow last call took a level from 330 to 138 req/s.)
    ended_in_window = 0
    ok_in_window = 0
    answered_in_window = 0
    first_error = ""

    async def client(stub: pb_grpc.ClassifyServiceAsyncStub, offset: int, stop_at: float) -> None:
        nonlocal errors, answered, first_error
        nonlocal ended_in_window, ok_in_window, answered_in_window
        n = offset
        while time.perf_counter() < stop_at:
            call_started = time.perf_counter()
            try:
                failed, failure = await send(stub, n)
                ended = time.perf_counter()
                latencies.append(ended - call_started)
                errors += failed
                answered += items_per_call - failed
                if ended <= stop_at:
                    ended_in_window += 1
                    ok_in_window += failed < items_per_call  # not a batch whose every item failed
                    answered_in_window += items_per_call - failed
                first_error = first_error or failure
            except grpc.aio.AioRpcError as refused:
                # A failed call counts in the latencies too: left out, a call that ran
                # into its timeout flattered the p99. Not in the request rate, which is
                # of answered calls (a server failing fast would look fast).
                ended = time.perf_counter()
                latencies.append(ended - call_started)
                ended_in_window += ended <= stop_at
                errors += items_per_call
                first_error = first_error or f"{refused.code().name}: {refused.details()}"
            n += concurrency

    async def tick(started: float) -> None:
        assert progress is not None
        while True:
            elapsed = min(time.perf_counter() - started, seconds)
            progress.show(f"{elapsed:.0f}/{seconds:.0f} s, {len(latencies)} calls")
            await asyncio.sleep(0.5)

    # A connection per CALLERS_PER_CONNECTION clients, and at least DRIVE_CONNECTIONS
    # (as many clients have): one for all reached one worker of an orchestrator with
    # --processes, and two still landed on one worker about half the time.
    connections = min(
        concurrency, max(DRIVE_CONNECTIONS, math.ceil(concurrency / CALLERS_PER_CONNECTION))
    )
    async with contextlib.AsyncExitStack() as channels:
        stubs = [
            pb_grpc.ClassifyServiceStub(
                await channels.enter_async_context(
                    grpc.aio.insecure_channel(target, options=OWN_CONNECTION)
                )
            )
            for _ in range(connections)
        ]

        def stub_of(client_index: int) -> pb_grpc.ClassifyServiceAsyncStub:
            return stubs[client_index % connections]

        warm_up = await asyncio.gather(
            *(send(stub_of(i), i) for i in range(concurrency)), return_exceptions=True
        )
        for outcome in warm_up:
            # Outside the measured window, but an error all the same: it counts, a whole
            # call's or its failed items.
            if isinstance(outcome, grpc.aio.AioRpcError):
                if outcome.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise outcome
                errors += items_per_call
                first_error = first_error or f"{outcome.code().name}: {outcome.details()}"
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                failed, failure = outcome
                errors += failed
                first_error = first_error or failure
        with observation or contextlib.nullcontext():
            started = time.perf_counter()
            ticker = asyncio.create_task(tick(started)) if progress and progress.live else None
            try:
                stop_at = started + seconds
                await asyncio.gather(*(client(stub_of(i), i, stop_at) for i in range(concurrency)))
            finally:
                if ticker:
                    ticker.cancel()
            elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "latency_counts": latency_counts(latencies),
        # Calls answered, a batch call's with at least one item (the rest in `errors`),
        # by the window's end, over the window.
        "requests_per_second": ok_in_window / seconds,
        "calls_per_second": ended_in_window / seconds,
        "texts_per_second": answered_in_window / seconds,
        "p50_ms": percentile(latencies, 0.5) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "errors": errors,
        "first_error": first_error,
        "calls": len(latencies),
        "texts": answered,
        "seconds": elapsed,
    }


def latency_counts(latencies: Sequence[float]) -> list[int]:
    """Calls per LATENCY_BUCKETS_MS bucket (each up to its edge), plus one past the last."""
    counts = [0] * (len(LATENCY_BUCKETS_MS) + 1)
    for seconds in latencies:
        counts[bisect.bisect_left(LATENCY_BUCKETS_MS, seconds * 1000)] += 1
    return counts


# ---------------------------------------------------------------------------------------
# Server processes.


@dataclass
class ServerProcess:
    """A server started by a benchmark, with its output in RESULTS_DIR/<name>.log.

    A context manager: leaving it stops the server (SIGTERM, then SIGKILL after
    STOP_TIMEOUT_SECONDS).
    """

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    # The "serving" log line, parsed: the ports the server really bound, and more.
    serving: Mapping[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.serving['port']}"

    @property
    def metrics_url(self) -> str | None:
        port = self.serving.get("metrics_port")
        return f"http://127.0.0.1:{port}/metrics" if port else None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def capability_command(*args: str) -> list[str]:
    """`python -m capability` on free ports (its serving line says which), defaults
    otherwise, then `args`."""
    # No result cache: the benchmarks repeat their texts, and measure the model path.
    return [
        *(sys.executable, "-m", "capability", "--port", "0", "--metrics-port", "0"),
        *("--result-cache-entries", "0"),
        *args,
    ]


def orchestrator_command(*args: str) -> list[str]:
    """`python -m orchestrator` on free ports, defaults otherwise, then `args`."""
    return [sys.executable, "-m", "orchestrator", "--port", "0", "--metrics-port", "0", *args]


@contextlib.contextmanager
def orchestrator_processes(processes: int) -> Iterator[list[str]]:
    """The orchestrator flags for `processes` worker processes on one port: none for 1;
    otherwise a Redis (Debian's, unpacked by tools/redis_server.py) on a free loopback
    port for their shared state, stopped on exit. Its CPU lands in "others"."""
    if processes == 1:
        yield []
        return
    from tools import redis_server

    launcher = redis_server.server_path()
    if not launcher.is_file() and redis_server.install(redis_server.DEFAULT_TARGET) != 0:
        raise SystemExit("no redis-server for --orchestrator-processes")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    redis = subprocess.Popen(
        [launcher, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            if time.monotonic() > deadline or redis.poll() is not None:
                raise SystemExit("redis-server did not start")
            time.sleep(0.05)
        yield ["--processes", str(processes), "--state-url", f"redis://127.0.0.1:{port}/0"]
    finally:
        redis.terminate()
        redis.wait(timeout=30)


def naive_command(device: str) -> list[str]:
    """The naive one-request-one-forward server (bench/naive_server.py) on a free port."""
    script = Path(__file__).resolve().parent / "naive_server.py"
    return [sys.executable, str(script), "--port", "0", "--device", device]


def echo_command(upstream: str | None = None) -> list[str]:
    """An echo hop (bench/echo_server.py) on a free port, passing calls on to `upstream`
    when given."""
    script = Path(__file__).resolve().parent / "echo_server.py"
    return [
        *(sys.executable, str(script), "--port", "0"),
        *(("--upstream", upstream) if upstream else ()),
    ]


def start_server(
    name: str, command: Sequence[str], env: Mapping[str, str] | None = None
) -> ServerProcess:
    """Start a server and return once it has logged its JSON `"event": "serving"` line.

    NOTE: output goes to a file, not a pipe: a pipe nobody reads fills up and
    stalls the writer.
    """
    log_path = RESULTS_DIR / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # A new file, not the old one truncated: a server left running by an interrupted
    # run keeps writing into the file it opened, and in a truncated one its lines
    # would land among this server's (the overload bench reads them).
    log_path.unlink(missing_ok=True)
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            list(command),
            cwd=REPO_ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
    server = ServerProcess(name, process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if '"event": "serving"' in line:
                server.serving = json.loads(line)
                return server
        if process.poll() is not None:
            raise SystemExit(f"{name} exited ({process.returncode}); see {log_path}")
        time.sleep(0.2)
    server.stop()
    raise SystemExit(f"{name} was not serving in {START_TIMEOUT_SECONDS:.0f} s; see {log_path}")


# ---------------------------------------------------------------------------------------
# CPU time from /proc.


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` and its children,
    all threads included, from /proc/<pid>/stat."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue  # it exited
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        # NOTE: each thread's children read on its own, after the process's own time: a
        # thread that ended during the walk (gRPC's pools start and end threads) failed
        # the read, and the whole process, its own time included, counted 0 (2 reads in
        # 400 of a process that starts threads).
        try:
            tasks = list(Path(f"/proc/{current}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                pending += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return total


class CpuWindow:
    """CPU seconds spent over a window by each named server process, by this process
    (the client), and by everything else on the machine ("others")."""

    def __init__(self, servers: Mapping[str, int]) -> None:
        self._servers = dict(servers)
        self._start = self._read()

    def _read(self) -> dict[str, float]:
        reading = {name: process_cpu_seconds(pid) for name, pid in self._servers.items()}
        reading["client"] = time.process_time()
        reading["machine"] = machine_busy_seconds()
        reading["wall"] = time.perf_counter()
        return reading

    def spent(self) -> dict[str, float]:
        """CPU seconds per process since the window opened, and its wall seconds."""
        now = self._read()
        spent = {name: now[name] - self._start[name] for name in now}
        ours = sum(spent[name] for name in (*self._servers, "client"))
        spent["others"] = max(spent.pop("machine") - ours, 0.0)
        return spent


# ---------------------------------------------------------------------------------------
# /metrics.

Sample = tuple[str, Mapping[str, str], float]


def scrape(metrics_url: str) -> list[Sample]:
    """Every sample a server's Prometheus endpoint shows: (name, labels, value)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as page:
        text = page.read().decode()
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def metric_total(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(
        value
        for sample_name, sample_labels, value in samples
        if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
    )


def answered_ok(metrics_url: str) -> float:
    """Calls a server has answered OK so far, all methods, from its /metrics."""
    return metric_total(scrape(metrics_url), f"{RPC_DURATION_SECONDS}_count", code="OK")


# ---------------------------------------------------------------------------------------
# One load level: what the client saw, what each process spent, what the servers counted.


class Observation:
    """What the servers did over a measured window: CPU seconds per process (`cpu`,
    from CpuWindow) and the change of any /metrics sample (`delta`)."""

    def __init__(self, servers: Mapping[str, ServerProcess]) -> None:
        self._servers = dict(servers)
        self._before: dict[str, list[Sample]] = {}
        self._after: dict[str, list[Sample]] = {}
        self._window: CpuWindow | None = None
        self.cpu: dict[str, float] = {}

    def __enter__(self) -> Observation:
        # Scrapes first, CPU last: a scrape's own cost stays outside the window.
        self._before = self._scrape_all()
        self._window = CpuWindow({name: server.pid for name, server in self._servers.items()})
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._window is not None
        self.cpu = self._window.spent()
        self._after = self._scrape_all()

    def _scrape_all(self) -> dict[str, list[Sample]]:
        return {
            name: scrape(server.metrics_url)
            for name, server in self._servers.items()
            if server.metrics_url
        }

    def delta(self, server: str, metric: str, **labels: str) -> float:
        """How much `metric` (summed over the samples matching `labels`) grew on `server`."""
        if server not in self._after:
            return float("nan")
        return metric_total(self._after[server], metric, **labels) - metric_total(
            self._before[server], metric, **labels
        )


def measure_level(
    target: str,
    concurrency: int,
    seconds: float,
    send: SendCall,
    *,
    runner: asyncio.Runner,
    ceiling: AdjacentCeiling,
    servers: Mapping[str, ServerProcess],
    served_ceiling: AdjacentCeiling | None = None,
    items_per_call: int = 1,
    progress: Progress | None = None,
) -> tuple[dict[str, Any], Observation]:
    """One load level between two ceiling probes.

    Adds to `drive`'s figures: the adjacent ceiling and the ratio to it; each server's,
    the client's and the other processes' CPU seconds over the level; CPU microseconds
    per text in each process (per request, for single calls); and the cores that other
    processes used meanwhile. The Observation gives the servers' metric deltas.
    `served_ceiling`, when given, is probed beside `ceiling` (the ceiling with the
    server's own thread count, say) and compared with the same way.

    `runner` runs the client: one event loop for all levels, because grpc.aio's
    completion queue outlives a loop that asyncio.run would close under it.
    """
    before = ceiling.before()
    served_before = served_ceiling.before() if served_ceiling else math.nan
    observation = Observation(servers)
    result: dict[str, Any] = runner.run(
        drive(
            target,
            concurrency,
            seconds,
            send,
            items_per_call=items_per_call,
            observation=observation,
            progress=progress,
        )
    )
    after = ceiling.after()
    served_after = served_ceiling.after() if served_ceiling else math.nan
    texts = result["texts"] or math.nan  # no text answered: no cost per text
    cpu = observation.cpu
    result["concurrency"] = concurrency
    result["items_per_call"] = items_per_call
    result["ceiling_before"] = before
    result["ceiling_after"] = after
    result["adjacent_ceiling"] = (before + after) / 2
    result["ratio_to_ceiling"] = result["texts_per_second"] / result["adjacent_ceiling"]
    result["served_threads_ceiling"] = (served_before + served_after) / 2
    result["ratio_to_served_threads_ceiling"] = (
        result["texts_per_second"] / result["served_threads_ceiling"]
    )
    result["cpu_seconds"] = cpu
    result["cpu_us_per_text"] = {
        name: cpu[name] / texts * 1e6 for name in (*servers, "client", "others")
    }
    result["other_processes_cores"] = cpu["others"] / cpu["wall"]
    result["ceiling_spread"] = abs(before - after) / result["adjacent_ceiling"]
    result["noisy"] = (
        result["other_processes_cores"] > NOISY_OTHER_CORES
        or result["ceiling_spread"] > NOISY_CEILING_SPREAD
    )
    return result, observation

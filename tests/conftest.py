"""Real servers on loopback ports for the tests.

In-process fixtures (one event loop for the session) start a CapabilityServer
and an OrchestratorServer on port 0 with fresh Prometheus registries, so tests
can read exact metric deltas and spans. `start_process` runs the real
`python -m ...` entry points as separate processes, and `start_stack` (or `stack`)
the two of them wired together, for the system tests in tests/system/.
`redis_server` starts a real Redis (Debian's, unpacked by tools/redis_server.py)
on a free loopback port. `wait_until` is the one way a test waits for something
to happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from capability.bundle import build_bundle
from capability.config import DEFAULT_MODEL, CapabilitySettings
from capability.server import CapabilityServer
from classify_common import interceptor
from classify_common.event_loop import UVLOOP, loop_factory
from classify_common.logs import JsonFormatter
from classify_common.tracing import configure_tracing
from orchestrator.config import OrchestratorSettings
from orchestrator.security import hash_key, new_key
from orchestrator.server import OrchestratorServer

# A hook, found here by its name: a test hung past pytest-timeout's alarm ends the run.
from tests.hang_watchdog import pytest_runtest_protocol  # noqa: F401
from tools import redis_server as redis_tool

REPO_ROOT = Path(__file__).resolve().parent.parent
PROCESS_READY_TIMEOUT_SECONDS = 120.0
# The acceptance sentence: every sports-aware model must put `sports` first.
STRIKER = "The striker scored twice in the final minutes of the cup match"
# How long `wait_until` waits by default, and how often it looks.
WAIT_LIMIT_SECONDS = 20.0
WAIT_POLL_SECONDS = 0.01
# The key the `stack` fixture's orchestrator accepts (role user, no rate limit).
STACK_API_KEY = new_key()
# The tenant of `start_stack(rate_limited_key=...)`, and its rate: one call, then
# one more every half second (a second call at once is refused with a RetryInfo).
LIMITED_TENANT = "limited"
LIMITED_RATE = "{rate_per_second: 2, burst: 1}"


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Tests run on the loop the servers run on by default (uvloop), so that the
    in-process servers they start are the servers users run."""
    return {UVLOOP: loop_factory(UVLOOP)}


async def wait_until(
    condition: Callable[[], object],
    what: str = "the condition",
    limit_seconds: float = WAIT_LIMIT_SECONDS,
) -> None:
    """Return as soon as `condition()` is true; fail naming `what` after `limit_seconds`.

    `condition` may be a coroutine function (one that asks a server, say): what it
    returns is awaited."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_seconds
    while not await holds(condition):
        assert loop.time() < deadline, f"not reached in {limit_seconds}s: {what}"
        await asyncio.sleep(WAIT_POLL_SECONDS)


async def holds(condition: Callable[[], object]) -> bool:
    outcome = condition()
    if inspect.isawaitable(outcome):
        outcome = await outcome
    return bool(outcome)


def closed_port() -> int:
    """A loopback port that nothing listens on (bound, read, released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def metric_sum(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
    return sum(
        sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def run_make(*args: str) -> subprocess.CompletedProcess[str]:
    """`make ARGS...` in the repository, its output captured."""
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model root with version 1 of both real models, built from the gt package."""
    root = tmp_path_factory.mktemp("models")
    build_bundle("topic-minilm", root / "topic-minilm" / "1", progress=False)
    build_bundle("topic-static", root / "topic-static" / "1", progress=False)
    return root


# In-process servers do not freeze the heap unless a test asks (tests/unit/test_heap.py):
# a freeze's full collection walks the whole suite process's heap at every server's
# start, and the suite starts hundreds (the orchestrator tests took a third longer).
# The suite freezes it as each test file starts instead (start_up_heap_frozen).
# Servers started as processes (tests/system) freeze as deployed.
IN_PROCESS_GC_FREEZE = "off"


def orchestrator_settings(**overrides: Any) -> OrchestratorSettings:
    """In-process test settings: any free port, no /metrics port, auth off unless given,
    the heap left unfrozen (IN_PROCESS_GC_FREEZE)."""
    values: dict[str, Any] = {
        "port": 0,
        "metrics_port": -1,
        "auth": "disabled",
        "gc_freeze": IN_PROCESS_GC_FREEZE,
        **overrides,
    }
    return OrchestratorSettings(**values)


def capability_settings(model_root: Path, **overrides: Any) -> CapabilitySettings:
    """In-process test settings: any free port, no /metrics port, CPU, no watcher, the
    memory ledger measuring a small warm-up (the largest batch at the longest bucket
    costs the minilm ~2 s a start here; the ledger's tests ask for it), and no result
    cache (tests count forwards of repeated texts; the cache's tests turn it on), and
    the heap left unfrozen (IN_PROCESS_GC_FREEZE)."""
    values: dict[str, Any] = {
        "port": 0,
        "metrics_port": -1,
        "device": "cpu",
        "model_root": model_root,
        "watch_seconds": 0,
        "memory_warm_up": "small",
        "result_cache_entries": 0,
        "gc_freeze": IN_PROCESS_GC_FREEZE,
        **overrides,
    }
    if "default_model" not in overrides:  # a server refuses one it does not serve
        served = overrides.get("models") or sorted(
            path.name for path in Path(values["model_root"]).iterdir() if path.is_dir()
        )
        if served and DEFAULT_MODEL not in served:
            values["default_model"] = served[0]
    return CapabilitySettings(**values)


@pytest.fixture(scope="session", autouse=True)
def span_exporter() -> InMemorySpanExporter:
    """Every span of the in-process servers, in memory.

    Autouse: the servers' `main` configures tracing, so every in-process test
    must too, or trace IDs would be empty."""
    exporter = InMemorySpanExporter()
    configure_tracing("tests", processor=SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module", autouse=True)
def start_up_heap_frozen() -> None:
    """What the suite's process holds as a test file starts (modules, torch, the session
    fixtures) is frozen out of the collector's sight, as a served process's start-up
    heap is: the in-process servers do not freeze it themselves (IN_PROCESS_GC_FREEZE).
    Unfrozen, a full collection under a test's load walked all of it, long enough to
    make calls due in a few hundred ms miss their deadlines; frozen once for the
    session, what later files left alive piled up unfrozen, and a test whose evictions
    each collect (test_residency's twenty models) took 22 s against 9.

    Once a file: set up before the file's own module fixtures, so that none of theirs
    is frozen (a frozen object is never collected, and a loaded bundle is 90 MB), and
    after the previous file's are gone, which the collection here frees."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def spans_of_this_test_only(span_exporter: InMemorySpanExporter) -> None:
    """Each test starts with no span kept: the exporter held every span of the session
    (10,000 in 88 orchestrator tests), and every full garbage collection of the
    suite's process walked them all, later tests' the most."""
    span_exporter.clear()


def write_routes(path: Path, targets: list[str], timeout: str = "5s") -> Path:
    path.write_text(routes_text(targets, timeout))
    return path


def static_routes(target: str) -> str:
    """A routes.yaml with one route, `default`, to topic-static at `target`."""
    return (
        "version: 1\nbackends:\n"
        f"  static: {{model: topic-static, targets: ['{target}']}}\n"
        "routes:\n  - {name: default, backend: static}\n"
    )


# The model hint that `processing_routes` sends to a route no call can finish in time.
BUDGETED_MODEL = "budgeted"


def processing_routes(target: str) -> str:
    """Routes to topic-static at `target`: `default`, and `budgeted` (model hint
    BUDGETED_MODEL) with a 1 ms budget, so its answers are PROCESSING and the work
    goes on for GetResult."""
    return (
        "version: 1\nbackends:\n"
        f"  static: {{model: topic-static, targets: ['{target}']}}\n"
        "routes:\n"
        f"  - {{name: budgeted, match: {{model: {BUDGETED_MODEL}}}, backend: static,"
        " budget: 1ms}\n"
        "  - {name: default, backend: static}\n"
    )


# Flags that make a capability server load topic-static alone (it starts fastest).
STATIC_ONLY_FLAGS = ("--models", "topic-static", "--default-model", "topic-static")


def routes_text(targets: Sequence[str], timeout: str = "5s") -> str:
    """A routes.yaml with one route, `default`, to topic-minilm at `targets`."""
    target_list = ", ".join(f'"{t}"' for t in targets)
    return (
        "version: 1\n"
        "backends:\n"
        "  topic-minilm:\n"
        "    model: topic-minilm\n"
        f"    targets: [{target_list}]\n"
        f"    timeout: {timeout}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: topic-minilm\n"
    )


class LineCollector(logging.Handler):
    """Formats each record as the servers' JSON log line, on the logging thread, so
    the request and trace IDs bound to the call are read where they are bound."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter("test"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def interceptor_log() -> Iterator[LineCollector]:
    """The lifecycle interceptor's log lines, as the servers write them (its "rpc"
    lines are INFO: a test that reads them enables that level on its logger)."""
    collector = LineCollector()
    logger = logging.getLogger(interceptor.__name__)
    logger.addHandler(collector)
    try:
        yield collector
    finally:
        logger.removeHandler(collector)


@pytest_asyncio.fixture(scope="session")
async def capability(
    span_exporter: InMemorySpanExporter, model_root: Path
) -> AsyncIterator[CapabilityServer]:
    server = CapabilityServer(capability_settings(model_root), registry=CollectorRegistry())
    await server.start()
    await server.warm_up()
    yield server
    await server.stop(grace_seconds=0)


@contextlib.asynccontextmanager
async def orchestrator_for(
    capability: CapabilityServer, directory: Path, backend_timeout: str = "5s", **settings: Any
) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator of its own in front of `capability` (a call to it times out after
    `backend_timeout`), with test settings plus `settings`, and a fresh registry;
    stopped when the block ends."""
    routes = write_routes(
        directory / "routes.yaml", [f"127.0.0.1:{capability.port}"], backend_timeout
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, **settings), registry=CollectorRegistry()
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_seconds=0)


@pytest_asyncio.fixture(scope="session")
async def orchestrator(
    capability: CapabilityServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[OrchestratorServer]:
    routes = write_routes(
        tmp_path_factory.mktemp("routes") / "routes.yaml", [f"127.0.0.1:{capability.port}"]
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes),
        registry=CollectorRegistry(),
    )
    await server.start()
    yield server
    await server.stop(grace_seconds=0)


@pytest.fixture(params=["orchestrator", "capability"])
def either_server(
    request: pytest.FixtureRequest, orchestrator: OrchestratorServer, capability: CapabilityServer
) -> OrchestratorServer | CapabilityServer:
    """The session's orchestrator, then its capability server: a test of what both
    servers do alike (the lifecycle interceptor's) runs once on each."""
    return orchestrator if request.param == "orchestrator" else capability


@pytest_asyncio.fixture(scope="session")
async def orchestrator_stub(
    orchestrator: OrchestratorServer,
) -> AsyncIterator[classify_service_pb2_grpc.ClassifyServiceAsyncStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        yield classify_service_pb2_grpc.ClassifyServiceStub(channel)


@pytest_asyncio.fixture(scope="session")
async def capability_channel(capability: CapabilityServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{capability.port}") as channel:
        yield channel


@pytest.fixture(scope="session")
def capability_stub(
    capability_channel: grpc.aio.Channel,
) -> classify_service_pb2_grpc.ClassifyServiceAsyncStub:
    return classify_service_pb2_grpc.ClassifyServiceStub(capability_channel)


@pytest.fixture(scope="session")
def model_stub(
    capability_channel: grpc.aio.Channel,
) -> model_service_pb2_grpc.ModelServiceAsyncStub:
    return model_service_pb2_grpc.ModelServiceStub(capability_channel)


StartCapability = Callable[..., Awaitable[CapabilityServer]]


@pytest_asyncio.fixture
async def start_capability(model_root: Path) -> AsyncIterator[StartCapability]:
    """Start an extra in-process capability server with settings overrides; warmed up."""
    started: list[CapabilityServer] = []

    async def start(**overrides: Any) -> CapabilityServer:
        server = CapabilityServer(
            capability_settings(overrides.pop("model_root", model_root), **overrides),
            registry=CollectorRegistry(),
        )
        started.append(server)
        await server.start()
        await server.warm_up()
        return server

    yield start
    for server in started:
        await server.stop(grace_seconds=0)


StartOrchestrator = Callable[[str], Awaitable[OrchestratorServer]]


@pytest_asyncio.fixture
async def orchestrator_with(tmp_path: Path) -> AsyncIterator[StartOrchestrator]:
    """Start an orchestrator on a routes.yaml given as text."""
    started: list[OrchestratorServer] = []

    async def start(routes_yaml: str) -> OrchestratorServer:
        path = tmp_path / f"routes-{len(started)}.yaml"
        path.write_text(routes_yaml)
        server = OrchestratorServer(
            orchestrator_settings(port=0, metrics_port=-1, routes_file=path),
            registry=CollectorRegistry(),
        )
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop(grace_seconds=0)


@dataclass
class ServerProcess:
    """A server started as its own OS process, logging JSON lines to a file.

    NOTE: a file, not a pipe: a pipe that nobody drains fills up and stalls the
    server's log writer.
    """

    process: subprocess.Popen[bytes]
    log_path: Path
    ready: dict[str, Any]

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    def log_lines(self) -> list[dict[str, Any]]:
        parsed = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                parsed.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line still being written, or not a log record
        return parsed

    def read_logs(self) -> list[dict[str, Any]]:
        """Stop the process (flushing its logs) and return every JSON line it wrote."""
        self.stop()
        return self.log_lines()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


class ProcessStarter:
    """Starts `python -m MODULE ARGS...` (with `env` added to this process's
    environment), each logging into `work_dir`; a call returns once the server logs
    "serving". `stop_all` stops every one it started."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self._started: list[ServerProcess] = []

    def __call__(
        self, module: str, *args: str, env: Mapping[str, str] | None = None
    ) -> ServerProcess:
        log_path = self.work_dir / f"{module}-{len(self._started)}.log"
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=REPO_ROOT,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            )
        server = ServerProcess(process=process, log_path=log_path, ready={})
        self._started.append(server)
        deadline = time.monotonic() + PROCESS_READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            serving = [line for line in server.log_lines() if line.get("event") == "serving"]
            if serving:
                server.ready = serving[0]
                return server
            if process.poll() is not None:
                raise AssertionError(
                    f"{module} exited ({process.returncode}): {log_path.read_text()}"
                )
            time.sleep(0.1)
        raise AssertionError(f"{module} did not log 'serving' in {PROCESS_READY_TIMEOUT_SECONDS}s")

    def stop_all(self) -> None:
        for server in self._started:
            server.stop()


@pytest.fixture
def start_process(tmp_path: Path) -> Iterator[ProcessStarter]:
    """A ProcessStarter whose servers are stopped after the test."""
    starter = ProcessStarter(tmp_path)
    yield starter
    starter.stop_all()


@dataclass(frozen=True)
class Stack:
    """The two layers as OS processes: the orchestrator in front of the capability server."""

    orchestrator: ServerProcess
    capability: ServerProcess


def stack_starter(
    work_dir: Path, model_root: Path, start_process: ProcessStarter
) -> Callable[..., Stack]:
    """Start a capability server, then an orchestrator routing to it, as processes
    (their files in `work_dir`).

    Both serve /metrics on a free port. With `api_key`, the orchestrator accepts
    that key and the two share an internal token; without, auth is off.
    `rate_limited_key` (with `api_key`) is a second key, of tenant LIMITED_TENANT,
    held to LIMITED_RATE. `routes`
    turns the capability server's address into the routes.yaml text (default: one
    route to topic-minilm); the flag lists go to each server after the shared ones,
    the `_env` mappings into each server's environment.
    """

    def start(
        *,
        api_key: str | None = None,
        rate_limited_key: str | None = None,
        routes: Callable[[str], str] = lambda target: routes_text([target]),
        capability_flags: Sequence[str] = (),
        orchestrator_flags: Sequence[str] = (),
        capability_env: Mapping[str, str] | None = None,
        orchestrator_env: Mapping[str, str] | None = None,
    ) -> Stack:
        secured: list[str] = []
        front_door = ["--auth", "disabled"]
        if api_key is not None:
            token_file = work_dir / "internal-token"
            token_file.write_text(secrets.token_urlsafe(16))
            keys_file = work_dir / "api-keys.yaml"
            keys = f"  - {{id: stack, sha256: {hash_key(api_key)}, tenant: stack, role: user}}\n"
            tenants = ""
            if rate_limited_key is not None:
                keys += (
                    f"  - {{id: limited, sha256: {hash_key(rate_limited_key)},"
                    f" tenant: {LIMITED_TENANT}, role: user}}\n"
                )
                tenants = f"tenants:\n  {LIMITED_TENANT}: {LIMITED_RATE}\n"
            keys_file.write_text(f"keys:\n{keys}{tenants}")
            secured = ["--internal-token-file", str(token_file)]
            front_door = ["--api-keys-file", str(keys_file)]
        capability = start_process(
            "capability",
            *("--port", "0", "--metrics-port", "0", "--device", "cpu"),
            *("--model-root", str(model_root), "--watch-seconds", "0"),
            *("--memory-warm-up", "small", "--result-cache-entries", "0"),
            *secured,
            *capability_flags,
            env=capability_env,
        )
        routes_file = work_dir / "routes.yaml"
        routes_file.write_text(routes(f"127.0.0.1:{capability.port}"))
        orchestrator = start_process(
            "orchestrator",
            *("--port", "0", "--metrics-port", "0", "--routes-file", str(routes_file)),
            *front_door,
            *secured,
            *orchestrator_flags,
            env=orchestrator_env,
        )
        return Stack(orchestrator=orchestrator, capability=capability)

    return start


@pytest.fixture
def start_stack(
    tmp_path: Path, model_root: Path, start_process: ProcessStarter
) -> Callable[..., Stack]:
    """stack_starter's `start`, its servers stopped after the test."""
    return stack_starter(tmp_path, model_root, start_process)


@pytest.fixture
def stack(start_stack: Callable[..., Stack]) -> Stack:
    """The default stack: topic-minilm behind an orchestrator that accepts STACK_API_KEY."""
    return start_stack(api_key=STACK_API_KEY)


class RedisServer:
    """A real redis-server on a loopback port, with nothing saved to disk; it can be
    stopped and started again on the same port (Redis going away and coming back)."""

    def __init__(self, work_dir: Path) -> None:
        self.port = closed_port()
        self._work_dir = work_dir
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        launcher = redis_tool.server_path()
        if not launcher.is_file():
            assert redis_tool.install(redis_tool.DEFAULT_TARGET) == 0, "no redis-server"
        self._process = subprocess.Popen(
            [launcher, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""],
            cwd=self._work_dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + PROCESS_READY_TIMEOUT_SECONDS
        while self.command("PING") != "+PONG":
            assert self._process.poll() is None, "redis-server exited at start"
            assert time.monotonic() < deadline, "redis-server did not answer PING"
            time.sleep(0.02)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)
        self._process = None

    def pause(self) -> None:
        """Stall it (SIGSTOP): connections stay open, commands go unanswered."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def command(self, *words: str) -> str:
        """One command's first reply line (inline protocol), or "" when nothing answers."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as connection:
                connection.sendall((" ".join(words) + "\r\n").encode())
                return connection.makefile("rb").readline().decode().strip()
        except OSError:
            return ""


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty Redis for one test, stopped after it."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()

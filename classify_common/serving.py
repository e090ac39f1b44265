"""What every gRPC server of ours has: the lifecycle interceptor, health, reflection,
a /metrics endpoint, and a graceful stop; and the skeleton of its process (run_server,
serve_until_signal).

Health starts NOT_SERVING for every service and turns SERVING only when the
owner calls `set_serving(True)` (after warm-up); on stop it turns NOT_SERVING
first, so load balancers drain the server before in-flight calls are cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry, ProcessCollector

from ai.classify.v1 import classify_service_pb2, model_service_pb2
from classify_common.admission import Gate, admission_for
from classify_common.event_loop import loop_factory, running_loop_kind
from classify_common.intake_loops import IntakeLoops
from classify_common.interceptor import RequestLifecycleInterceptor
from classify_common.logs import LOG_DROPS, configure_logging
from classify_common.metrics import MetricsEndpoint, RequestOutcomes, RpcMetrics
from classify_common.server_settings import (
    DEFAULT_CORE_WAIT_LIMIT_SECONDS,
    DEFAULT_HEALTH_WATCHES_PER_ADDRESS,
    ServerSettings,
)
from classify_common.settings import SettingsError
from classify_common.span_export import EXPORT_DROPS
from classify_common.tls import ServerTls
from classify_common.tracing import configure_tracing
from classify_common.validation import compile_rules

# The contract's services, as both layers serve them (health and reflection list them).
CONTRACT_SERVICES = (
    classify_service_pb2.DESCRIPTOR.services_by_name["ClassifyService"].full_name,
    model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
)

log = logging.getLogger(__name__)

# Keepalive pings from clients every 10 s are fine (orchestrator channels use
# them); without this, the server's default policy answers GOAWAY.
SERVER_OPTIONS: Sequence[tuple[str, int]] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # Twice the largest valid request (a batch of 1,000,000 characters, 4 MiB of UTF-8
    # at worst): anything between is decoded and refused with IDs and field details;
    # gRPC refuses a larger one itself, with neither (docs/api.md#errors).
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    # Clients re-resolve DNS (a headless Service's pods) only when a connection
    # closes: ending connections after 5 minutes lets new replicas get traffic.
    # The grace lets calls in flight on an old connection finish.
    ("grpc.max_connection_age_ms", 5 * 60 * 1000),
    ("grpc.max_connection_age_grace_ms", 60 * 1000),
    # Calls that arrive faster than the event loop takes them in wait in gRPC core.
    # By default core drops them at random once 1,000 wait (all of them at 3,000),
    # answering a bare CANCELLED: no reason, no retry hint, no request ID, and callers
    # call again at once. Under overload that storm left the front door serving
    # nothing (docs/benchmark.md, 2026-12-01). Past the caps below a waiting call is
    # out of time long before its turn; it expires in core, cheaply, and the calls
    # taken in are answered or refused by the server's own admission, with a hint.
    # The arguments are core's (src/core/server/server.h), not in grpc's public
    # headers; a grpc release without them ignores them.
    ("grpc.server.max_pending_requests", 10_000),
    ("grpc.server.max_pending_requests_hard_limit", 20_000),
    # ...but the queue is taken in arrival order, and core hands the loop a waiting
    # call even when its caller has left. After the front door's loop stalled for 3 s
    # under overload, every call it then took had waited past its caller's deadline,
    # as many new ones arrived as it took, and it served nothing until the crowd left
    # (docs/benchmark.md, 2026-12-02). So core drops a call that has waited longer
    # than ServerSettings.core_wait_limit_seconds (see server_options) when the loop
    # next asks for one.
)
CORE_WAIT_LIMIT_OPTION = "grpc.server_max_unrequested_time_in_server"


def server_options(
    core_wait_limit_seconds: int, shares_port: bool = False
) -> tuple[tuple[str, int], ...]:
    """SERVER_OPTIONS, the longest a call waits in core for the event loop, and whether
    the port may be shared (SO_REUSEPORT, gRPC's default on Linux): only by worker
    processes of one server. Otherwise a second server started on the port (a second
    `make run`, another user's stack) would share it without a word, the kernel
    splitting connections between the two, instead of failing to start."""
    return (
        *SERVER_OPTIONS,
        (CORE_WAIT_LIMIT_OPTION, core_wait_limit_seconds),
        ("grpc.so_reuseport", int(shares_port)),
    )


METRICS_DISABLED = -1
# Health Watch streams open at once on one server. Health needs no credentials, and
# each stream holds about 23 KB for as long as its caller keeps it open (3,000 took
# an orchestrator from 78 to 146 MB); probes use Check, and each orchestrator channel
# to a capability server holds one Watch, so a fleet stays far below this.
MAX_HEALTH_WATCHES = 1000
# Of those, one address holds at most --health-watches-per-address (every connection
# from it counts): without a share, one caller able to reach a capability's port held
# all 1,000, and the orchestrators' own channels, which health-check over a Watch,
# were refused theirs at their next connection and took the replica out of rotation.
# An orchestrator process holds one per capability replica it calls (its channels to
# one target share a subchannel), so an address holds one per orchestrator process
# behind it: a host of over 100 processes, or callers that all come from one address
# (a service mesh's sidecar, NAT), need the share raised or off (0).
# Server reflection's streams (both names, v1 and v1alpha, together) open at once on one
# server, and of those from one address. Reflection needs no credentials either, and a
# stream that has been asked once holds about 25 KB for as long as its caller keeps it
# open: 10,384 took an orchestrator up by 256 MB. The tools it is for (`buf curl`,
# grpcurl) hold one for the length of a command, so these are far above their use; a
# stream left idle goes with its connection, as a Watch does (grpc.max_connection_age).
MAX_REFLECTION_STREAMS = 100
REFLECTION_STREAMS_PER_ADDRESS = 10
# How long before the end of a stop's grace the calls still in their handlers are
# answered SERVER_DRAINING, so that the answer is written before gRPC cancels them.
CUT_OFF_MARGIN_SECONDS = 0.1

# The methods gRPC takes calls in for through a pending request of their own: the
# calls that carry load. grpc.aio's server (grpcio 1.85) takes in each call with an
# `asyncio.wait` over one pending request per registered method plus one for every
# other method, so each method registered costs every call a little, however rarely
# it is called itself: two echo hops with 10 more methods registered each spent about
# 50 µs more CPU a call between them, in 5 of 6 alternated pairs (docs/benchmark.md,
# 2026-12-03). The other methods (GetResult, ModelService, health, reflection) are
# served through their services' generic handlers, as gRPC serves any method it was
# not told of in advance.
HOT_METHODS = frozenset({"Classify", "ClassifyBatch"})


class _HotMethodsRegistered:
    """The server as a generated `add_*_to_server` helper sees it: every method it adds
    is served through its service's generic handler, and only the hot ones are also
    registered (a registered handler takes precedence over a generic one)."""

    def __init__(
        self, server: grpc.aio.Server, hot: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self._server = server
        self._hot = hot  # the hot methods' handlers by full name, for IntakeLoops

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        hot = {name: handler for name, handler in handlers.items() if name in HOT_METHODS}
        if hot:
            self._server.add_registered_method_handlers(service, hot)
            self._hot.update({f"/{service}/{name}": handler for name, handler in hot.items()})


# Server reflection's stable name. grpcio-reflection serves only v1alpha; v1's messages
# are the same on the wire (the service was renamed, not changed), so the same servicer
# answers both, and tools that speak only v1 (grpcurl since 1.9 asks v1 first) work.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def reflection_v1_handler(servicer: Any) -> grpc.GenericRpcHandler:
    """`servicer` (v1alpha's) served under REFLECTION_V1."""
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": info})


class OpenStreams:
    """Long-lived streams of one kind (`what`: "health watches") open at once on a
    server: at most `max_open`, and at most `max_per_host` from one caller's address
    (every connection from it counts; None: no share of its own). A stream past either
    is refused RESOURCE_EXHAUSTED, with `advice` on what to do instead.

    For streams that need no credentials: each holds memory for as long as its caller
    keeps it open, and nothing else bounds how many a caller opens (see
    MAX_HEALTH_WATCHES)."""

    def __init__(
        self, what: str, advice: str, max_open: int, max_per_host: int | None = None
    ) -> None:
        self._what = what
        self._advice = advice
        self._max_open = max_open
        self._max_per_host = max_per_host if max_per_host is not None else max_open
        self._open = 0
        self._by_host: dict[str, int] = {}

    @property
    def open(self) -> int:
        return self._open

    @contextlib.asynccontextmanager
    async def held(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        """A place for the stream `context` is the call of, for as long as the block
        runs; refuses the call if there is none. The block must be the whole of the
        call's handler (a coroutine: a handler that is an async generator may be left
        at a `yield` by a cancelled call, and would keep its place until collected)."""
        host = peer_host(context.peer())
        if self._open >= self._max_open:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_open} {self._what} are open on this server; {self._advice}",
            )
        if self._by_host.get(host, 0) >= self._max_per_host:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_per_host} {self._what} are open from {host}; {self._advice}",
            )
        self._open += 1
        self._by_host[host] = self._by_host.get(host, 0) + 1
        try:
            yield
        finally:
            self._open -= 1
            left = self._by_host[host] - 1
            if left:
                self._by_host[host] = left
            else:
                del self._by_host[host]


class BoundedHealthServicer(health.aio.HealthServicer):
    """gRPC's health service, refusing a Watch beyond `max_watches` open at once, or
    beyond `max_per_host` from one caller's address, with RESOURCE_EXHAUSTED (see
    MAX_HEALTH_WATCHES); Check is as before."""

    def __init__(self, max_watches: int, max_per_host: int | None = None) -> None:
        super().__init__()
        self.watches = OpenStreams("health watches", "use Check", max_watches, max_per_host)

    @property
    def open_watches(self) -> int:
        return self.watches.open

    async def Watch(  # noqa: N802 - the gRPC method's name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        async with self.watches.held(context):
            await super().Watch(request, context)


class BoundedReflectionServicer(reflection.aio.ReflectionServicer):
    """gRPC's server reflection, refusing a ServerReflectionInfo stream beyond
    `max_streams` open at once, or beyond `max_per_host` from one caller's address,
    with RESOURCE_EXHAUSTED (see MAX_REFLECTION_STREAMS); the answers are as before."""

    def __init__(
        self, service_names: Sequence[str], max_streams: int, max_per_host: int | None = None
    ) -> None:
        super().__init__(service_names)
        self.streams = OpenStreams(
            "reflection streams", "try again later", max_streams, max_per_host
        )

    async def ServerReflectionInfo(  # type: ignore[override]  # noqa: N802 - the gRPC method's name
        self,
        request_iterator: AsyncIterator[reflection_pb2.ServerReflectionRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """grpcio-reflection's answers, written here (a coroutine rather than its async
        generator, so that the stream's place is freed whenever the call ends)."""
        async with self.streams.held(context):
            # An async generator, which grpcio-reflection annotates as a coroutine.
            answers: Any = super().ServerReflectionInfo(request_iterator, context)
            async for response in answers:
                await context.write(response)


def listen_address(host: str, port: int) -> str:
    """`host:port` as gRPC binds it, an IPv6 address in brackets (`[::1]:50051`); `host`
    with or without them. gRPC reads `::1:50051` as a name, and refused it."""
    bare = bare_host(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def bare_host(host: str) -> str:
    """`host` without an IPv6 address's brackets, as sockets take it (the /metrics
    endpoint looked `[::1]` up as a name, and failed)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def not_bound(names: str, address: str) -> OSError:
    """The refusal of a port that cannot be bound; `names` says which setting sets it."""
    return OSError(
        f"{names}: cannot listen on {address}: the port is in use, or the host is not an "
        "address of this machine"
    )


def open_metrics_endpoint(
    registry: CollectorRegistry, host: str, port: int, names: str
) -> MetricsEndpoint:
    """The /metrics endpoint on `host` and `port`; a port it cannot bind is an OSError
    naming the setting (`names`), as a gRPC port's is (it said only "[Errno 98] Address
    already in use")."""
    try:
        return MetricsEndpoint(registry, bare_host(host), port)
    except OSError as exc:
        raise not_bound(names, listen_address(host, port)) from exc


def peer_host(peer: str) -> str:
    """gRPC's peer string without its port: "ipv4:10.0.0.7:5123" -> "ipv4:10.0.0.7",
    "ipv6:[::1]:5123" -> "ipv6:[::1]"; any other kind ("unix:...") as it is."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer


class GrpcServing:
    def __init__(
        self,
        *,
        service_names: Sequence[str],
        host: str,
        port: int,
        metrics_port: int,
        registry: CollectorRegistry,
        gate: Gate | None = None,
        edge: bool,
        tls: ServerTls | None = None,
        core_wait_limit_seconds: int = DEFAULT_CORE_WAIT_LIMIT_SECONDS,
        shares_port: bool = False,
        outcomes: RequestOutcomes | None = None,
        health_watches_per_address: int = DEFAULT_HEALTH_WATCHES_PER_ADDRESS,
        intake_loops: int = 0,
        port_names: str = "--port",
        metrics_port_names: str = "--metrics-port",
    ) -> None:
        """`edge`: the public front door (see classify_common.admission); `shares_port`:
        one of several worker processes listening on the same port; `outcomes`: where
        the front door counts each request's outcome; `port_names` and
        `metrics_port_names`: the settings a port that cannot be bound is refused by
        (`--port / CAPABILITY_PORT`)."""
        self.service_names = tuple(service_names)
        self._tls = tls
        self.registry = registry
        registry.register(EXPORT_DROPS)
        registry.register(LOG_DROPS)
        # process_cpu_seconds_total, process_resident_memory_bytes, ...: the CPU a call
        # costs each layer is the figure that carries over to a GPU machine.
        ProcessCollector(registry=registry)
        self._address = listen_address(host, port)
        self._port_names = port_names
        self._metrics_host = host
        self._metrics_port = metrics_port
        self._metrics_port_names = metrics_port_names
        self._metrics_endpoint: MetricsEndpoint | None = None
        self.rpc_metrics = RpcMetrics(registry)
        self._lifecycle = RequestLifecycleInterceptor(
            self.rpc_metrics, functools.partial(admission_for, gate=gate, edge=edge), outcomes
        )
        # One list for grpc's intake and the extra loops': a call is handled alike
        # whichever request took it in.
        interceptors = [self._lifecycle]
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=server_options(core_wait_limit_seconds, shares_port),
        )
        self._hot_handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        self._intake_loops = IntakeLoops(intake_loops, self._hot_handlers, interceptors, registry)
        self.health = BoundedHealthServicer(
            MAX_HEALTH_WATCHES, health_watches_per_address or MAX_HEALTH_WATCHES
        )
        self.add_service(health_pb2_grpc.add_HealthServicer_to_server, self.health)
        # NOTE: v1 is served but not listed: a listed service must have its descriptor
        # to give (`buf curl --list-methods` asks for each one's), and only v1alpha's is
        # in the process.
        reflecting = BoundedReflectionServicer(
            (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME),
            MAX_REFLECTION_STREAMS,
            REFLECTION_STREAMS_PER_ADDRESS,
        )
        self.add_service(reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflecting)
        self.server.add_generic_rpc_handlers((reflection_v1_handler(reflecting),))
        self.reflection = reflecting
        self.port = 0
        self.metrics_port = 0

    @classmethod
    def contract_server(
        cls,
        settings: ServerSettings,
        registry: CollectorRegistry,
        *,
        gate: Gate | None,
        edge: bool,
        shares_port: bool = False,
        outcomes: RequestOutcomes | None = None,
    ) -> GrpcServing:
        """The contract's services as a layer serves them, where its settings say."""
        return cls(
            service_names=CONTRACT_SERVICES,
            host=settings.host,
            port=settings.port,
            metrics_port=settings.metrics_port,
            registry=registry,
            gate=gate,
            edge=edge,
            tls=settings.server_tls(),
            core_wait_limit_seconds=settings.core_wait_limit_seconds,
            shares_port=shares_port,
            outcomes=outcomes,
            health_watches_per_address=settings.health_watches_per_address,
            intake_loops=settings.intake_loops,
            port_names=settings.names("port"),
            metrics_port_names=settings.names("metrics_port"),
        )

    def add_service(self, add_to_server: Callable[[Any, Any], None], servicer: object) -> None:
        """Serve `servicer` through its generated `add_*_to_server` helper, registering
        only its HOT_METHODS."""
        add_to_server(servicer, _HotMethodsRegistered(self.server, self._hot_handlers))

    async def start(self) -> None:
        await self.set_serving(False)
        try:
            if self._tls is not None:
                self.port = self.server.add_secure_port(self._address, self._tls.credentials())
            else:
                self.port = self.server.add_insecure_port(self._address)
        except RuntimeError as exc:  # grpcio's "Failed to bind to address ..."
            raise not_bound(self._port_names, self._address) from exc
        if self.port == 0:
            raise not_bound(self._port_names, self._address)
        compile_rules(self.service_names)
        await self.server.start()
        self._intake_loops.start(self.server)
        if self._metrics_port != METRICS_DISABLED:
            self._metrics_endpoint = open_metrics_endpoint(
                self.registry, self._metrics_host, self._metrics_port, self._metrics_port_names
            )
            self.metrics_port = self._metrics_endpoint.port

    async def set_serving(self, serving: bool, *, freeze: bool = True) -> None:
        """Report SERVING or NOT_SERVING; going SERVING, first `freeze_heap` unless
        `freeze` is False (the owner froze it already, before building what must stay
        collectable, or its settings say `--gc-freeze off`)."""
        if serving and freeze:
            freeze_heap()
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        # "" is the whole server, as the standard health protocol defines it.
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_seconds: float) -> None:
        """NOT_SERVING, refuse new calls, give those in flight `grace_seconds`, and cut off
        the ones still in their handlers just before gRPC would cancel them (see
        RequestLifecycleInterceptor.cut_off_calls)."""
        await self.health.enter_graceful_shutdown()
        stopping = asyncio.ensure_future(self.server.stop(grace_seconds))
        cut_off_at = max(grace_seconds - CUT_OFF_MARGIN_SECONDS, 0.0)
        try:
            await asyncio.wait_for(asyncio.shield(stopping), timeout=cut_off_at)
        except TimeoutError:
            if cut_off := self._lifecycle.cut_off_calls():
                log.warning("calls cut off at the end of the grace", extra={"calls": cut_off})
            await stopping
        await self._intake_loops.close()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
            self._metrics_endpoint = None


def freeze_heap() -> None:
    """Move every object alive now (modules, models, settings: what start-up built and
    what lives as long as the server) out of the garbage collector's sight.

    A full collection walks every tracked object. With a model, torch and grpc
    loaded that is millions of them, and the walk paused the event loop for 30 to
    120 ms at a time under load (measured with gc.callbacks, both servers), far
    longer than anything a request does; refusals that take a millisecond reached
    callers a quarter of a second late. Objects created afterwards (requests) are
    collected as before.

    Nothing that may have to go while the server runs can be in it: frozen objects
    in a reference cycle are never collected. The capability freezes before loading
    its models (a replica and its batcher refer to each other), which leaves about
    6,000 objects of two models in the collector's sight, against 200,000 frozen;
    frozen with them, each model's start version kept its weights allocated after
    its first swap.
    """
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Hand what freeze_heap froze back to the garbage collector: at a server's stop.

    A stopped server's objects sit in reference cycles with objects it built before
    the freeze (the capability's pool and its replicas, say), so while those stay
    frozen none of it is ever collected. A process that starts servers in turn (the
    test suite, an application that embeds one) kept every stopped server's models:
    the suite's process grew by 160 MB a capability server, to 18 GB. A server
    process exits after its stop anyway; the next freeze_heap collects first.

    Process-wide, as the freeze is: in a process that runs more than one server,
    one's stop hands back the others' frozen heap too, and their collections walk it
    again until the next freeze."""
    gc.unfreeze()


class StoppableServer(Protocol):
    async def stop(self, grace_seconds: float | None = None) -> None:
        """Stop gracefully; None: the server's configured grace."""
        ...


def run_server(
    service: str,
    settings: ServerSettings,
    serve: Callable[[], Coroutine[Any, Any, None]],
    *,
    start_errors: tuple[type[Exception], ...],
    log: logging.Logger,
    log_fields: Mapping[str, object] | None = None,
) -> None:
    """A server process's main: JSON logs (each line with `log_fields`) and tracing for
    `service`, then `serve()` on a new event loop of the kind `settings` name (uvloop
    by default, classify_common.event_loop). A start-up failure of one of
    `start_errors` (a bad file, a port in use) is one clear log line and exit status 2,
    not a traceback."""
    configure_logging(service, settings.log_level, log_fields)
    try:
        tracing = configure_tracing(service, settings.otlp_endpoint, settings.trace_sample_ratio)
    except SettingsError as exc:  # an OTEL_* variable it cannot use
        log.error("cannot start", extra={"error": str(exc)})
        sys.exit(2)
    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
            runner.run(serve())
    except start_errors as exc:
        log.error("cannot start", extra={"error": str(exc)})
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        tracing.shutdown()  # sends the spans still queued


async def stop_watcher(watcher: asyncio.Task[None], name: str) -> None:
    """Cancel a server's file watcher (`name`, for the log) and wait for it to end.

    NOTE: a watcher that had already died of an error must not stop the shutdown
    that follows: awaiting it would raise that error again, and the calls in flight
    would be cancelled rather than drained. The error is logged instead."""
    watcher.cancel()
    await asyncio.wait({watcher})
    if not watcher.cancelled() and watcher.exception() is not None:
        log.error(
            f"the {name} had stopped on an error; draining anyway",
            exc_info=watcher.exception(),
        )


async def serve_until_signal(
    server: StoppableServer,
    start: Callable[[], Awaitable[Mapping[str, object]]],
    log: logging.Logger,
    *,
    event: str = "serving",
    wait: Callable[[ShutdownSignal], Awaitable[None]] | None = None,
) -> None:
    """Run `start` (which starts `server` and returns the fields of its `event` log
    line), serve until SIGINT, SIGTERM or SIGHUP (or until `wait(signalled)` returns; it
    is handed the event the signals set), and stop gracefully, even after a failed start.

    The signals are caught from the first moment, so one that comes while `start`
    runs (loading and warming up models can take a minute on a GPU) cancels it and
    stops the server. Uncaught, SIGTERM there was ignored by a server running as a
    container's first process, which the kernel shields from signals it does not
    handle: the pod sat out its whole grace period and was then killed.
    """
    signalled = shutdown_signals()
    try:
        starting = asyncio.ensure_future(start())
        interrupted = asyncio.ensure_future(signalled.wait())
        try:
            await asyncio.wait({starting, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Cancelled itself: the start goes with it, before the server stops.
            starting.cancel()
            await asyncio.wait({starting})
            raise
        finally:
            interrupted.cancel()
        if not starting.done():
            starting.cancel()
            await asyncio.wait({starting})
            log.info("shutdown signal received while starting", extra={"signal": signalled.name})
            return
        fields = starting.result()
        log.info(event, extra={**fields, "event_loop": running_loop_kind()})
        await (wait or wait_for_signal)(signalled)
    finally:
        await server.stop()
        log.info("stopped")


class ShutdownSignal(asyncio.Event):
    """Set by the first shutdown signal; `name` says which ("SIGTERM"), for the log."""

    def __init__(self) -> None:
        super().__init__()
        self.name: str | None = None

    def received(self, sig: signal.Signals) -> None:
        if self.name is None:
            self.name = sig.name
        self.set()


# SIGHUP too: its default action kills the process on the spot. A terminal's hangup (an
# ssh session that drops) then killed a server without a word and cut its calls in
# flight; and it killed a --processes supervisor alone, leaving its workers serving the
# port unsupervised. A hangup drains, as a stop does; nothing here reloads on it.
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def shutdown_signals() -> ShutdownSignal:
    """An event that SIGINT, SIGTERM or SIGHUP (Ctrl-C, `docker stop`, Kubernetes, a
    terminal's hangup) sets, from now on."""
    signalled = ShutdownSignal()
    loop = asyncio.get_running_loop()
    for sig in SHUTDOWN_SIGNALS:
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            # Started under nohup (or by anything else that ignores hangups on purpose):
            # a handler here would undo that, and the hangup nohup is for would stop it.
            continue
        loop.add_signal_handler(sig, signalled.received, sig)
    return signalled


async def wait_for_signal(signalled: ShutdownSignal) -> None:
    """Return once `signalled` (shutdown_signals) is set."""
    await signalled.wait()
    log.info("shutdown signal received", extra={"signal": signalled.name})

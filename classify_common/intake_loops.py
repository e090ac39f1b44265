"""More than one request for the next call of each hot method, kept open in gRPC core.

grpc.aio's server asks core for the next call of a registered method one request
at a time: when a call arrives, core completes the request, gRPC's poller thread
wakes the event loop, a task resolves, `asyncio.wait` returns, and only then is
the next request made. Each call takes that round of thread hand-offs and task
steps before the next one can be taken in, and while it runs, core holds the
calls that arrived. With `--intake-loops` N, N more requests per hot method are
kept open beside grpc's own: core hands each arriving call to one of them at
once, and a wake-up of the loop often finds several taken in.

Measured through the front door (orchestrator + capability, both with the loops
or both without, alternated 5 s windows; docs/benchmark.md, 2026-12-06):
topic-static at 64 clients, in 6 pairs of 6, 642 µs of orchestrator CPU a
request against 704 and 271 µs of capability CPU against 338, and more
requests a second (1,526 against 1,444, median); topic-minilm at 32 clients,
704 µs against 820 in the orchestrator, the same throughput.

NOTE: this drives grpc.aio's own server internals (grpcio 1.85, pinned in
requirements/*.lock): `AioServer._request_registered_call`, and
`cygrpc._handle_rpc` and `_schedule_rpc_coro`, which the server's own loop
calls for each call it takes in. Each call is handled exactly as that loop
handles it, interceptors included. A grpc whose internals differ (checked by
their parameters' names at start, `available`) gets no extra loops and a
warning, and serves as grpc alone does; tests/unit/test_intake_loops.py fails
on such a grpc, so an upgrade that drops them is seen.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

EXTRA_INTAKE_CALLS_TOTAL = "classify_extra_intake_calls_total"
# The parameters of the internals used, in grpcio 1.85, by name and in order: by count
# alone, a grpc that reordered two of them would pass the check and be driven wrongly.
_HANDLE_RPC_PARAMETERS = (
    "method_name",
    "method_resolver",
    "interceptors",
    "rpc_state",
    "loop",
    "concurrency_exceeded",
)
_SCHEDULE_RPC_PARAMETERS = ("rpc_coro", "rpc_state", "loop", "method_name")
_REQUEST_REGISTERED_CALL_PARAMETERS = ("self", "method")


def _parameters(function: Any) -> tuple[str, ...] | None:
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    return tuple(code.co_varnames[: code.co_argcount])


def _internals() -> tuple[Any, Any] | None:
    """cygrpc's `_handle_rpc` and `_schedule_rpc_coro`, when they are what this module
    was written against; else None."""
    try:
        cygrpc = importlib.import_module("grpc._cython.cygrpc")
    except ImportError:  # pragma: no cover - grpcio always has it
        return None
    handle = getattr(cygrpc, "_handle_rpc", None)
    schedule = getattr(cygrpc, "_schedule_rpc_coro", None)
    request = getattr(getattr(cygrpc, "AioServer", None), "_request_registered_call", None)
    found = (_parameters(handle), _parameters(schedule), _parameters(request))
    wanted = (
        _HANDLE_RPC_PARAMETERS,
        _SCHEDULE_RPC_PARAMETERS,
        _REQUEST_REGISTERED_CALL_PARAMETERS,
    )
    if found != wanted:
        return None
    return handle, schedule


def available() -> bool:
    """Whether this grpc has the internals the extra loops drive."""
    return _internals() is not None


class _RegisteredHandlers:
    """The registered handlers by full method name, as grpc's own resolver finds
    them (a registered handler is looked up before any generic one)."""

    def __init__(self, handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]) -> None:
        self._handlers = handlers

    def resolve_handler(self, details: Any) -> grpc.RpcMethodHandler[Any, Any] | None:
        return self._handlers.get(details.method)


class IntakeLoops:
    """`per_method` extra requests for the next call of each of `handlers` (registered
    methods, by full name), open from `start` until the server shuts down."""

    def __init__(
        self,
        per_method: int,
        handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]],
        interceptors: Sequence[grpc.aio.ServerInterceptor],
        registry: CollectorRegistry,
    ) -> None:
        self._per_method = per_method
        self._handlers = handlers
        self._interceptors = tuple(interceptors)
        self._taken = Counter(
            EXTRA_INTAKE_CALLS_TOTAL,
            "Calls taken in through the extra intake loops (--intake-loops), beside grpc's own",
            ["method"],
            registry=registry,
        )
        self._loops: set[asyncio.Task[None]] = set()
        # The calls taken in, kept until done: the loop holds tasks by weak reference.
        self._calls: set[asyncio.Task[Any]] = set()

    def start(self, server: grpc.aio.Server) -> int:
        """Open the requests on a started `server`; how many loops run (0: none asked
        for, or this grpc lacks the internals, which is logged)."""
        if self._per_method <= 0 or not self._handlers:
            return 0
        internals = _internals()
        if internals is None:
            log.warning(
                "this grpc lacks the internals the extra intake loops use: serving with "
                "grpc's own only (--intake-loops has no effect)",
                extra={"grpc": grpc.__version__},
            )
            return 0
        # NOTE: the cygrpc server under grpc.aio's; the extra loops live and end with it.
        aio_server = server._server  # type: ignore[attr-defined]
        resolver = _RegisteredHandlers(self._handlers)
        for method in self._handlers:
            for _ in range(self._per_method):
                loop_task = asyncio.create_task(
                    self._take_in(aio_server, method, resolver, internals),
                    name=f"intake {method}",
                )
                self._loops.add(loop_task)
                loop_task.add_done_callback(self._loops.discard)
        return len(self._loops)

    async def _take_in(
        self, aio_server: Any, method: str, resolver: _RegisteredHandlers, internals: Any
    ) -> None:
        """Forever: wait for a call of `method`, and hand it to grpc's own handling."""
        handle_rpc, schedule_rpc = internals
        loop = asyncio.get_running_loop()
        method_bytes = method.encode()
        taken = self._taken.labels(method)
        while True:
            try:
                rpc_state = await aio_server._request_registered_call(method_bytes)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                # The server shuts down: core fails the open requests (or refuses new
                # ones), as it does grpc's own, whose loop ends there too.
                if aio_server.is_running():
                    log.warning(
                        "an extra intake loop ended: grpc's own goes on",
                        extra={"method": method, "error": repr(error)},
                    )
                return
            # NOTE: never over grpc's concurrency limit: these servers are built without
            # maximum_concurrent_rpcs, whose count lives in grpc's own loop (built with
            # one, the calls taken in here would pass it uncounted).
            coroutine = handle_rpc(method, resolver, self._interceptors, rpc_state, loop, False)
            call = loop.create_task(schedule_rpc(coroutine, rpc_state, loop, method))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
            taken.inc()
            if not aio_server.is_running():
                # Stopping: no new request, as grpc's own loop makes none once the server
                # leaves RUNNING (core would fail it at once; once the server is
                # destroyed there is no core server left to ask).
                return

    async def close(self) -> None:
        """Once the server has stopped: wait for the loops to end (they end when core
        fails their requests), cancelling any left."""
        for loop_task in list(self._loops):
            loop_task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)

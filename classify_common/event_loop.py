"""The event loop both servers run on: uvloop by default, asyncio's own on request.

Why uvloop: each request goes around the loop a dozen times or more in each
process (gRPC's completions, our tasks, the device thread's answers), and
asyncio's loop does its bookkeeping in Python. uvloop does it in C. Through the
front door at 64 clients on topic-static (the serving path's own cost), the
orchestrator spent 7% and the capability 9% less CPU a request on it, and the
two served 7% more (docs/benchmark.md, "the servers on uvloop"). grpc.aio runs
on any asyncio loop.

Why a subclass: uvloop's `loop.time()` is libuv's clock in whole milliseconds.
The servers measure with `loop.time()` (queue waits of a fraction of a
millisecond, the round trips the coalescer learns from, trace node durations),
so here it reads the same monotonic clock at full resolution, as asyncio's loop
does. Timers (`call_at`, `asyncio.timeout`) still fire to uvloop's millisecond
(their delay is rounded to one): up to half a millisecond early or late.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final

import uvloop

UVLOOP: Final = "uvloop"
ASYNCIO: Final = "asyncio"
EVENT_LOOPS: Final = (UVLOOP, ASYNCIO)


class FineClockLoop(uvloop.Loop):
    """uvloop, with `time()` at the monotonic clock's full resolution."""

    # The clock libuv reads too (CLOCK_MONOTONIC, in milliseconds), so a time from it
    # suits `call_at`. The C function itself, not a method that calls it: the loop
    # is asked the time several times a request.
    time = staticmethod(time.monotonic)


def running_loop_kind() -> str:
    """Which of EVENT_LOOPS the running loop is (for the serving log line)."""
    return UVLOOP if isinstance(asyncio.get_running_loop(), uvloop.Loop) else ASYNCIO


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a new loop of `kind` (one of EVENT_LOOPS), for `asyncio.Runner`."""
    if kind == UVLOOP:
        return FineClockLoop
    if kind == ASYNCIO:
        return asyncio.new_event_loop
    raise ValueError(f"unknown event loop {kind!r}; one of {', '.join(EVENT_LOOPS)}")

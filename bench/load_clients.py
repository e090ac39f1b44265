"""Closed-loop callers with deadlines, spread over client processes, for the overload bench.

One Python process cannot keep a thousand callers' timing honest: its event loop
falls behind, and a refusal the server sent within two milliseconds is seen a
quarter of a second later (measured: an independent low-rate caller saw p99
12.6 ms while the 1,024-caller process saw 163 ms for the same refusals). So
each process drives at most CALLERS_PER_PROCESS callers, all processes start
and stop at the same wall-clock time, and their records are merged.

A caller behaves as a well-made client does: after an answer carrying a
RetryInfo it waits the delay (unless the phase says not to); after any other
answer it calls again at once.
A phase may ramp its callers in: caller k of n sends its first call k/n of
`ramp_seconds` after the phase starts, as a crowd arrives, instead of all n
in the same millisecond (a burst no server answers faster than its per-call
cost times n; the overload bench reports the first second on its own).

Kept free of torch and the model code, so a client process starts in a moment.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

import grpc
from google.rpc import error_details_pb2, status_pb2

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc

CALLERS_PER_PROCESS = 128
# Callers sharing one connection (many callers are many clients; 16 per connection
# and 128 measured the same).
CALLERS_PER_CONNECTION = 32
# Each channel its own connection: by default, the channels of one process to one
# target share one (gRPC's global subchannel pool), so every caller of a process
# reached one orchestrator worker of several (SO_REUSEPORT spreads connections).
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
# Calls without a deadline still get one, long enough never to matter.
NO_DEADLINE_SECONDS = 30.0
# A call is late when it ends more than this past its deadline. gRPC ends a call at
# its deadline on the caller's side, whatever the server does, so a late call is one
# whose caller's own event loop fell behind (on a machine the servers share); a call
# the service let run out without an answer or a refusal is UNANSWERED_REASON.
LATE_BY_SECONDS = 0.05
# The outcome's reason for a call that ended at its deadline with no status details:
# neither answered nor refused in time (the caller's deadline, or the server's gRPC
# ending it at the same deadline).
UNANSWERED_REASON = "(no reason: client deadline)"
UNANSWERED = f"DEADLINE_EXCEEDED: {UNANSWERED_REASON}"
# Seconds the processes get to start and connect before the phase begins together.
START_MARGIN_SECONDS = 3.0
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# The reason of a call refused because no backend could answer it in the time left.
REFUSED_UNREACHABLE = "DEADLINE_UNREACHABLE"

Metadata = tuple[tuple[str, str], ...]


@dataclass
class PhaseRecord:
    """What the callers of one phase saw; records of several processes add up."""

    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    ok_latencies: list[float] = field(default_factory=list)
    # Calls refused: RESOURCE_EXHAUSTED, or DEADLINE_EXCEEDED for DEADLINE_UNREACHABLE.
    refusal_latencies: list[float] = field(default_factory=list)
    # Seconds into the phase at which each refused call was sent (same order).
    refusal_sent_at: list[float] = field(default_factory=list)
    late: int = 0
    calls: int = 0
    # RESOURCE_EXHAUSTED answers that carried no RetryInfo (a client cannot pace itself).
    refused_without_hint: int = 0
    # CPU seconds the client processes spent.
    client_cpu_seconds: float = 0.0

    def add(self, other: PhaseRecord) -> None:
        self.outcomes.update(other.outcomes)
        for outcome, latencies in other.latencies.items():
            self.latencies.setdefault(outcome, []).extend(latencies)
        self.ok_latencies += other.ok_latencies
        self.refusal_latencies += other.refusal_latencies
        self.refusal_sent_at += other.refusal_sent_at
        self.late += other.late
        self.calls += other.calls
        self.refused_without_hint += other.refused_without_hint
        self.client_cpu_seconds += other.client_cpu_seconds


def status_details(error: grpc.aio.AioRpcError) -> tuple[str, float]:
    """The ErrorInfo reason and the RetryInfo delay (seconds, 0 if none) of a failure."""
    reason, delay = "", 0.0
    for key, value in error.trailing_metadata() or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        for detail in status_pb2.Status.FromString(value).details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                delay = retry.retry_delay.ToTimedelta().total_seconds()
    return reason, delay


async def _caller(
    stub: pb_grpc.ClassifyServiceAsyncStub,
    metadata: Metadata,
    texts: list[str],
    deadline: float | None,
    starts_at: float,
    stop_at: float,
    offset: int,
    record: PhaseRecord,
    first_call_after: float = 0.0,
    honour_hints: bool = True,
) -> None:
    loop = asyncio.get_running_loop()
    if first_call_after > 0:
        await asyncio.sleep(first_call_after)
    n = offset
    timeout = deadline if deadline is not None else NO_DEADLINE_SECONDS
    while loop.time() < stop_at:
        request = pb.ClassifyRequest(text=texts[n % len(texts)])
        n += 1
        started = loop.time()
        wait = 0.0
        try:
            await stub.Classify(request, metadata=metadata, timeout=timeout)
            outcome = "OK"
        except grpc.aio.AioRpcError as error:
            reason, wait = status_details(error)
            outcome = f"{error.code().name}: {reason or UNANSWERED_REASON}"
        took = loop.time() - started
        if loop.time() > stop_at:
            # Ended past the phase: left out, as drive() leaves such calls out (counted,
            # over the phase's seconds, they added 1-3% to its rates).
            break
        record.calls += 1
        record.outcomes[outcome] += 1
        record.latencies.setdefault(outcome, []).append(took)
        if outcome == "OK":
            record.ok_latencies.append(took)
        elif outcome.startswith("RESOURCE_EXHAUSTED") or outcome.endswith(REFUSED_UNREACHABLE):
            record.refusal_latencies.append(took)
            record.refusal_sent_at.append(started - starts_at)
            if outcome.startswith("RESOURCE_EXHAUSTED") and wait <= 0:
                record.refused_without_hint += 1
        if is_late(outcome, took, deadline):
            record.late += 1
        if wait > 0 and honour_hints:
            await asyncio.sleep(min(wait, max(stop_at - loop.time(), 0)))


def is_late(outcome: str, took: float, deadline: float | None) -> bool:
    """Whether a call that ended with `outcome` after `took` seconds counts as late:
    answered or refused more than LATE_BY_SECONDS past its deadline. A call that ran out
    unanswered (UNANSWERED) is counted as such, once: counted as both, a phase's calls
    past their deadline came to 103% of its calls."""
    return deadline is not None and took > deadline + LATE_BY_SECONDS and outcome != UNANSWERED


@dataclass(frozen=True)
class ProcessShare:
    """What one client process drives: its callers, from `first_caller` on, between
    `starts_at` (wall clock) and `seconds` later."""

    target: str
    metadata: Metadata
    texts: list[str]
    callers: int
    first_caller: int
    starts_at: float
    seconds: float
    deadline: float | None
    # Callers of the whole phase (all processes), and the seconds over which they
    # send their first calls (0: all at once).
    total_callers: int = 0
    ramp_seconds: float = 0.0
    # False: call again at once even after a RetryInfo (to measure what a refusal
    # costs, not how the hints pace the callers).
    honour_hints: bool = True

    def first_call_after(self, index: int) -> float:
        """Seconds into the phase at which this process's `index`-th caller starts."""
        if self.ramp_seconds <= 0:
            return 0.0
        return (self.first_caller + index) / max(self.total_callers, 1) * self.ramp_seconds


async def _drive(share: ProcessShare) -> PhaseRecord:
    record = PhaseRecord()
    channels = [
        grpc.aio.insecure_channel(share.target, options=OWN_CONNECTION)
        for _ in range(math.ceil(share.callers / CALLERS_PER_CONNECTION))
    ]
    try:
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), timeout=30)
        stubs = [pb_grpc.ClassifyServiceStub(channel) for channel in channels]
        await asyncio.sleep(max(share.starts_at - time.time(), 0))
        cpu_before = time.process_time()
        loop = asyncio.get_running_loop()
        starts_at = loop.time()
        stop_at = starts_at + share.seconds
        await asyncio.gather(
            *(
                _caller(
                    stubs[index // CALLERS_PER_CONNECTION],
                    share.metadata,
                    share.texts,
                    share.deadline,
                    starts_at,
                    stop_at,
                    (share.first_caller + index) * 7,
                    record,
                    share.first_call_after(index),
                    share.honour_hints,
                )
                for index in range(share.callers)
            )
        )
        record.client_cpu_seconds = time.process_time() - cpu_before
    finally:
        for channel in channels:
            await channel.close()
    return record


def _process_main(share: ProcessShare) -> PhaseRecord:
    return asyncio.run(_drive(share))


class RunningPhase:
    """A phase whose client processes have been started: it begins at `starts_at`
    (wall clock) and lasts `seconds`; `result()` waits for it and merges the records."""

    def __init__(
        self,
        target: str,
        metadata: Metadata,
        texts: list[str],
        callers: int,
        seconds: float,
        deadline: float | None,
        *,
        ramp_seconds: float = 0.0,
        honour_hints: bool = True,
    ) -> None:
        processes = math.ceil(callers / CALLERS_PER_PROCESS)
        shares = [callers // processes + (i < callers % processes) for i in range(processes)]
        self.seconds = seconds
        self.starts_at = time.time() + START_MARGIN_SECONDS
        # spawn, not fork: a forked copy of a process that has used grpc is not safe.
        self._pool = ProcessPoolExecutor(processes, mp_context=get_context("spawn"))
        self._futures = [
            self._pool.submit(
                _process_main,
                ProcessShare(
                    target,
                    metadata,
                    texts,
                    share,
                    sum(shares[:i]),
                    self.starts_at,
                    seconds,
                    deadline,
                    callers,
                    ramp_seconds,
                    honour_hints,
                ),
            )
            for i, share in enumerate(shares)
        ]

    def wait_for_start(self) -> None:
        time.sleep(max(self.starts_at - time.time(), 0))

    def result(self) -> PhaseRecord:
        record = PhaseRecord()
        try:
            for future in self._futures:
                record.add(future.result())
        finally:
            self._pool.shutdown()
        return record


def run_phase(
    target: str,
    metadata: Metadata,
    texts: list[str],
    callers: int,
    seconds: float,
    deadline: float | None,
    *,
    ramp_seconds: float = 0.0,
) -> PhaseRecord:
    """`callers` closed-loop callers for `seconds`, each call with `deadline` (seconds,
    or none), in ceil(callers / CALLERS_PER_PROCESS) client processes started
    together, the callers' first calls spread over `ramp_seconds`; their records merged."""
    return RunningPhase(
        target, metadata, texts, callers, seconds, deadline, ramp_seconds=ramp_seconds
    ).result()


def percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile: the smallest value that `share` of `values` are at
    or below (the 99th of 100 for p99). Every bench computes its percentiles here."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(math.ceil(share * len(ordered)) - 1, 0)]

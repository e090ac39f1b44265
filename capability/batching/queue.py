"""A bounded, deadline-aware queue of tokenized requests, grouped for batching.

Requests wait in lanes keyed by (priority, length bucket), FIFO within a lane.
What this module is for:

- Bounded: `admit` checks capacity before it allocates anything, and a full
  queue raises QueueFull at once; nothing ever waits for room.
- Deadline-aware: every admitted request with a deadline gets a timer on the
  event loop. When it fires the request leaves the queue and its caller gets
  ExpiredInQueue right away, even while the device is busy with another batch.
  A request that expired is never handed to the model.
- Priority and length: the next batch starts from the oldest request of the
  most urgent priority, takes its lane's requests, and tops up from the same
  bucket's less urgent lane, so a batch mixes lengths of one bucket only.
- Newest first when the queue stands (adaptive LIFO): when the oldest request
  of the most urgent priority has waited longer than `standing_seconds` (the
  larger of CoDel's 100 ms interval and two full batches), the queue is not
  draining between batches, and serving it oldest first would spend the device
  on requests whose callers are about to give up while the new ones age past
  their deadlines behind them. Batches are then taken newest first, so the
  requests that can still make their deadlines are the ones served; the old
  ones leave at their deadlines as ever. An oldest request without a deadline
  goes first even then, as it would never leave. Once the queue drains to a
  short wait, order is first-come first-served again.
- Picked to fit: the batcher may pass a `select` that says which requests of
  a batch being taken can end in time in it (it answers the others). They
  leave, and the batch is topped up from the same lanes, so the device gets
  a batch of requests that can still make their deadlines.

All methods run on the event loop thread; none blocks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from capability.batching.settings import BatchingSettings
from capability.model import EncodedText
from classify_common.errors import ExpiredInQueue, QueueFull
from classify_common.nodes import RequestTrace

# The queue stands when its oldest request has waited longer than this (CoDel's
# interval) and two full batches.
STANDING_QUEUE_SECONDS = 0.1
# A queued text whose caller went this close to its deadline (or after) counts as
# evicted at its deadline: the caller's own deadline passes first, by the time its call
# took to arrive, and its cancellation came here before this server's timer. 15% of
# the texts held past their deadlines (7-18 ms early, both in one process) were
# withdrawn uncounted by the deadline metrics.
CANCELLED_AT_DEADLINE_SECONDS = 0.25
# Lower sorts first: interactive before batch.
PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 1
PRIORITIES = (PRIORITY_INTERACTIVE, PRIORITY_BATCH)
# Times a batch being taken is picked and topped up again when some of its
# requests cannot end in time in it (each round answers at least one of them).
SELECT_ROUNDS = 3

ResultT = TypeVar("ResultT")


@dataclass(frozen=True, slots=True)
class Admission:
    """One tokenized text to queue, and what travels with it."""

    encoded: EncodedText
    priority: int
    request_id: str
    deadline: float | None  # event-loop time; None waits as long as it takes
    trace: RequestTrace | None = None


@dataclass(eq=False)
class PendingRequest(Generic[ResultT]):
    """One admitted text waiting for a batch; its future gets exactly one outcome."""

    encoded: EncodedText
    priority: int
    bucket: int
    request_id: str
    enqueued_at: float  # event-loop time
    deadline: float | None  # event-loop time; None waits as long as it takes
    future: asyncio.Future[ResultT]
    # Admission order, so ties in `enqueued_at` still resolve first-come first-served.
    sequence: int = 0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    # The request's trace, for the nodes its batch records, and when it was admitted
    # (epoch ns, the clock spans use).
    trace: RequestTrace | None = field(default=None, repr=False)
    admitted_ns: int = 0


# Which requests of a batch being taken stay in it (the selector answers the others).
Select = Callable[[list[PendingRequest[ResultT]]], Sequence[bool]]


class RequestQueue(Generic[ResultT]):
    def __init__(
        self,
        settings: BatchingSettings,
        *,
        retry_after: Callable[[int], float],
        on_evicted: Callable[[PendingRequest[ResultT]], None] = lambda request: None,
    ) -> None:
        """`retry_after(depth)` estimates seconds until a queue of `depth` drains."""
        self.settings = settings
        self._retry_after = retry_after
        self._on_evicted = on_evicted
        self._lanes: dict[tuple[int, int], collections.deque[PendingRequest[ResultT]]] = {
            (priority, bucket): collections.deque()
            for priority in PRIORITIES
            for bucket in range(len(settings.length_buckets))
        }
        self._size = 0
        self._sequence = itertools.count()
        self._changed = asyncio.Event()
        # Deepest the queue has been; tests and metrics show it never passes capacity.
        self.high_water = 0
        # Whether the batch being taken goes newest first (the queue stands), and how
        # many batches have (counted for tests and metrics).
        self.newest_first = False
        self.newest_first_batches = 0

    def __len__(self) -> int:
        return self._size

    def admit(
        self,
        encoded: EncodedText,
        *,
        priority: int,
        request_id: str,
        deadline: float | None,
        trace: RequestTrace | None = None,
    ) -> asyncio.Future[ResultT]:
        """Queue one text and return the future of its result, or raise QueueFull."""
        if self._size >= self.settings.queue_capacity:
            raise self._full()
        loop = asyncio.get_running_loop()
        future = self._enqueue(
            loop,
            loop.time(),
            time.time_ns(),
            Admission(encoded, priority, request_id, deadline, trace),
        )
        self._changed.set()
        return future

    def admit_many(
        self, admissions: Sequence[Admission]
    ) -> list[asyncio.Future[ResultT] | QueueFull]:
        """Queue texts in one step, in order: each gets the future of its result, or
        QueueFull when the queue had no room left for it (nothing of it is kept)."""
        loop = asyncio.get_running_loop()
        now, now_ns = loop.time(), time.time_ns()
        room = max(self.settings.queue_capacity - self._size, 0)
        outcomes: list[asyncio.Future[ResultT] | QueueFull] = [
            self._enqueue(loop, now, now_ns, admission) for admission in admissions[:room]
        ]
        if len(admissions) > room:
            outcomes += [self._full() for _ in admissions[room:]]
        if room and admissions:
            self._changed.set()
        return outcomes

    def _full(self) -> QueueFull:
        return QueueFull(
            f"queue full ({self._size} waiting)",
            retry_after_seconds=self._retry_after(self._size),
            queue_depth=self._size,
        )

    def _enqueue(
        self, loop: asyncio.AbstractEventLoop, now: float, now_ns: int, admission: Admission
    ) -> asyncio.Future[ResultT]:
        """Put one text in its lane (the caller checked for room); its eviction timer
        starts now."""
        deadline = admission.deadline
        request: PendingRequest[ResultT] = PendingRequest(
            encoded=admission.encoded,
            priority=admission.priority,
            bucket=self.settings.bucket_of(len(admission.encoded)),
            request_id=admission.request_id,
            enqueued_at=now,
            deadline=deadline,
            future=loop.create_future(),
            sequence=next(self._sequence),
            trace=admission.trace,
            admitted_ns=now_ns,
        )
        if deadline is not None:
            request.timer = loop.call_at(deadline, self._evict, request)
        self._lanes[(request.priority, request.bucket)].append(request)
        self._size += 1
        self.high_water = max(self.high_water, self._size)
        return request.future

    def _evict(self, request: PendingRequest[ResultT]) -> None:
        lane = self._lanes[(request.priority, request.bucket)]
        try:
            lane.remove(request)
        except ValueError:
            return  # already taken into a batch
        self._size -= 1
        if not request.future.done():
            request.future.set_exception(
                ExpiredInQueue(
                    "the deadline passed while the request was queued; it was not computed",
                    waited_ms=round(
                        (asyncio.get_running_loop().time() - request.enqueued_at) * 1000
                    ),
                )
            )
        self._on_evicted(request)
        self._changed.set()

    def withdraw_cancelled(self) -> int:
        """Take the requests whose callers have gone (their futures cancelled) out of
        their lanes; how many. Left there, each held a place until a batch or its
        deadline took it: callers still waiting were refused QUEUE_FULL, load reports
        counted them, and their timers counted them as deadline evictions. One whose
        caller went at its deadline (CANCELLED_AT_DEADLINE_SECONDS) is still told to
        `on_evicted`, as its timer would have."""
        withdrawn = 0
        at_deadline: list[PendingRequest[ResultT]] = []
        now = asyncio.get_running_loop().time()
        for key, lane in self._lanes.items():
            if not any(request.future.cancelled() for request in lane):
                continue
            kept: collections.deque[PendingRequest[ResultT]] = collections.deque()
            for request in lane:
                if request.future.cancelled():
                    if request.timer is not None:
                        request.timer.cancel()
                    withdrawn += 1
                    if (
                        request.deadline is not None
                        and request.deadline - now <= CANCELLED_AT_DEADLINE_SECONDS
                    ):
                        at_deadline.append(request)
                else:
                    kept.append(request)
            self._lanes[key] = kept
        self._size -= withdrawn
        for request in at_deadline:
            self._on_evicted(request)
        if withdrawn:
            self._changed.set()
        return withdrawn

    def standing_seconds(self) -> float:
        """How long the oldest request may wait before the queue counts as standing."""
        return max(STANDING_QUEUE_SECONDS, 2 * self._retry_after(self.settings.max_batch_size))

    def _head(self) -> PendingRequest[ResultT] | None:
        """The request the next batch starts from: the oldest of the most urgent
        non-empty priority, or its newest while the queue stands."""
        self.newest_first = False
        for priority in PRIORITIES:
            lanes = [
                lane
                for (lane_priority, _), lane in self._lanes.items()
                if lane_priority == priority and lane
            ]
            if not lanes:
                continue
            oldest = min((lane[0] for lane in lanes), key=lambda r: r.sequence)
            waited = asyncio.get_running_loop().time() - oldest.enqueued_at
            # A request without a deadline never leaves on its own: served newest
            # first it would wait for as long as new ones keep coming (seconds, under
            # steady load), so it goes first.
            if waited <= self.standing_seconds() or oldest.deadline is None:
                return oldest
            self.newest_first = True
            return max((lane[-1] for lane in lanes), key=lambda r: r.sequence)
        return None

    def _oldest(self, priority: int) -> PendingRequest[ResultT]:
        """The oldest queued request of `priority` (one is queued)."""
        return min(
            (
                lane[0]
                for (lane_priority, _), lane in self._lanes.items()
                if lane_priority == priority and lane
            ),
            key=lambda request: request.sequence,
        )

    def depth_in_bucket(self, bucket: int) -> int:
        return sum(len(self._lanes[(priority, bucket)]) for priority in PRIORITIES)

    def _take(
        self, head: PendingRequest[ResultT], select: Select[ResultT] | None
    ) -> list[PendingRequest[ResultT]]:
        """The batch that starts from `head`; `select` (if any) picks the requests that
        stay in it, and the batch is topped up from the same lanes after each pick."""
        batch: list[PendingRequest[ResultT]] = []
        self.newest_first_batches += self.newest_first
        for _ in range(SELECT_ROUNDS):
            if not self._top_up(head, batch) or select is None:
                break
            keep = select(batch)
            if all(keep):
                break
            batch = [request for request, kept in zip(batch, keep, strict=True) if kept]
        return batch

    def _top_up(self, head: PendingRequest[ResultT], batch: list[PendingRequest[ResultT]]) -> int:
        """Fill `batch` from `head`'s bucket, its priority first; how many were added."""
        added = 0
        for priority in PRIORITIES[PRIORITIES.index(head.priority) :]:
            lane = self._lanes[(priority, head.bucket)]
            while lane and len(batch) < self.settings.max_batch_size:
                request = lane.pop() if self.newest_first else lane.popleft()
                if request.timer is not None:
                    request.timer.cancel()
                batch.append(request)
                added += 1
        self._size -= added
        return added

    def take_due_before(self, cutoff: float) -> list[PendingRequest[ResultT]]:
        """Take every queued request whose deadline is before `cutoff` (loop time) out of
        the queue, for the caller to answer: none of them can start before then."""
        taken: list[PendingRequest[ResultT]] = []
        for key, lane in self._lanes.items():
            if not any(r.deadline is not None and r.deadline < cutoff for r in lane):
                continue
            kept: collections.deque[PendingRequest[ResultT]] = collections.deque()
            for request in lane:
                if request.deadline is not None and request.deadline < cutoff:
                    if request.timer is not None:
                        request.timer.cancel()
                    taken.append(request)
                else:
                    kept.append(request)
            self._lanes[key] = kept
        self._size -= len(taken)
        if taken:
            self._changed.set()
        return taken

    async def wait_not_empty(self) -> None:
        while not self._size:
            self._changed.clear()
            await self._changed.wait()

    def take_full_batch(
        self, select: Select[ResultT] | None = None
    ) -> list[PendingRequest[ResultT]] | None:
        """The next batch if it is already full, else None (nothing is taken); `select`
        picks its requests as in `next_batch`, so it may come out less than full."""
        head = self._head()
        if head is None or self.depth_in_bucket(head.bucket) < self.settings.max_batch_size:
            return None
        return self._take(head, select)

    async def wait_batch_ready(self) -> None:
        """Wait until the next batch may be taken: it is full, or its oldest request has
        waited `max_wait`; or the queue is empty (its requests were evicted)."""
        loop = asyncio.get_running_loop()
        while True:
            head = self._head()
            if head is None:
                return
            # Timed from the oldest request of the head's priority, whichever end the
            # batch is then taken from: timed from the head, the newest while the queue
            # stands, the window began anew at each arrival, and a max_wait longer than
            # standing_seconds (~0.2 s) never closed at light load while texts expired.
            closes_at = self._oldest(head.priority).enqueued_at + self.settings.max_wait_seconds
            if (
                self.depth_in_bucket(head.bucket) >= self.settings.max_batch_size
                or loop.time() >= closes_at
            ):
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=closes_at - loop.time())

    async def next_batch(
        self, select: Select[ResultT] | None = None
    ) -> list[PendingRequest[ResultT]]:
        """Wait for the next batch (wait_batch_ready) and take it. `select(batch)`, when
        given, says which of the requests taken stay in the batch and answers the
        others; the batch is then topped up (SELECT_ROUNDS times).

        An empty batch when the queue is empty, or empties meanwhile (its requests were
        evicted): the caller holds the device, and must not keep it waiting for more.
        """
        await self.wait_batch_ready()
        return self.take_batch(select)

    def take_batch(self, select: Select[ResultT] | None = None) -> list[PendingRequest[ResultT]]:
        """Take the next batch now, as next_batch does once it is ready, without waiting:
        for a caller that waited for the batch before it took the device (the head may
        have changed since, and a new head's window would be waited out holding it).
        Empty when the queue is."""
        head = self._head()
        return [] if head is None else self._take(head, select)

    def fail_all(self, error: Exception) -> None:
        """Answer every queued request with `error` (used when the worker stops)."""
        for lane in self._lanes.values():
            while lane:
                request = lane.popleft()
                if request.timer is not None:
                    request.timer.cancel()
                if not request.future.done():
                    request.future.set_exception(error)
        self._size = 0

"""Concurrent calls bound for one capability replica travel as one ClassifyBatch call.

Every RPC costs both processes a fixed amount of CPU (HTTP/2 framing, the
grpc.aio call objects, the capability's lifecycle), whatever it carries. A
coalescer sits in front of one replica of one backend (so one model) and sends
the items that are waiting as one `ClassifyBatch` call instead of one
`Classify` call each.

It never waits on a timer. Items that arrive in the same turn of the event
loop go together. While a call to the replica is in flight, the next items
gather, and go the moment it returns; only a full call leaves beside it, up
to `max_in_flight` calls at once. Full is one batch on the replica: the
`max_batch_size` of its last load report (or `max_items`, when it has not
said; never more). The items in flight to a replica stay within the queue
capacity of its last report: past it, the replica would refuse them
QUEUE_FULL. At one client nothing is ever held back: the single item leaves in
the same loop turn, as a plain `Classify`.

Interactive items never gather behind batch work alone: while every call in
flight carries only `PRIORITY_BATCH` items (a bulk ClassifyBatch sent as
such), interactive items leave at once in a call of their own, one beyond
`max_in_flight` (as many as the replica's queue has room for, a batch being
computed counted out of it), and the capability, which takes interactive
texts before batch ones, computes them next. Without it a single call waited
out two calls of 128 bulk items (a second or more).

Why a second call must be full: a partial call sent while one is in flight
stops gathering early, and splits the callers in flight into three groups
(computing, queued at the replica, gathering here) instead of two. At 32
closed-loop callers on the 2-core machine the replica computed batches of 10.5
texts that way, 15.9 this way, and the front door served 330-337 requests a
second against 365-411 (docs/benchmark.md, 2026-12-02). A full batch may go
beside the call in flight (the capability's own batcher queues one the same
way), so the device does not wait out a round trip when the callers are
many: at 128 callers its batches held 31.2 texts, against 24.7-29.

Each item keeps its own deadline, trace and outcome:
- an item may gather until its caller's deadline (less the margin the
  orchestrator keeps to answer), however long; the backend's `timeout` bounds
  its upstream call, from when that call leaves. Counted from the item's
  arrival, it also bounded the gathering: the items of a ClassifyBatch of
  1,024 that gathered behind the first calls were refused as unable to end
  within 5 s of arriving, and went to the fallback model (or failed), on an
  idle stack and with a minute left on the caller's deadline,
- the batch call's deadline is the latest of its items'; each item's own time
  travels in its `ItemContext.timeout`, less the time answers have been taking
  to come back (orchestrator.upstream.call_time.TripTime), so the capability
  server answers an item whose time ran out DEADLINE_EXCEEDED without
  computing it, and does not compute one whose answer would arrive here after
  its time ran out; an item whose time runs out while it gathers is answered
  here then (not when the call in flight comes back) and never sent; one
  whose time left as its call leaves is shorter than the replica's reported
  wait or than calls of its call's size have been taking (counted down while
  the replica has had no call of ours) is answered here at once and never
  sent; one whose time runs out while the call is in flight is answered here then, not
  when the call returns (which may be past its caller's deadline, where the
  caller would get a bare DEADLINE_EXCEEDED without its IDs); an item that
  would gather behind busy calls and cannot make its deadline even
  if they come back when expected and its own call is as quick as calls of
  its size have been (orchestrator.upstream.call_time) is refused
  DEADLINE_UNREACHABLE as it arrives, not when its turn to be sent comes,
- each item's `ItemContext.traceparent` is its own client span (the child of
  its `upstream_call` node, named after ClassifyBatch when merged), so the
  capability's spans for that item join the item's trace; the shared call gets
  its own client span, linked both ways with the items' client spans. An item's
  client span starts when its call leaves, not when it arrives: one answered
  here unsent (refused, or out of time while it gathered) has none, and its
  `upstream_call` node says so (`classify.sent` false) and how long it
  gathered (`classify.gather_ms`, as a sent one's does),
- each item gets its own answer or error, so retry and fallback decisions
  (orchestrator.dispatch) stay per request; an item the capability refuses
  while others are still to be computed (at intake or admission, or else
  left out at the device) is answered when it is refused, not when the
  call's last batch is computed: the call asks for early results
  (classify_common.context.EARLY_RESULTS_REQUEST_HEADER), and reads the
  answer's initial metadata before its message,
- each item keeps its own result-cache scope (its caller's tenant,
  classify_common.context.cache_scope_of): a lone item's goes in the call's
  CACHE_SCOPE_HEADER, a merged item's in its `ItemContext.cache_scope`. The
  ItemContexts are made here, never copied from a caller's ClassifyBatch, so a
  caller cannot name another tenant's scope.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import status_pb2
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from classify_common.context import (
    CACHE_SCOPE_HEADER,
    EARLY_RESULTS_HEADER,
    EARLY_RESULTS_REQUEST_HEADER,
    LOAD_REPORT_TRAILER,
    REQUEST_ID_HEADER,
    new_request_id,
)
from classify_common.errors import (
    DeadlineExpired,
    DeadlineUnreachable,
    ModelFault,
    ModelUnavailable,
    ServiceError,
)
from classify_common.intake import MAX_BATCH_TOTAL_CHARS
from classify_common.nodes import (
    CLASSIFY_BACKEND,
    CLASSIFY_BATCH_METHOD_NAME,
    CLASSIFY_BATCH_SIZE,
    CLASSIFY_GATHER_MS,
    CLASSIFY_METHOD_NAME,
    CLASSIFY_SENT,
    ERROR_TYPE,
    RPC_METHOD,
    RPC_RESPONSE_STATUS_CODE,
    RPC_SYSTEM_GRPC,
    RPC_SYSTEM_NAME,
    TIMEOUT_ATTRIBUTE,
    RequestTrace,
    current_trace,
    mark_error,
    server_attributes,
)
from classify_common.tracing import get_tracer, inject_context, spans_are_exported
from orchestrator.metrics import UNREACHABLE_CALL_TIME, UNREACHABLE_REPORTED_WAIT
from orchestrator.policy.concurrency import share_of
from orchestrator.upstream.call_time import CallTimeModel, TripTime
from orchestrator.upstream.errors import translate_item_status, translate_upstream_error
from orchestrator.upstream.load import ReplicaLoad

log = logging.getLogger(__name__)

# The client span of one shared upstream call, in a trace of its own, is named
# after its method, as OpenTelemetry's RPC conventions name client spans.
UPSTREAM_BATCH_SPAN_NAME = CLASSIFY_BATCH_METHOD_NAME
TRACEPARENT = "traceparent"
# An item of a batch call due this close to the call's own deadline is answered when
# the call ends, without a timer of its own: items keep a margin before their
# callers' deadlines (orchestrator.policy.retries' DEADLINE_SAFETY_MARGIN_SECONDS)
# far larger than this.
OWN_DEADLINE_SLACK_SECONDS = 0.002
# The event loop's timers may fire up to about this much before their time.
EXPIRY_RESOLUTION_SECONDS = 0.001
# A call nobody waits for any more is let go (cancelled); one unanswered this long (and
# past twice its expected time) counts as not answered, as its timeout would have.
UNANSWERED_AFTER_SECONDS = 1.0
# The most bytes of early results a batch call takes in its answer's initial
# metadata (a hundred refusals or so; the rest come with the answer). gRPC encodes
# binary metadata in base64, a third larger, within the channels' metadata limit
# (orchestrator.upstream.pool.CHANNEL_OPTIONS).
EARLY_RESULTS_MAX_BYTES = 24 * 1024
_EARLY_RESULTS_ASK = (EARLY_RESULTS_REQUEST_HEADER, str(EARLY_RESULTS_MAX_BYTES))
_CLASSIFY_BATCH_PATH = f"/{CLASSIFY_BATCH_METHOD_NAME}"


@dataclass(frozen=True)
class CoalescingSettings:
    """How calls to one replica are merged (orchestrator flags of the same names)."""

    # Most items in one upstream call, 1..1024; 1 sends every call on its own.
    max_items: int = 128
    # Upstream calls in flight to one replica and model at once, 1..64. Items that
    # arrive while a call is in flight gather for the next one; only a full call (one
    # batch on the replica) leaves beside a call in flight.
    max_in_flight: int = 2
    # Processes of one --processes set, each sending to the same replicas: each keeps
    # its share (share_of) of a replica's reported queue capacity, 1..1024.
    processes: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.max_items <= 1024:
            raise ValueError(f"max_items {self.max_items} is not within 1..1024")
        if not 1 <= self.max_in_flight <= 64:
            raise ValueError(f"max_in_flight {self.max_in_flight} is not within 1..64")
        if not 1 <= self.processes <= 1024:
            raise ValueError(f"processes {self.processes} is not within 1..1024")


# The request's log-line field naming the merged call (its request ID) that carried it
# to the capability, which logs it under that ID.
UPSTREAM_REQUEST_ID = "upstream_request_id"


@dataclass(eq=False)
class UpstreamItem:
    """One request's call to the replica, waiting to be sent."""

    request: pb.ClassifyRequest
    # Seconds its upstream call may take once sent (the backend's timeout, or less
    # when the caller's deadline is sooner).
    timeout: float
    # Loop time past which nobody waits for its answer: while it gathers, its caller's
    # deadline less the orchestrator's margin (math.inf without one); once sent, no
    # later than `timeout` after its call left.
    expires_at: float
    # Loop time it arrived at, to gather.
    arrived_at: float
    # Metadata that carries the item's trace: its client span's once it is sent.
    trace_metadata: Sequence[tuple[str, str]]
    # The item's `upstream_call` node span (the current span of its caller).
    span: trace.Span
    future: asyncio.Future[pb.ClassifyResponse] = field(repr=False)
    # The request's trace when it makes spans: the item then gets a client span when
    # it is sent. None for a shadow call, or a request whose spans nobody receives.
    request_trace: RequestTrace | None = None
    # From when its call leaves until it is answered; linked to the shared call's span.
    client_span: trace.Span = field(default=trace.INVALID_SPAN, repr=False)
    # The capability's result-cache scope for it (its caller's tenant's).
    cache_scope: str = ""
    # The caller's context (its bound request and trace IDs): what a lone call runs in,
    # and what a failed item's log line is written in.
    context: contextvars.Context = field(default_factory=contextvars.copy_context, repr=False)


class ReplicaCoalescer:
    """Merges the calls bound for one replica of one backend into batch calls."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        backend: str,
        target: str,
        credentials: Sequence[tuple[str, str]],
        settings: CoalescingSettings,
        on_sent: Callable[[int], None] = lambda items: None,
        on_expired: Callable[[], None] = lambda: None,
        on_unreachable: Callable[[str], None] = lambda cause: None,
        on_answered: Callable[[], None] = lambda: None,
        on_no_answer: Callable[[], None] = lambda: None,
        on_load: Callable[[bytes], ReplicaLoad | None] = lambda report: None,
        predicted_wait: Callable[[], float] = lambda: 0.0,
        replica_batch_size: Callable[[], int] = lambda: 0,
        replica_queue_capacity: Callable[[], int] = lambda: 0,
        retry_after: Callable[[], float] = lambda: 0.05,
    ) -> None:
        """`on_sent(items)` counts each upstream call; `on_expired()` each item whose time ran
        out before it could be sent, and `on_unreachable(cause)` each refused because it
        could not make its deadline there (shed, never sent), by what said so
        (UNREACHABLE_REPORTED_WAIT or UNREACHABLE_CALL_TIME); `on_answered()` and
        `on_no_answer()` report a call the replica answered, or one it did not answer
        (UNAVAILABLE, or out of time with no status from it: for outlier ejection);
        `on_load(report)` gets the load report trailer of each answered call, and gives
        back what it read (None: nothing);
        `predicted_wait()` is the replica's reported wait now, and `retry_after()` the
        hint for an item refused because of it, both in seconds; `replica_batch_size()`
        the most texts the replica reported computing in one batch, and
        `replica_queue_capacity()` the most its queue holds (each 0: not known)."""
        self._stub: pb_grpc.ClassifyServiceAsyncStub = pb_grpc.ClassifyServiceStub(channel)
        # ClassifyBatch called as a server stream (the wire is the same for a unary
        # answer): grpc.aio gives a unary call's initial metadata only with its answer,
        # and a stream's as soon as it arrives, which the early results need.
        self._classify_batch = channel.unary_stream(
            _CLASSIFY_BATCH_PATH,
            request_serializer=pb.ClassifyBatchRequest.SerializeToString,
            response_deserializer=pb.ClassifyBatchResponse.FromString,
        )
        self._backend = backend
        self._target = target
        self._server_attributes = server_attributes(target)
        self._credentials = tuple(credentials)
        self._settings = settings
        self._on_sent = on_sent
        self._on_expired = on_expired
        self._on_unreachable = on_unreachable
        self._on_answered = on_answered
        self._on_no_answer = on_no_answer
        self._on_load = on_load
        self._predicted_wait = predicted_wait
        self._replica_batch_size = replica_batch_size
        self._replica_queue_capacity = replica_queue_capacity
        self._retry_after = retry_after
        self._waiting: list[UpstreamItem] = []
        # Closed (close()): the replica left; nothing more is sent to it.
        self._closed = False
        # One timer for the waiting items, at the earliest of their deadlines (a timer
        # per item cost the orchestrator 2-3 µs an item to start and cancel).
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = math.inf
        self._forget_scheduled = False  # _forget_gone is due this loop turn
        self._in_flight = 0
        self._items_in_flight = 0
        # Calls in flight that carry an interactive item (see _beside_batch_calls_only).
        self._interactive_in_flight = 0
        # When each call in flight is expected back (loop time): its send time plus
        # the time calls of its size have been taking, or the wait the replica
        # reported then if that is longer.
        self._expected_back: list[float] = []
        # When the last call came back (loop time): with none in flight since, the
        # replica has been idle for us that long.
        self._last_back = 0.0
        # How long calls of n items take, from the calls answered, and how many items
        # calls carry.
        self.call_time = CallTimeModel()
        # How long answers take to come back from the replica, outside its handler.
        self.trip = TripTime()
        self._send_scheduled = False
        # Calls in flight, each with the items it carries, and when it was sent and is
        # expected back.
        self._calls: dict[asyncio.Task[None], list[UpstreamItem]] = {}
        self._sent_at_of: dict[asyncio.Task[None], tuple[float, float]] = {}

    @property
    def waiting(self) -> int:
        """Items gathered for the next call."""
        return len(self._waiting)

    @property
    def in_flight(self) -> int:
        """Calls to the replica not yet answered."""
        return self._in_flight

    @property
    def outstanding(self) -> int:
        """Items sent to the replica and not yet answered, and items gathering for it."""
        return self._items_in_flight + len(self._waiting)

    async def classify(
        self,
        request: pb.ClassifyRequest,
        *,
        seconds: float,
        trace_metadata: Sequence[tuple[str, str]],
        cache_scope: str = "",
        call_seconds: float | None = None,
    ) -> pb.ClassifyResponse:
        """The replica's answer to `request` within `seconds` from now (math.inf: its
        caller set no deadline), looked up in and stored under the result-cache scope
        `cache_scope`; failures come back as ServiceErrors. Its upstream call may take
        `call_seconds` once it leaves (the backend's timeout; None: what is left of
        `seconds`)."""
        loop = asyncio.get_running_loop()
        request_trace = current_trace()
        now = loop.time()
        item = UpstreamItem(
            request=request,
            timeout=seconds if call_seconds is None else min(call_seconds, seconds),
            expires_at=now + seconds,
            arrived_at=now,
            trace_metadata=trace_metadata,
            span=trace.get_current_span(),
            future=loop.create_future(),
            cache_scope=cache_scope,
            request_trace=(
                request_trace if request_trace is not None and request_trace.makes_spans else None
            ),
        )
        passes = request.priority != pb.PRIORITY_BATCH and self._beside_batch_calls_only()
        if not passes and not self._may_leave(len(self._waiting) + 1):
            self._refuse_if_it_cannot_make_it(item, loop.time())
        self._waiting.append(item)
        # Until it leaves it may gather behind a call in flight, or behind the calls a
        # large ClassifyBatch fills, until after its deadline.
        if item.expires_at < self._expiry_at:
            self._expire_at(loop, item.expires_at)
        if not self._send_scheduled and (passes or self._may_leave(len(self._waiting))):
            # Not sent right here: items that arrive in this same loop turn (the other
            # items of a ClassifyBatch, a burst of calls) go in the same call.
            self._send_scheduled = True
            loop.call_soon(self._send_waiting)
        try:
            response = await item.future
        except BaseException as error:
            if item.client_span is not trace.INVALID_SPAN:
                _end_client_span(item, error)
            # Gone, out of time here, or refused early: its call may have no item left
            # that anyone waits for.
            caller_gone = isinstance(error, asyncio.CancelledError)
            self._cancel_unwanted_call(item, caller_gone)
            if caller_gone:
                self._forget_gone_soon()
            raise
        if item.client_span is not trace.INVALID_SPAN:
            _end_client_span(item, None)
        return response

    def _forget_gone_soon(self) -> None:
        """Take the items whose callers have gone out of those gathering, once this
        loop turn's cancels are in (a cancelled ClassifyBatch's items go in one)."""
        if not self._forget_scheduled:
            self._forget_scheduled = True
            asyncio.get_running_loop().call_soon(self._forget_gone)

    def _forget_gone(self) -> None:
        """Left gathering, the items of callers gone counted as outstanding (pick()
        sent calls elsewhere) and sized the next call: after a ClassifyBatch of 300
        was cancelled while gathering, a single call was refused DEADLINE_UNREACHABLE
        as if it would leave with 128 items."""
        self._forget_scheduled = False
        self._waiting = [item for item in self._waiting if not item.future.done()]
        if not self._waiting and self._expiry is not None:
            self._expiry.cancel()
            self._expiry, self._expiry_at = None, math.inf

    def _cancel_unwanted_call(self, item: UpstreamItem, caller_gone: bool) -> None:
        """Cancel the call in flight that carries `item`, which is no longer waited for,
        once no item of it is. Left to run, it held a slot here (the items that came
        next gathered behind it, up to its timeout) while the replica computed texts
        nobody would read; cancelled, the replica drops what it has not computed. A
        call that has ended (its answer, or its failure, settled the item) is left be.

        Run on to its timeout, a call whose callers had gone (`caller_gone`: the last
        one's) was also how a frozen replica was seen not to answer (outlier
        ejection); so one let go after UNANSWERED_AFTER_SECONDS in flight, and more
        than twice the time it was expected to take, counts as one the replica did
        not answer. A hedge's loser let go sooner says nothing."""
        now = asyncio.get_running_loop().time()
        for task, items in self._calls.items():
            if item in items:
                if task.done() or not all(other.future.done() for other in items):
                    return
                sent_at, expected_back = self._sent_at_of[task]
                took = now - sent_at
                overdue = took >= max(UNANSWERED_AFTER_SECONDS, 2 * (expected_back - sent_at))
                if caller_gone and overdue:
                    self._on_no_answer()
                task.cancel()
                return

    def _may_leave(self, items: int) -> bool:
        """Whether `items` gathered may leave now: with no call in flight, whatever has
        gathered; beside calls in flight, only a full call, while a slot is free and the
        replica's queue has room for it."""
        if self._in_flight == 0:
            return True
        full = self._full_call()
        return (
            self._in_flight < self._settings.max_in_flight
            and items >= full
            and self._queue_room() >= full
        )

    def _queue_room(self) -> int:
        """Items one more call may carry within the replica's queue capacity (as it last
        reported), the items of the calls in flight counted as queued there (some are
        computing: it errs towards sending fewer); max_items when it has not said.
        Past the room, the replica refuses the rest QUEUE_FULL on an idle stack
        (1,024 items in calls of 1,024 against a queue of 256: 799 refused), and the
        adaptive limit takes those refusals for overload."""
        capacity = self._replica_queue_capacity()
        if capacity <= 0:
            return self._settings.max_items
        # With --processes N, every worker sends to the replica: each had its whole
        # queue, and N of them sent N times what it holds.
        return share_of(capacity, self._settings.processes) - self._items_in_flight

    def _beside_batch_calls_only(self) -> bool:
        """Whether interactive items may leave now in a call of their own, one beyond
        max_in_flight: every call in flight carries batch-priority items only."""
        return (
            0 < self._in_flight <= self._settings.max_in_flight and self._interactive_in_flight == 0
        )

    def _take_interactive(self) -> list[UpstreamItem]:
        """The interactive items gathering (up to one call's worth, and what the replica's
        queue holds beside the batch calls in flight), taken out of `_waiting`; the
        batch-priority ones stay, in order.

        The room counts one batch of the calls in flight as computing, out of the
        queue (the replica takes interactive texts first, so they wait for that one
        alone). Sent past the queue's room, 36 of 100 interactive calls beside 256
        bulk items in flight were refused QUEUE_FULL, which the adaptive limit took
        for overload."""
        most = min(self._settings.max_items, self._queue_room() + self._full_call())
        taken: list[UpstreamItem] = []
        kept: list[UpstreamItem] = []
        chars = 0
        for item in self._waiting:
            fits = len(taken) < most and (
                not taken or chars + len(item.request.text) <= MAX_BATCH_TOTAL_CHARS
            )
            if item.request.priority != pb.PRIORITY_BATCH and fits:
                taken.append(item)
                chars += len(item.request.text)
            else:
                kept.append(item)
        self._waiting[:] = kept
        return taken

    def _full_call(self) -> int:
        """Items that make a call full: one batch on the replica, as it last reported
        (at most max_items), or max_items."""
        batch = self._replica_batch_size()
        return min(batch, self._settings.max_items) if batch > 0 else self._settings.max_items

    def _items_for_one_call(self) -> int:
        """How many of the waiting items, from the first, one call carries: at most
        max_items and the replica's queue room, and no more text than one ClassifyBatch
        may hold. Callers' texts of
        up to 100,000 characters each are valid alone; merged past the batch's limit,
        the capability would refuse every item of the call for a rule none of them
        broke (and past 8 MiB, gRPC would refuse the message)."""
        most = max(min(self._settings.max_items, self._queue_room()), 1)
        chars = 0
        for count, item in enumerate(self._waiting[:most]):
            chars += len(item.request.text)
            if chars > MAX_BATCH_TOTAL_CHARS:
                return max(count, 1)
        return min(len(self._waiting), most)

    def _refuse_if_it_cannot_make_it(self, item: UpstreamItem, now: float) -> None:
        """DeadlineUnreachable now, rather than when its turn to be sent comes, for an
        item that gathers behind busy calls and cannot make its deadline even if a
        call comes back when expected and the call it then leaves in takes as long as
        calls of that size have been taking."""
        # It leaves once the calls in flight are back, or beside them once a full call
        # has gathered: counting from the first one back errs towards sending it, as
        # does counting it in the next call when more than max_items gathered first.
        sent_at = max(now, min(self._expected_back, default=now))
        # Behind more items than one call takes, the calls of those go first, each in
        # one of the slots as they free: counted as leaving with the first call back,
        # an item behind 900 waiting was let in and then refused as its turn came,
        # 0.84 s later with 145 ms left, too late for a fallback to help.
        # (A call as large as one may be: errs towards sending, as above.)
        per_call = self._settings.max_items
        calls_ahead = len(self._waiting) // per_call
        if calls_ahead:
            sent_at += calls_ahead * self.call_time.predict(per_call) / self._settings.max_in_flight
        # It leaves with the items gathered before it and with those that gather after
        # it, so its call is as large as calls have lately been, or larger. Counting
        # only the items before it judged the first items of each call by a call of a
        # few items, let through texts that the replica then left out or computed too
        # late, and refused them ~180 ms later instead of at once (docs/benchmark.md,
        # 2026-12-03).
        items = min(
            max(len(self._waiting) + 1, round(self.call_time.items_per_call())),
            self._settings.max_items,
        )
        wait = self._predicted_wait()
        needed = max(wait, self.call_time.predict(items))
        if _ends_by(item, sent_at) - sent_at >= needed:
            return
        self._on_unreachable(UNREACHABLE_REPORTED_WAIT if wait >= needed else UNREACHABLE_CALL_TIME)
        raise DeadlineUnreachable(
            f"backend {self._backend} is busy for about {(sent_at - now) * 1000:.0f} ms "
            f"and then needs about {needed * 1000:.0f} ms for a call of {items} items, but "
            f"only {(_ends_by(item, sent_at) - now) * 1000:.0f} ms are left",
            retry_after_seconds=self._retry_after(),
            backend=self._backend,
        )

    def _send_waiting(self) -> None:
        """Send what is waiting, as many calls as free slots allow."""
        self._send_scheduled = False
        if self._closed:
            self._answer_left_behind(self._waiting)
            self._waiting = []
            return
        now = asyncio.get_running_loop().time()
        while self._waiting:
            if self._may_leave(len(self._waiting)):
                leaving = self._items_for_one_call()
                batch = self._waiting[:leaving]
                del self._waiting[:leaving]
            elif self._beside_batch_calls_only():
                batch = self._take_interactive()
                if not batch:
                    break
            else:
                break
            live = [item for item in batch if not item.future.done()]
            # Items that gathered while the replica was busy may no longer have the
            # time their call needs, by the replica's reported wait or by how long
            # calls of this size have been taking: they go to a fallback now, not to
            # miss it there. Checked against the report alone, they went, and at 256
            # callers the replica then left 97-204 texts a phase out of time in its
            # queue and 172-330 items ran out while their call was in flight, against
            # 16-30 and 101-174 checked this way (docs/benchmark.md, 2026-12-05).
            wait = self._predicted_wait()
            idle = now - self._last_back if self._in_flight == 0 else 0.0
            needed = max(wait, self.call_time.predict(len(live), idle))
            for item in live:
                if item.expires_at <= now:
                    _record_gathered(item, now)
                    self._on_expired()
                    item.future.set_exception(
                        DeadlineExpired(
                            "the deadline passed before the backend could be called",
                            backend=self._backend,
                        )
                    )
                elif _ends_by(item, now) - now < needed:
                    _record_gathered(item, now)
                    self._on_unreachable(
                        UNREACHABLE_REPORTED_WAIT if wait >= needed else UNREACHABLE_CALL_TIME
                    )
                    judged_by = (
                        f"reports a wait of about {wait * 1000:.0f} ms"
                        if wait >= needed
                        else f"takes about {needed * 1000:.0f} ms for a call of {len(live)} items"
                    )
                    item.future.set_exception(
                        DeadlineUnreachable(
                            f"backend {self._backend} {judged_by}, but only "
                            f"{(_ends_by(item, now) - now) * 1000:.0f} ms are left",
                            retry_after_seconds=self._retry_after(),
                            backend=self._backend,
                        )
                    )
            live = [item for item in live if not item.future.done()]
            if not live:
                continue
            for item in live:
                item.expires_at = _ends_by(item, now)  # its call's own timeout runs now
            self._start_client_spans(live, now)
            self.call_time.sent(len(live))
            self._in_flight += 1
            self._items_in_flight += len(live)
            interactive = any(item.request.priority != pb.PRIORITY_BATCH for item in live)
            self._interactive_in_flight += interactive
            expected_back = now + max(wait, self.call_time.predict(len(live), idle))
            self._expected_back.append(expected_back)
            # A merged call runs in a context of its own: in whichever caller's context
            # scheduled it, its log lines carried that caller's IDs for everyone's.
            own = live[0].context.copy() if len(live) == 1 else contextvars.Context()
            sending = self._call(live, now, expected_back, interactive)
            task = asyncio.create_task(sending, context=own)
            self._calls[task] = live
            self._sent_at_of[task] = (now, expected_back)
            task.add_done_callback(self._calls.pop)
            task.add_done_callback(self._sent_at_of.pop)
        if not self._waiting and self._expiry is not None:
            self._expiry.cancel()
            self._expiry, self._expiry_at = None, math.inf

    async def _call(
        self, items: list[UpstreamItem], sent_at: float, expected_back: float, interactive: bool
    ) -> None:
        try:
            self._on_sent(len(items))
            if len(items) == 1:
                await self._call_one(items[0], sent_at)
            else:
                await self._call_many(items, sent_at)
        except asyncio.CancelledError:
            # Cancelled with items still waiting for it: its channel was closed as the
            # replica left (a name's look-up dropped its address). grpc.aio cancels the
            # call locally, with no status to answer them by; unanswered, a caller
            # without a deadline waited for ever (every caller has gone from a call
            # cancelled as unwanted).
            self._answer_left_behind(items)
            raise
        except Exception as exc:  # a bug here must not leave a caller without an answer
            log.exception(
                "upstream call failed unexpectedly",
                extra={
                    "backend": self._backend,
                    "request_ids": [item.request.request_id for item in items],
                },
            )
            for item in items:
                if not item.future.done():
                    item.future.set_exception(exc)
        finally:
            self._in_flight -= 1
            self._items_in_flight -= len(items)
            self._interactive_in_flight -= interactive
            self._expected_back.remove(expected_back)
            self._last_back = asyncio.get_running_loop().time()
            if self._waiting and not self._send_scheduled:
                self._send_waiting()

    async def _call_one(self, item: UpstreamItem, sent_at: float) -> None:
        """A lone item goes as a plain Classify, which costs less than a batch of one."""
        remaining = item.expires_at - sent_at
        metadata = (
            *item.trace_metadata,
            (REQUEST_ID_HEADER, item.request.request_id),
            (CACHE_SCOPE_HEADER, item.cache_scope),
            *self._credentials,
        )
        try:
            call = self._stub.Classify(item.request, timeout=remaining, metadata=metadata)
            response: pb.ClassifyResponse = await call
        except grpc.aio.AioRpcError as exc:
            self._take_load(exc.trailing_metadata())
            self._fail_all([item], exc)
            return
        round_trip = self._answered(1, sent_at)
        await self._read_load(call, round_trip, remaining)
        if not item.future.done():
            item.future.set_result(response)

    async def _call_many(self, items: list[UpstreamItem], sent_at: float) -> None:
        request = pb.ClassifyBatchRequest(items=[item.request for item in items])
        # The replica decides by the time it has: an item's answer must also come back.
        trip = self.trip.allowance()
        for item in items:
            context = request.item_contexts.add()
            context.timeout.CopyFrom(_duration(item.expires_at - sent_at - trip))
            context.traceparent = dict(item.trace_metadata).get(TRACEPARENT, "")
            context.cache_scope = item.cache_scope
        latest = max(item.expires_at for item in items)
        timeout = latest - sent_at
        # The call lasts until its latest item's deadline; each earlier one is answered
        # at its own, not held to the call's end past its caller's deadline. Items due
        # within OWN_DEADLINE_SLACK_SECONDS of its end (the items of one ClassifyBatch)
        # end with the call.
        loop = asyncio.get_running_loop()
        timers = [
            loop.call_at(item.expires_at, self._time_out, item)
            for item in items
            if item.expires_at < latest - OWN_DEADLINE_SLACK_SECONDS
        ]
        span = self._start_shared_span(items)
        # The capability logs the merged call under an ID of its own: each request's log
        # line names it, so that a grep finds the capability's side of a request.
        shared_id = new_request_id()
        for item in items:
            request_trace = item.context.run(current_trace)
            if request_trace is not None:
                request_trace.log_fields[UPSTREAM_REQUEST_ID] = shared_id
        try:
            with trace.use_span(span, end_on_exit=False):
                metadata = (
                    *inject_context(),
                    (REQUEST_ID_HEADER, shared_id),
                    _EARLY_RESULTS_ASK,
                    *self._credentials,
                )
            call = self._classify_batch(request, timeout=timeout, metadata=metadata)
            self._answer_early(items, await call.initial_metadata())
            response = await call.read()
            if not isinstance(response, pb.ClassifyBatchResponse):  # no message, status OK
                response = pb.ClassifyBatchResponse()
            span.set_attribute(RPC_RESPONSE_STATUS_CODE, grpc.StatusCode.OK.name)
        except asyncio.CancelledError:  # every caller went (_cancel_unwanted_call)
            # Said to the replica in so many words: a stream call's RPC outlives the task
            # reading it.
            call.cancel()
            span.set_attribute(RPC_RESPONSE_STATUS_CODE, grpc.StatusCode.CANCELLED.name)
            raise
        except grpc.aio.AioRpcError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.code().name))
            span.set_attribute(RPC_RESPONSE_STATUS_CODE, exc.code().name)
            span.set_attribute(ERROR_TYPE, exc.code().name)
            self._take_load(exc.trailing_metadata())
            self._fail_all(items, exc)
            return
        finally:
            span.end()
            for timer in timers:
                timer.cancel()
        # A replica that failed every item as a failed call says it did not answer
        # (see _not_answered: UNAVAILABLE, a broken device's MODEL_FAULT among them, or
        # NOT_FOUND) counts as one that did not answer, as a single call would: counted
        # as answered, a pod whose device broke reset its count at every merged call
        # and was never ejected under load. Stops at the first item it served.
        unserved = bool(response.results) and all(
            result.HasField("error") and result.error.code in _NOT_ANSWERED_CODES
            for result in response.results
        )
        round_trip = self._answered(len(items), sent_at, not unserved)
        await self._read_load(call, round_trip, timeout)
        if len(response.results) != len(items):
            log.error(
                "capability answered a batch with the wrong number of results",
                extra={"backend": self._backend, "sent": len(items), "got": len(response.results)},
            )
        for index, item in enumerate(items):
            if item.future.done():
                continue
            if index >= len(response.results):
                # A fault of the replica, not a deadline: as DeadlineExpired it read as
                # the backend's timeout and fed the concurrency limit as overload.
                item.future.set_exception(
                    ModelFault(
                        f"backend {self._backend} answered without a result for the item",
                        backend=self._backend,
                    )
                )
                continue
            result = response.results[index]
            if result.HasField("response"):
                item.future.set_result(result.response)
            else:
                item.future.set_exception(self._item_error(item, result.error))

    def _answer_early(self, items: list[UpstreamItem], metadata: Any) -> None:
        """Answer the items the replica refused while others were still to be computed,
        as it sent them in the call's initial metadata (the call's answer repeats
        them)."""
        for key, value in metadata or ():
            if key != EARLY_RESULTS_HEADER or not isinstance(value, bytes):
                continue
            early = pb.ClassifyBatchResponse.FromString(value)
            for item, result in zip(items, early.results, strict=False):
                if result.HasField("error") and not item.future.done():
                    item.future.set_exception(self._item_error(item, result.error))
            return

    def _item_error(self, item: UpstreamItem, status: status_pb2.Status) -> ServiceError:
        """The error for one item the replica refused, logged under the item's IDs."""
        return item.context.run(translate_item_status, status, self._backend, self._target)

    def _expire_at(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = when
        self._expiry = loop.call_at(when, self._expire_gathered)

    def _expire_gathered(self) -> None:
        """Answer the waiting items whose time has run out (never sent), and set the
        timer for the earliest deadline of those still waiting. It may find none run
        out: the item it was set for has left since."""
        self._expiry, self._expiry_at = None, math.inf
        loop = asyncio.get_running_loop()
        # Within the timer's resolution of its deadline counts as run out.
        now = loop.time() + EXPIRY_RESOLUTION_SECONDS
        waiting: list[UpstreamItem] = []
        for item in self._waiting:
            if item.expires_at > now:
                waiting.append(item)
            elif not item.future.done():  # else its caller has gone
                _record_gathered(item, now)
                self._on_expired()
                item.future.set_exception(
                    DeadlineExpired(
                        "the deadline passed before the backend could be called",
                        backend=self._backend,
                    )
                )
        self._waiting = waiting
        soonest = min((item.expires_at for item in waiting), default=math.inf)
        if soonest != math.inf:
            self._expire_at(loop, soonest)

    def _time_out(self, item: UpstreamItem) -> None:
        """An item's time ran out while the batch call carrying it is still in flight:
        its caller is answered now (the capability drops it unseen, or its answer is
        ignored when the call returns)."""
        if not item.future.done():
            item.future.set_exception(
                DeadlineExpired(
                    f"backend {self._backend} did not answer in time", backend=self._backend
                )
            )

    def _answered(self, items: int, sent_at: float, served: bool = True) -> float:
        """Record a call answered (for outlier ejection, one the replica could not serve
        unless `served`); its round trip in seconds."""
        round_trip = asyncio.get_running_loop().time() - sent_at
        self.call_time.record(items, round_trip)
        if served:
            self._on_answered()
        else:
            self._on_no_answer()
        return round_trip

    async def _read_load(
        self,
        call: grpc.aio.UnaryUnaryCall[Any, Any] | grpc.aio.UnaryStreamCall[Any, Any],
        round_trip: float,
        longest: float,
    ) -> None:
        """Hand on the call's load report trailer, if the replica sent one, and learn the
        call's trip from the time it says it spent on the call."""
        load = self._take_load(await call.trailing_metadata())
        if load is not None and load.handled > 0:
            self.trip.record(round_trip, load.handled, longest)

    def _take_load(self, trailers: Any) -> ReplicaLoad | None:
        """Hand on the load report among a call's `trailers`, if the replica sent one:
        it comes with refusals too (a full queue, a wait too long for the deadline)."""
        for key, value in trailers or ():
            if key == LOAD_REPORT_TRAILER and isinstance(value, bytes):
                return self._on_load(value)
        return None

    def _start_client_spans(self, items: list[UpstreamItem], now: float) -> None:
        """Each traced item's client span, from now, as its call leaves: named after the
        method the call goes with, a child of its `upstream_call` node, and what its
        traceparent names, so the capability's spans hang under it. Its node says it
        was sent, and how long it gathered."""
        method = CLASSIFY_METHOD_NAME if len(items) == 1 else CLASSIFY_BATCH_METHOD_NAME
        attributes = {
            RPC_SYSTEM_NAME: RPC_SYSTEM_GRPC,
            RPC_METHOD: method,
            **self._server_attributes,
        }
        for item in items:
            if item.request_trace is None:
                continue
            item.span.set_attribute(CLASSIFY_SENT, True)
            _record_gathered(item, now)
            client_span = get_tracer().start_span(
                method,
                context=trace.set_span_in_context(item.span),
                kind=SpanKind.CLIENT,
                attributes=attributes,
            )
            item.client_span = client_span
            with trace.use_span(client_span, end_on_exit=False):
                item.trace_metadata = inject_context()

    def _start_shared_span(self, items: list[UpstreamItem]) -> trace.Span:
        """The shared call's client span, in a trace of its own, linked both ways with
        the items' own client spans (as the capability's batch span is with its
        requests), when spans are exported."""
        traced = [item.client_span for item in items if item.client_span.is_recording()]
        if not traced or not spans_are_exported():
            return trace.INVALID_SPAN
        span = get_tracer().start_span(
            UPSTREAM_BATCH_SPAN_NAME,
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            kind=SpanKind.CLIENT,
            attributes={
                RPC_SYSTEM_NAME: RPC_SYSTEM_GRPC,
                RPC_METHOD: CLASSIFY_BATCH_METHOD_NAME,
                **self._server_attributes,
                CLASSIFY_BACKEND: self._backend,
                CLASSIFY_BATCH_SIZE: len(items),
            },
            links=[Link(item_span.get_span_context()) for item_span in traced],
        )
        for item_span in traced:
            item_span.add_link(span.get_span_context())
        return span

    def _fail_all(self, items: list[UpstreamItem], exc: grpc.aio.AioRpcError) -> None:
        if _not_answered(exc):
            self._on_no_answer()
        for item in items:
            if not item.future.done():
                # Logged (translate_upstream_error) under the item's own IDs.
                error: ServiceError = item.context.run(
                    translate_upstream_error, exc, self._backend, self._target
                )
                item.future.set_exception(error)

    async def close(self) -> None:
        """Send nothing more: the items waiting are answered UNAVAILABLE at once (their
        route retries them on another replica). Wait for the calls in flight that a
        caller still waits for (they get their answers); cancel those that no caller
        does (their callers answered or gone, but not cancelled). After a stop's grace
        period every caller has gone, and a call to a frozen replica would otherwise
        hold the process up to the backend's timeout.

        The items waiting behind a call in flight once left as it came back, after the
        wait here had taken its list of calls: the channel closed next cancelled that
        new call, and its items were never answered."""
        self._closed = True
        self._answer_left_behind(self._waiting)
        self._waiting = []
        while self._calls:
            for task, items in list(self._calls.items()):
                if all(item.future.done() for item in items):
                    task.cancel()
            await asyncio.gather(*self._calls, return_exceptions=True)

    def _answer_left_behind(self, items: Sequence[UpstreamItem]) -> None:
        for item in items:
            if not item.future.done():
                item.future.set_exception(
                    ModelUnavailable(
                        f"replica {self._target} of backend {self._backend} left (its "
                        "address is gone, or the routes changed) before the call was "
                        "answered",
                        backend=self._backend,
                    )
                )


def _not_answered(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call says the replica did not answer: UNAVAILABLE, NOT_FOUND
    (it does not serve the backend's model, so it cannot answer for the backend), or
    our own deadline passing with no status from it (a server's status carries its
    request ID). A replica that is up but frozen (a stopped process, a wedged event
    loop) fails only in the last way; counted, it is ejected like one that is down. A
    replica slow from load answers some calls in time, and each answer resets its
    count."""
    code = exc.code()
    if code in _NOT_ANSWERED:
        return True
    if code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    return not any(key == REQUEST_ID_HEADER for key, _ in exc.trailing_metadata() or ())


# The codes that say the replica did not answer: a failed call's (_not_answered), and,
# on every item of a merged call, the items' errors' (as google.rpc.Status numbers).
_NOT_ANSWERED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
_NOT_ANSWERED_CODES = frozenset(code.value[0] for code in _NOT_ANSWERED)


def _record_gathered(item: UpstreamItem, now: float) -> None:
    """On a traced item's `upstream_call` node: the milliseconds it gathered here until
    `now` (loop time), when it left or was answered unsent."""
    if item.request_trace is not None:
        item.span.set_attribute(CLASSIFY_GATHER_MS, round((now - item.arrived_at) * 1e4) / 10)


def _ends_by(item: UpstreamItem, sent_at: float) -> float:
    """Loop time by which `item`, sent at `sent_at`, must be answered: its caller's
    deadline (less the margin), or its call's own timeout from then if sooner."""
    return min(item.expires_at, sent_at + item.timeout)


def _end_client_span(item: UpstreamItem, error: BaseException | None) -> None:
    """End a sent item's client span with what its caller got: the code the replica
    answered (or OK), error status on any failure (a client span's convention), and
    the timeout mark when its request was answered PROCESSING meanwhile."""
    span = item.client_span
    if error is None:
        span.set_attribute(RPC_RESPONSE_STATUS_CODE, grpc.StatusCode.OK.name)
    else:
        mark_error(span, error, SpanKind.CLIENT)
    if item.request_trace is not None and item.request_trace.timed_out:
        span.set_attribute(TIMEOUT_ATTRIBUTE, True)
    span.end()


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    # ItemContext.timeout must be above 0: an item sent with no time left still gets
    # a microsecond, and the capability answers it DEADLINE_EXCEEDED uncomputed.
    value.FromMicroseconds(max(int(seconds * 1e6), 1))
    return value

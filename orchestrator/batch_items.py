"""The items of a ClassifyBatch call, each served as a call of its own.

Every item gets its own request ID, trace and outcome: an error becomes the
item's Status, never the call's; a bug is answered as a single call's is (only
the IDs) and counted.

An item's request_id must not repeat an earlier item's in the same call: a
request ID names one result for GetResult (per tenant), so a repeat would share
its slot and one of the two results would be lost. The repeat is refused on its
own (INVALID_ARGUMENT, `items[i].request_id`, rule `request_id.unique`) and the
first item is served.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from opentelemetry import context as otel_context
from opentelemetry.trace import Link, Span, get_current_span, set_span_in_context

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.context import (
    RequestContext,
    bind_request,
    is_valid_request_id,
    new_request_id,
)
from classify_common.errors import (
    DeadlineExpired,
    FieldViolation,
    InvalidRequest,
    ServerDraining,
    ServiceError,
    grpc_code_for,
    internal_error,
)
from classify_common.intake import item_status
from classify_common.interceptor import is_cut_off
from classify_common.logs import log_event
from classify_common.metrics import RequestOutcomes
from classify_common.nodes import (
    ANSWER_DUE,
    CLASSIFY_BATCH_INDEX,
    CLASSIFY_REQUEST_ID,
    RPC_RESPONSE_STATUS_CODE,
    RequestTrace,
    bind_trace,
    cancelled_code,
    mark_error,
)
from classify_common.tracing import (
    TRACEPARENT_HEADER,
    extract_context,
    format_trace_id,
    get_tracer,
)

log = logging.getLogger(__name__)

# The span each item of a ClassifyBatch call gets when spans are exported; its nodes
# (route_match, backend_select, upstream_call, and the capability's) hang under it.
# It carries the item's request ID and index, and ends with the item's outcome as a
# call's server span does (status code, reason; error status on a server fault).
BATCH_ITEM_SPAN_NAME = "batch_item"

# The rule an item breaks by repeating an earlier item's request_id.
UNIQUE_REQUEST_ID_RULE = "request_id.unique"

# How an item is classified: request, IDs, seconds left (None: no deadline), headers.
ClassifyOne = Callable[
    [pb.ClassifyRequest, RequestContext, float | None, Mapping[str, str]],
    Awaitable[pb.ClassifyResponse],
]


def refuse_repeated_request_ids(
    items: Sequence[pb.ClassifyRequest], refused: Mapping[int, ServiceError]
) -> Mapping[int, ServiceError]:
    """The intake's refusals (`refused`, by item index) with each item that repeats an
    earlier item's request_id refused too. A repeat that broke other rules keeps their
    violations beside this one; a rate-limit refusal gives way to it (uniqueness is a
    rule of the batch, which no single call's order of checks speaks for). `refused`
    itself when no request_id repeats. An item refused at intake names no result, so
    a later item with its request_id is no repeat of it (refused as one, nothing was
    served under that ID)."""
    first_use: dict[str, int] = {}
    repeats: dict[int, ServiceError] = {}
    for index, item in enumerate(items):
        if not item.request_id:  # the server generates a fresh one
            continue
        first = first_use.get(item.request_id)
        if first is None:
            if index not in refused:
                first_use[item.request_id] = index
            continue
        repeated = FieldViolation(
            field=f"items[{index}].request_id",
            rule=UNIQUE_REQUEST_ID_RULE,
            message=f"must be unique within the batch; items[{first}] has the same",
        )
        earlier = refused.get(index)
        broken = earlier.violations if isinstance(earlier, InvalidRequest) else ()
        repeats[index] = InvalidRequest([*broken, repeated])
    return {**refused, **repeats} if repeats else refused


# Kept for any call with late items, whatever their number: waking the call's task,
# cancelling, writing and sending its answer, and a pause of the event loop (a
# garbage collection, the other calls' work) on the way. With the per-item part
# alone, 200 late items of a call in the test suite (both servers and every span in
# one process) were answered past the caller's deadline on an otherwise idle
# 2-core machine, and the caller saw none of them.
LATE_ANSWER_FIXED_SECONDS = 0.05
# Per item of a call, the least time kept for answering its late items (see
# LateAnswerAllowance): on the 2-core machine, answering the late items took 44 µs
# each (1,003 of 1,024) against a capability in another process, and 130 µs each
# with both servers in one process and every span exported (the tests).
LATE_ANSWER_FLOOR_SECONDS_PER_ITEM = 0.0002
# Per item, the time kept before any call has been measured: a fresh orchestrator's
# first large call has nothing to learn from. At the floor, the suite's calls of 200
# and 1,000 items were answered past their callers' deadlines in a slow hour (1,000
# unstarted items took 115-285 µs each to answer), and their callers saw none of them.
LATE_ANSWER_START_SECONDS_PER_ITEM = 0.0004
# The most: 2 s for a call of 1,024 items.
LATE_ANSWER_CEILING_SECONDS_PER_ITEM = 0.002
# How fast a lower measure brings the allowance down (a higher one raises it at once).
LATE_ANSWER_EASING = 0.1
# Calls of fewer items are not measured: a small call's late time is mostly a fixed
# cost (the loop's lag, the wake-up), which per item would be read as a slow machine
# and keep whole seconds of the next large call's time.
LATE_ANSWER_LEARNS_FROM_ITEMS = 64


class LateAnswerAllowance:
    """How long before a ClassifyBatch call's deadline its answer is due, per item of
    the call, for the items not answered by then to be answered DEADLINE_EXCEEDED with
    their IDs (their nodes and spans end, each its own), so that the call's answer,
    with every item, reaches its caller before the caller's own deadline does.

    Without any, a call of 1,024 items with 0.2-1 s left spent the rest failing its
    items one by one, answered after its caller had gone: the caller saw a bare
    DEADLINE_EXCEEDED with no result, not even for the items that were computed. A
    fixed allowance measured on an idle machine was too little on a busy one (the
    tests saw it on the 2-core machine under load), so beyond LATE_ANSWER_FIXED
    it follows what answering them took in calls of LATE_ANSWER_LEARNS_FROM_ITEMS
    items or more: a longer time
    raises it at once, shorter ones bring it down slowly, within LATE_ANSWER_FLOOR and
    CEILING per item. A call whose allowance is all the time it has is answered at
    once, no item started: started, its items would be answered after its caller's
    deadline, and the caller would see none of them."""

    def __init__(self) -> None:
        self.seconds_per_item = LATE_ANSWER_START_SECONDS_PER_ITEM

    def seconds_for(self, items: int) -> float:
        """The time to keep for answering a call of `items` items when it is due."""
        return LATE_ANSWER_FIXED_SECONDS + self.seconds_per_item * items

    def record(self, items: int, seconds: float) -> None:
        """A call of `items` items took `seconds` from being due to its answer."""
        if items < LATE_ANSWER_LEARNS_FROM_ITEMS:
            return
        measured = max(seconds - LATE_ANSWER_FIXED_SECONDS, 0.0) / items
        if measured < self.seconds_per_item:
            measured = self.seconds_per_item + LATE_ANSWER_EASING * (
                measured - self.seconds_per_item
            )
        self.seconds_per_item = min(
            max(measured, LATE_ANSWER_FLOOR_SECONDS_PER_ITEM), LATE_ANSWER_CEILING_SECONDS_PER_ITEM
        )


# What an item not answered when its call's answer is due is answered.
_ANSWER_DUE = DeadlineExpired("the call's deadline came before this item was answered")
# What an item not answered when the server's grace runs out is answered: the caller
# sends it again (to another orchestrator), and only it.
_CUT_OFF = ServerDraining("the server stopped before this item was answered; send it again")


def answer_unstarted(
    results: Sequence[pb.ClassifyBatchResult],
    request: pb.ClassifyBatchRequest,
    call_ids: RequestContext,
    call_trace: RequestTrace | None,
    outcomes: RequestOutcomes,
    refused: Mapping[int, ServiceError],
    *,
    cut_off: bool = False,
) -> None:
    """Answer each item whose task was cancelled before it ever ran, so that every item
    has an outcome: its refusal at intake (`refused`, by index) if it had one, else
    DEADLINE_EXCEEDED (the call's answer was due at once), or SERVER_DRAINING when the
    server cut the call off (`cut_off`). Each is answered as
    one that ran: under its own IDs (its traceparent's trace), with its span, its log
    line and its count in `outcomes`. (Answered under the call's trace ID, it named a
    trace with no span of it, and no line said it failed.)"""
    error = _CUT_OFF if cut_off else _ANSWER_DUE
    contexts = request.item_contexts
    for index, (result, item) in enumerate(zip(results, request.items, strict=True)):
        if result.WhichOneof("outcome") is None:
            item_context = contexts[index] if contexts else None
            # In a context of its own, as the item's task would have been: binding its
            # IDs here would rename the call's own.
            contextvars.copy_context().run(
                _answer_unstarted_item,
                result,
                item,
                item_context,
                call_ids,
                call_trace,
                outcomes,
                index,
                refused.get(index, error),
            )


def _answer_unstarted_item(
    result: pb.ClassifyBatchResult,
    item: pb.ClassifyRequest,
    item_context: pb.ItemContext | None,
    call_ids: RequestContext,
    call_trace: RequestTrace | None,
    outcomes: RequestOutcomes,
    index: int,
    error: ServiceError,
) -> None:
    ids, trace = _enter_item(item, item_context, call_ids, call_trace, index)
    result.error.CopyFrom(item_status(error, ids.request_id, ids.trace_id))
    _leave_item(result, trace, error, call_ids, outcomes)


async def answer_items_by(items: asyncio.Future[Any], seconds: float | None) -> bool:
    """Wait up to `seconds` (None: for as long as they take) for every item of a call
    (`items`, their gather); True when all were answered in time.

    Past it, the items still running are cancelled with ANSWER_DUE: each answers
    DEADLINE_EXCEEDED with its IDs (classify_item), and its spans and latency say
    DEADLINE_EXCEEDED, a time-out, not CANCELLED, a caller gone. When the call itself
    is cancelled meanwhile (its caller went, the server stops), so are the items, with
    the same message (so each item cut off by the server says so: classify_item).
    Either way every item task has ended when this returns or raises."""
    # NOTE: not even a wait of 0 when none is left: the items would start meanwhile, and
    # a call of 1,000 items due at once would be answered late, cancelling them.
    if (seconds is None or seconds > 0) and not items.done():
        try:
            await asyncio.wait((items,), timeout=seconds)
        except asyncio.CancelledError as cancelled:
            items.cancel(*cancelled.args[:1])
            await asyncio.wait((items,))
            raise
    if items.done():
        items.result()
        return True
    items.cancel(ANSWER_DUE)
    await asyncio.wait((items,))
    return False


def item_trace(
    call_trace: RequestTrace | None, traceparent: str, request_id: str, index: int | None
) -> RequestTrace | None:
    """The RequestTrace one batch item's nodes record into: timings and the node histogram
    always; an item span (under the item's own traceparent if it sent a valid one, and
    linked to the call's span, else under the call's span), with the item's request ID
    and `index` in its call, only when the call's spans are made. Without spans, an
    item that sent a traceparent is still in its trace: its IDs are reported, and its
    upstream attempt carries them."""
    if call_trace is None:
        return None
    parent = extract_context(((TRACEPARENT_HEADER, traceparent),)) if traceparent else None
    if parent is not None and not get_current_span(parent).get_span_context().is_valid:
        parent = None  # not a usable traceparent: the item stays in the call's trace
    if not call_trace.makes_spans:
        span = call_trace.server_span if parent is None else get_current_span(parent)
        return RequestTrace(span, call_trace.observe_node, started=call_trace.started)
    attributes: dict[str, str | int] = {CLASSIFY_REQUEST_ID: request_id}
    if index is not None:
        attributes[CLASSIFY_BATCH_INDEX] = index
    item_span = get_tracer().start_span(
        BATCH_ITEM_SPAN_NAME,
        context=call_trace.parent_context if parent is None else parent,
        links=() if parent is None else [Link(call_trace.server_span.get_span_context())],
        attributes=attributes,
    )
    return RequestTrace(item_span, call_trace.observe_node, started=call_trace.started)


def item_time_left(
    item_context: pb.ItemContext | None, call_remaining: float | None
) -> float | None:
    """The sooner of the call's deadline and the item's own timeout, in seconds."""
    if item_context is None or not item_context.HasField("timeout"):
        return call_remaining
    own = item_context.timeout.ToTimedelta().total_seconds()
    return own if call_remaining is None else min(call_remaining, own)


async def classify_item(
    result: pb.ClassifyBatchResult,
    classify: ClassifyOne,
    on_internal_error: Callable[[], None],
    item: pb.ClassifyRequest,
    item_context: pb.ItemContext | None,
    refusal: ServiceError | None,
    call_ids: RequestContext,
    call_remaining: float | None,
    headers: Mapping[str, str],
    call_trace: RequestTrace | None,
    outcomes: RequestOutcomes,
    index: int | None = None,
) -> None:
    """One item of a batch call, in a task of its own: its own request ID, nodes and
    outcome, written into `result`, its slot of the call's answer (an error becomes
    the item's Status, never the call's). Written in place: a message passed to a
    constructor is copied into it. Its outcome is counted in `outcomes` (unless its
    work goes on past a PROCESSING answer: counted when it ends). `index`: the item's
    place in its call."""
    remaining = item_time_left(item_context, call_remaining)
    ids, trace = _enter_item(item, item_context, call_ids, call_trace, index)
    trace_id = ids.trace_id
    # What the item was answered, for its span: None for an answer.
    failure: BaseException | None = None
    try:
        if refusal is not None:
            failure = refusal
            result.error.CopyFrom(item_status(refusal, ids.request_id, trace_id))
            return
        result.response.CopyFrom(await classify(item, ids, remaining, headers))
    except ServiceError as error:
        if isinstance(error, InvalidRequest) and index is not None:
            # A capability's refusal names the fields of the text it was sent (`text`);
            # the caller's are those of its item in this call.
            error = error.within(f"items[{index}]")
        failure = error
        result.error.CopyFrom(item_status(error, ids.request_id, trace_id))
    except asyncio.CancelledError as cancelled:
        # The call's answer is due (its deadline, less the time its items take to be
        # answered: answer_items_by), the server's grace is over, or its caller has
        # gone: this item says so with its own IDs.
        cut_off = is_cut_off(cancelled)
        # Its span: SERVER_DRAINING, or DEADLINE_EXCEEDED read from the cancellation.
        failure = _CUT_OFF if cut_off else cancelled
        answered = _CUT_OFF if cut_off else _ANSWER_DUE
        result.error.CopyFrom(item_status(answered, ids.request_id, trace_id))
        raise
    except Exception:
        # As the request lifecycle answers a bug in a single call: the IDs for the
        # caller, the traceback for the log, one count.
        log.exception("unhandled error", extra={"request_id": ids.request_id})
        on_internal_error()
        failure = internal_error(ids.request_id, trace_id)
        result.error.CopyFrom(item_status(failure, ids.request_id, trace_id))
    finally:
        _leave_item(result, trace, failure, call_ids, outcomes)


def _enter_item(
    item: pb.ClassifyRequest,
    item_context: pb.ItemContext | None,
    call_ids: RequestContext,
    call_trace: RequestTrace | None,
    index: int | None,
) -> tuple[RequestContext, RequestTrace | None]:
    """An item's IDs and trace, bound to the current context (its task's own)."""
    # As a single call's: its own request_id when valid, else a fresh one (an invalid
    # one is reported in its violations, not echoed back as its ID).
    own = item.request_id if is_valid_request_id(item.request_id) else ""
    request_id = own or new_request_id()
    traceparent = item_context.traceparent if item_context else ""
    trace = item_trace(call_trace, traceparent, request_id, index)
    trace_id = (
        format_trace_id(trace.server_span) if trace is not None else call_ids.trace_id
    ) or call_ids.trace_id
    ids = RequestContext(request_id, trace_id)
    bind_request(ids)
    if trace is not None:
        bind_trace(trace)
        # What the item's upstream attempts carry (inject_context reads OpenTelemetry's
        # current span): in this task's own context only. Without spans, no node made
        # it current, and an item that sent its traceparent was logged by the
        # capability under the call's trace, not the one it was answered with.
        otel_context.attach(set_span_in_context(trace.server_span))
    return ids, trace


def _leave_item(
    result: pb.ClassifyBatchResult,
    trace: RequestTrace | None,
    failure: BaseException | None,
    call_ids: RequestContext,
    outcomes: RequestOutcomes,
) -> None:
    """An answered item's outcome counted, its failure logged, its own span ended."""
    if trace is None or not trace.outcome_counted_elsewhere:
        _count_outcome(outcomes, trace, failure)
    if result.HasField("error"):
        _log_failed_item(result.error, call_ids, failure, trace)
    # Only an item span of its own is ended here; the call's ends with the call.
    if trace is not None and trace.makes_spans:
        _end_item_span(trace.server_span, failure)


def _count_outcome(
    outcomes: RequestOutcomes, trace: RequestTrace | None, failure: BaseException | None
) -> None:
    """Count an item's outcome as its caller sees it, under the route it took ("" when
    refused before routing)."""
    route = str(trace.log_fields.get("route", "")) if trace is not None else ""
    if failure is None:
        outcomes.count(route, "OK")
    elif isinstance(failure, ServiceError):
        outcomes.count(route, grpc_code_for(failure).name, failure.reason)
    elif isinstance(failure, asyncio.CancelledError):
        # Due (DEADLINE_EXCEEDED, as answered) or its caller gone (CANCELLED).
        code = cancelled_code(failure)
        reason = _ANSWER_DUE.reason if code is grpc.StatusCode.DEADLINE_EXCEEDED else ""
        outcomes.count(route, code.name, reason)


def _end_item_span(span: Span, failure: BaseException | None) -> None:
    """End an item's span with its outcome, as the lifecycle ends a call's server span:
    its status code and reason, and error status with `error.type` on a server fault."""
    if failure is None:
        span.set_attribute(RPC_RESPONSE_STATUS_CODE, grpc.StatusCode.OK.name)
    else:
        mark_error(span, failure)
    span.end()


def _log_failed_item(
    status: status_pb2.Status,
    call_ids: RequestContext,
    failure: BaseException | None,
    trace: RequestTrace | None,
) -> None:
    """A line for an item that failed, under its own request and trace IDs (bound to
    its task), naming the call it came in: the call's own `rpc` line names only the
    call, and a caller holding an item's IDs must find it in the log. An item answered
    is not logged on its own (a call of 1,024 items would write 1,024 lines)."""
    code, reason = _CODE_NAMES.get(status.code, str(status.code)), ""
    if (
        isinstance(failure, asyncio.CancelledError)
        and cancelled_code(failure) is grpc.StatusCode.CANCELLED
    ):
        # Its caller went away: CANCELLED, as its span and count say. The status kept
        # for no one says DEADLINE_EXPIRED, and each such item was logged as one.
        code = grpc.StatusCode.CANCELLED.name
    else:
        for packed in status.details:
            if packed.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                packed.Unpack(info)
                reason = info.reason
                break
    # What its trace gathered too (route, backend, model, attempts, the merged call's
    # upstream_request_id): the runbook finds a failing backend or replica by them, as
    # in a single call's `rpc` line.
    fields = {
        **(trace.log_fields if trace is not None else {}),
        "code": code,
        "reason": reason,
        "call_request_id": call_ids.request_id,
    }
    log_event(log, "batch item failed", fields)


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

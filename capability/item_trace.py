"""Each item of a ClassifyBatch call traced as if it were its own Classify call.

The orchestrator merges concurrent requests into one batch call, but every
request keeps its own trace: an item's capability nodes (capability_receive to
postprocess, classify_common.nodes) record into a RequestTrace of its own, in
the item's own trace (its ItemContext.traceparent, else the call's trace).

When spans are exported, the item gets a SERVER span named like a Classify
call's, parented on its traceparent and linked to the batch call's server span;
its nodes hang under it. When they are not, no span is made per item: the
item's RequestTrace carries a non-recording span with the item's IDs, and its
nodes still land in the node histogram, once per item.

Work the items of one call share (receiving and checking the call, one tokenizer
call, one queue admission, one batch on the device) is recorded per item with
the shared start and end times.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import AttributeValue

from classify_common.errors import InvalidRequest, ServiceError, grpc_code_for
from classify_common.nodes import (
    CAPABILITY_RECEIVE,
    CLASSIFY_BATCH_INDEX,
    CLASSIFY_BATCH_METHOD_NAME,
    CLASSIFY_METHOD_NAME,
    CLASSIFY_REQUEST_ID,
    CLASSIFY_VIOLATION_FIELDS,
    CLASSIFY_VIOLATIONS,
    RPC_METHOD,
    RPC_RESPONSE_STATUS_CODE,
    RPC_SYSTEM_GRPC,
    RPC_SYSTEM_NAME,
    RequestTrace,
    emit_node,
    mark_error,
)
from classify_common.tracing import extract_context, get_tracer, spans_are_exported

# An item's server span has the name a Classify call's server span has, so an
# operator reads one request's trace the same way whether it was merged or not.
ITEM_SPAN_NAME = CLASSIFY_METHOD_NAME
TRACEPARENT = "traceparent"


@dataclass(frozen=True)
class CallReceipt:
    """When a batch call was received and checked: its `capability_receive` node."""

    start_ns: int  # epoch ns, the clock spans use
    end_ns: int
    # Event-loop time the call arrived: an item's ItemContext.timeout counts from it.
    loop_time: float

    @classmethod
    def of(cls, call_trace: RequestTrace | None) -> CallReceipt:
        """The receipt of the current call, whose `capability_receive` just ended."""
        seconds = call_trace.seconds.get("capability_receive", 0.0) if call_trace else 0.0
        end_ns = time.time_ns()
        loop_now = asyncio.get_running_loop().time()
        return cls(end_ns - round(seconds * 1e9), end_ns, loop_now - seconds)

    def seconds_since(self) -> float:
        """Seconds from the call's arrival to now: what the load report says it took."""
        return asyncio.get_running_loop().time() - self.loop_time


def start_item_trace(
    call_trace: RequestTrace | None,
    receipt: CallReceipt,
    *,
    index: int,
    request_id: str,
    traceparent: str,
    refusal: ServiceError | None,
) -> RequestTrace | None:
    """Item `index`'s own RequestTrace, with its `capability_receive` node recorded (in
    error when the item was refused at intake); None outside a traced call."""
    if call_trace is None:
        return None
    call_span = call_trace.server_span
    parent = extract_context(((TRACEPARENT, traceparent),)) if traceparent else None
    if parent is not None and not trace.get_current_span(parent).get_span_context().is_valid:
        parent = None  # not a usable traceparent: the item stays in the call's trace
    span: trace.Span
    if spans_are_exported():
        span = get_tracer().start_span(
            ITEM_SPAN_NAME,
            context=call_trace.parent_context if parent is None else parent,
            kind=SpanKind.SERVER,
            attributes={
                RPC_SYSTEM_NAME: RPC_SYSTEM_GRPC,
                RPC_METHOD: CLASSIFY_BATCH_METHOD_NAME,
                CLASSIFY_REQUEST_ID: request_id,
                CLASSIFY_BATCH_INDEX: index,
            },
            links=() if parent is None else [Link(call_span.get_span_context())],
            start_time=receipt.start_ns,
        )
    elif parent is None:
        span = trace.NonRecordingSpan(call_span.get_span_context())
    else:
        span = trace.get_current_span(parent)  # non-recording, with the caller's IDs
    item_trace = RequestTrace(span, call_trace.observe_node)
    attributes: dict[str, AttributeValue] | None = None
    if item_trace.makes_spans:
        attributes = {RPC_METHOD: CLASSIFY_BATCH_METHOD_NAME, CLASSIFY_BATCH_INDEX: index}
        if isinstance(refusal, InvalidRequest):
            attributes[CLASSIFY_VIOLATIONS] = len(refusal.violations)
            attributes[CLASSIFY_VIOLATION_FIELDS] = [v.field for v in refusal.violations]
    emit_node(
        item_trace,
        CAPABILITY_RECEIVE,
        receipt.start_ns,
        receipt.end_ns,
        attributes,
        error=refusal,
    )
    return item_trace


def end_item_trace(item_trace: RequestTrace | None, error: ServiceError | None) -> None:
    """End the item's server span (when one was made) with its outcome."""
    if item_trace is None or not item_trace.makes_spans:
        return
    span = item_trace.server_span
    code = grpc.StatusCode.OK if error is None else grpc_code_for(error)
    if error is not None:
        mark_error(span, error)
    span.set_attribute(RPC_RESPONSE_STATUS_CODE, code.name)
    span.end()


def abandon_item_trace(item_trace: RequestTrace | None) -> None:
    """End the item's server span when the call ended before the item was answered
    (the caller went away)."""
    if item_trace is None or not item_trace.makes_spans:
        return
    item_trace.server_span.set_attribute(RPC_RESPONSE_STATUS_CODE, grpc.StatusCode.CANCELLED.name)
    item_trace.server_span.end()

"""The orchestrator's domain step: pick the route, call its backends, complete the answer.

A ClassifyBatch call is many such calls at once: each item is routed, retried,
sent to a fallback or answered PROCESSING on its own, and answered with its
response or its error; the items' upstream calls meet again in the coalescers
(orchestrator.upstream.coalescer), which send those bound for one replica
together.

A call tries the route's primary backend with its retry policy: a retryable
failure is tried again on another replica after a jittered backoff, within the
attempt limit and the caller's deadline. When the backend still fails with a
model error or overload, the route's fallback backends are tried in order, and
the answer says `fallback=true`. Client errors are returned at once, never
retried or sent elsewhere.

Calls refused before any work are not retried on the same backend but go
straight to the fallbacks: the backend is at its adaptive concurrency limit
(ConcurrencyLimited), or its replica reports a wait longer than the time left
(DeadlineUnreachable), where a cheaper model may still answer in time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from opentelemetry.trace import Link, SpanKind
from prometheus_client import Histogram

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.context import RequestContext, bind_request, new_request_id
from classify_common.errors import (
    ConcurrencyLimited,
    DeadlineExpired,
    ServiceError,
    grpc_code_for,
    internal_error,
    is_fallback_eligible,
)
from classify_common.intake import current_batch_intake, item_status
from classify_common.nodes import RequestTrace, bind_trace, current_trace, emit_node, node
from classify_common.tracing import extract_context, format_trace_id, get_tracer
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.policy import RetryBudget, backoff_seconds
from orchestrator.results import ResultStore
from orchestrator.routing import Backend, RequestFacts, Route, RouteTable
from orchestrator.upstream import UpstreamPools
from orchestrator.upstream.pool import DEADLINE_SAFETY_MARGIN_SECONDS, BackendPool

log = logging.getLogger(__name__)


def request_facts(
    request: pb.ClassifyRequest, ids: RequestContext, headers: Mapping[str, str]
) -> RequestFacts:
    return RequestFacts(
        text_chars=len(request.text),
        model=request.model,
        priority="batch" if request.priority == pb.PRIORITY_BATCH else "interactive",
        request_id=ids.request_id,
        headers=headers,
    )


@dataclass
class Attempts:
    """One call's attempts across its backends, numbered from 1 for traces and logs."""

    count: int = 0
    # Why the next attempt happens: the failure retried, or the one that sent it on.
    retry_reason: str = ""
    fallback_reason: str = ""


class RoutingState:
    """One version of routes.yaml and what it needs to serve: channels, retry budget.

    Calls count themselves in and out, so a replaced state closes its channels
    only after the calls that started on it have finished.
    """

    def __init__(self, table: RouteTable, upstream: UpstreamPools) -> None:
        self.table = table
        self.upstream = upstream
        self.retry_budget = RetryBudget(table.retry_budget)
        self.in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._drained.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._drained.set()

    async def close_when_drained(self) -> None:
        await self._drained.wait()
        await self.upstream.close()


# The span each item of a ClassifyBatch call gets when spans are exported; its nodes
# (route_match, backend_select, upstream_call, and the capability's) hang under it.
BATCH_ITEM_SPAN_NAME = "batch_item"


def _item_trace(call_trace: RequestTrace | None, traceparent: str) -> RequestTrace | None:
    """The RequestTrace one batch item's nodes record into: timings and the node histogram
    always; an item span (under the item's own traceparent if it sent one, else under
    the call's span, and linked to it) only when the call's spans are made."""
    if call_trace is None:
        return None
    if not call_trace.makes_spans:
        return RequestTrace(call_trace.server_span, call_trace.observe_node)
    parent = (
        extract_context((("traceparent", traceparent),))
        if traceparent
        else call_trace.parent_context
    )
    span = get_tracer().start_span(
        BATCH_ITEM_SPAN_NAME,
        context=parent,
        links=[Link(call_trace.server_span.get_span_context())] if traceparent else (),
    )
    return RequestTrace(span, call_trace.observe_node)


class Dispatcher:
    def __init__(
        self,
        state: RoutingState,
        metrics: OrchestratorMetrics,
        results: ResultStore,
        on_internal_error: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_internal_error()` counts a bug answered INTERNAL here rather than by the
        request lifecycle (a batch item's, a background call's)."""
        self.state = state
        self._on_internal_error = on_internal_error
        self.results = results
        self._metrics = metrics
        # Looked up once per (route, model, code): a labels() call per request costs more.
        self._durations: dict[tuple[str, str, str], Histogram] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        # Calls that outlived their budget and still run, for GetResult.
        self._background: set[asyncio.Task[pb.ClassifyResponse]] = set()

    def replace(self, state: RoutingState) -> None:
        """Serve new calls from `state`; the old one closes once its calls are done."""
        old, self.state = self.state, state
        task = asyncio.get_running_loop().create_task(old.close_when_drained())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        for work in self._background:
            work.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*self._retiring)
        await self.state.upstream.close()

    async def classify(
        self,
        request: pb.ClassifyRequest,
        ids: RequestContext,
        client_remaining: float | None,
        headers: Mapping[str, str],
    ) -> pb.ClassifyResponse:
        # Taken once: a reload during this call does not change the rules it follows.
        state = self.state
        with node("route_match") as span:
            route = state.table.select(request_facts(request, ids, headers))
            span.set_attributes(
                {"classify.route": route.name, "classify.rules_version": state.table.rules_version}
            )
        request_trace = current_trace()
        if request_trace is not None:
            request_trace.log_fields["route"] = route.name
        started = time.perf_counter()
        model, code = "", "OK"
        try:
            if route.budget_seconds is None:
                response = await self._run_on(state, route, request, ids, client_remaining)
            else:
                response = await self._classify_within_budget(
                    state, route, request, ids, client_remaining
                )
            model = response.model.name
            return response
        except ServiceError as error:
            code = grpc_code_for(error).name
            raise
        except asyncio.CancelledError:  # the client went away
            code = "CANCELLED"
            raise
        finally:
            key = (route.name, model, code)
            duration = self._durations.get(key)
            if duration is None:
                duration = self._durations[key] = self._metrics.request_duration.labels(*key)
            duration.observe(
                time.perf_counter() - started,
                exemplar={"trace_id": ids.trace_id} if ids.trace_id else None,
            )

    async def classify_batch(
        self,
        request: pb.ClassifyBatchRequest,
        ids: RequestContext,
        client_remaining: float | None,
        headers: Mapping[str, str],
    ) -> pb.ClassifyBatchResponse:
        """Every item as its own call, all at once; one result per item, in order."""
        self._metrics.batch_items.observe(len(request.items))
        refused = current_batch_intake().refused
        contexts = request.item_contexts
        call_trace = current_trace()
        results = await asyncio.gather(
            *(
                self._classify_item(
                    item,
                    contexts[index] if contexts else None,
                    refused.get(index),
                    ids,
                    client_remaining,
                    headers,
                    call_trace,
                )
                for index, item in enumerate(request.items)
            )
        )
        request_trace = current_trace()
        if request_trace is not None:
            failed = sum(1 for result in results if result.HasField("error"))
            request_trace.log_fields.update(items=len(results), items_failed=failed)
        return pb.ClassifyBatchResponse(results=results)

    async def _classify_item(
        self,
        item: pb.ClassifyRequest,
        item_context: pb.ItemContext | None,
        refusal: ServiceError | None,
        call_ids: RequestContext,
        call_remaining: float | None,
        headers: Mapping[str, str],
        call_trace: RequestTrace | None,
    ) -> pb.ClassifyBatchResult:
        """One item of a batch call, in a task of its own: its own request ID, nodes and
        outcome (an error becomes the item's Status, never the call's)."""
        remaining = call_remaining
        if item_context is not None and item_context.HasField("timeout"):
            own = item_context.timeout.ToTimedelta().total_seconds()
            remaining = own if remaining is None else min(remaining, own)
        item_trace = _item_trace(call_trace, item_context.traceparent if item_context else "")
        trace_id = (
            format_trace_id(item_trace.server_span) if item_trace is not None else call_ids.trace_id
        ) or call_ids.trace_id
        call_trace_span = call_trace.server_span if call_trace is not None else None
        ids = RequestContext(item.request_id or new_request_id(), trace_id)
        bind_request(ids)
        if item_trace is not None:
            bind_trace(item_trace)
        try:
            if refusal is not None:
                return pb.ClassifyBatchResult(error=item_status(refusal, ids.request_id, trace_id))
            response = await self.classify(item, ids, remaining, headers)
            return pb.ClassifyBatchResult(response=response)
        except ServiceError as error:
            return pb.ClassifyBatchResult(error=item_status(error, ids.request_id, trace_id))
        except Exception:
            # As the request lifecycle answers a bug in a single call: the IDs for the
            # caller, the traceback for the log, one count.
            log.exception("unhandled error", extra={"request_id": ids.request_id})
            self._on_internal_error()
            internal = internal_error(ids.request_id, trace_id)
            return pb.ClassifyBatchResult(error=item_status(internal, ids.request_id, trace_id))
        finally:
            # Only an item span of its own is ended here; the call's ends with the call.
            if item_trace is not None and item_trace.server_span is not call_trace_span:
                item_trace.server_span.end()

    async def _run_on(
        self,
        state: RoutingState,
        route: Route,
        request: pb.ClassifyRequest,
        ids: RequestContext,
        client_remaining: float | None,
    ) -> pb.ClassifyResponse:
        state.enter()
        try:
            return await self._classify(state, route, request, ids, client_remaining)
        finally:
            state.leave()

    async def _classify_within_budget(
        self,
        state: RoutingState,
        route: Route,
        request: pb.ClassifyRequest,
        ids: RequestContext,
        client_remaining: float | None,
    ) -> pb.ClassifyResponse:
        """Wait for the answer up to the route's budget; past it, answer PROCESSING and keep
        the work going so GetResult can return its result.

        The upstream calls are not bound by the client's deadline here: the work is
        meant to outlive the wait, bounded by each backend's own timeout.
        """
        assert route.budget_seconds is not None
        work = asyncio.create_task(self._run_on(state, route, request, ids, None))
        self._background.add(work)
        work.add_done_callback(self._background.discard)
        wait = route.budget_seconds
        if client_remaining is not None:
            wait = min(wait, client_remaining - DEADLINE_SAFETY_MARGIN_SECONDS)
        try:
            # shield: the client leaving (its deadline, a cancel) must not stop the work.
            return await asyncio.wait_for(asyncio.shield(work), timeout=max(wait, 0))
        except TimeoutError:
            request_trace = current_trace()
            if request_trace is not None:
                # The work goes on: its spans end later, marked, and are still exported.
                request_trace.mark_timed_out()
            self._keep_for_polling(work, route, ids)
            if client_remaining is not None and wait < route.budget_seconds:
                raise DeadlineExpired(
                    "the deadline passed while the model was working; poll GetResult",
                    request_id=ids.request_id,
                ) from None
            self._metrics.processing.labels(route.name).inc()
            return self._processing_response(route, ids)
        except asyncio.CancelledError:
            self._keep_for_polling(work, route, ids)
            raise

    def _processing_response(self, route: Route, ids: RequestContext) -> pb.ClassifyResponse:
        return pb.ClassifyResponse(
            request_id=ids.request_id,
            trace_id=ids.trace_id,
            status=pb.RESULT_STATUS_PROCESSING,
            route=route.name,
        )

    def _keep_for_polling(
        self, work: asyncio.Task[pb.ClassifyResponse], route: Route, ids: RequestContext
    ) -> None:
        self.results.hold(ids.request_id, self._processing_response(route, ids))

        def store(finished: asyncio.Task[pb.ClassifyResponse]) -> None:
            if finished.cancelled():
                return
            error = finished.exception()
            if error is None:
                self.results.finish(ids.request_id, response=finished.result())
            elif isinstance(error, ServiceError):
                self.results.finish(ids.request_id, error=error)
            else:
                log.error("unhandled error", exc_info=error, extra={"request_id": ids.request_id})
                self._on_internal_error()
                self.results.finish(
                    ids.request_id, error=internal_error(ids.request_id, ids.trace_id)
                )

        work.add_done_callback(store)

    async def _classify(
        self,
        state: RoutingState,
        route: Route,
        request: pb.ClassifyRequest,
        ids: RequestContext,
        client_remaining: float | None,
    ) -> pb.ClassifyResponse:
        state.retry_budget.record_request()
        deadline = None
        if client_remaining is not None:
            deadline = asyncio.get_running_loop().time() + client_remaining
        failure: ServiceError | None = None
        attempts = Attempts()
        for backend in route.backends:
            try:
                response = await self._call_backend(
                    state, route, backend, request, ids, deadline, attempts
                )
            except ServiceError as error:
                if not is_fallback_eligible(error):
                    raise
                failure = error
                attempts.fallback_reason = error.reason
                log.info(
                    "backend failed",
                    extra={"route": route.name, "backend": backend.name, "reason": error.reason},
                )
                continue
            if backend is not route.backend:
                assert failure is not None
                self._metrics.fallbacks.labels(
                    route.name, route.backend.name, backend.name, failure.reason
                ).inc()
            response.request_id = ids.request_id
            response.trace_id = ids.trace_id
            response.route = route.name
            response.status = pb.RESULT_STATUS_DONE
            response.fallback = backend is not route.backend
            request_trace = current_trace()
            if request_trace is not None:
                request_trace.log_fields.update(
                    backend=backend.name,
                    model=response.model.name,
                    model_version=response.model.version,
                    attempts=attempts.count,
                    fallback=response.fallback,
                )
            return response
        assert failure is not None, "a route has at least one backend"
        raise failure

    async def _call_backend(
        self,
        state: RoutingState,
        route: Route,
        backend: Backend,
        request: pb.ClassifyRequest,
        ids: RequestContext,
        deadline: float | None,
        attempts: Attempts,
    ) -> pb.ClassifyResponse:
        """Attempts on one backend under the route's retry policy."""
        pool = state.upstream.pool(backend)
        forwarded = pb.ClassifyRequest()
        forwarded.CopyFrom(request)
        # The backend serves one model; the capability server logs under our ID.
        forwarded.model = backend.model
        forwarded.request_id = ids.request_id
        loop = asyncio.get_running_loop()
        tried: set[str] = set()
        attempt = 1
        while True:
            attempts.count += 1
            try:
                return await self._attempt(pool, tried, forwarded, ids, deadline, attempts)
            except ServiceError as error:
                attempts.retry_reason, attempts.fallback_reason = error.reason, ""
                code = grpc_code_for(error)
                if attempt >= route.retry.max_attempts or not route.retry.retries(code):
                    raise
                if isinstance(error, ConcurrencyLimited):
                    # The whole backend is at its limit: another replica of it cannot
                    # help, and waiting here only holds the caller; a fallback may.
                    raise
                wait = backoff_seconds(route.retry, attempt)
                if deadline is not None and loop.time() + wait >= deadline:
                    raise
                if not state.retry_budget.try_spend():
                    self._metrics.retry_budget_exhausted.labels(route.name, backend.name).inc()
                    raise
                self._metrics.retries.labels(route.name, backend.name, error.reason).inc()
                await asyncio.sleep(wait)
                attempt += 1

    async def _attempt(
        self,
        pool: BackendPool,
        tried: set[str],
        forwarded: pb.ClassifyRequest,
        ids: RequestContext,
        deadline: float | None,
        attempts: Attempts,
    ) -> pb.ClassifyResponse:
        """One call to a replica not yet tried, as the `upstream_call` node; its
        `backend_select` node is recorded once the answer names the model version."""
        backend = pool.backend
        select_started = time.time_ns()
        target = pool.pick(avoid=tried)
        selected = time.time_ns()
        tried.add(target)
        loop = asyncio.get_running_loop()
        remaining = None if deadline is None else deadline - loop.time()
        version = ""
        reasons = {
            "classify.retry_reason": attempts.retry_reason,
            "classify.fallback_reason": attempts.fallback_reason,
        }
        try:
            with node(
                "upstream_call",
                {
                    "classify.attempt": attempts.count,
                    "classify.backend": backend.name,
                    **{key: value for key, value in reasons.items() if value},
                },
                kind=SpanKind.CLIENT,
                current=True,  # the capability server's spans hang under it
            ) as span:
                response = await pool.classify(forwarded, target=target, client_remaining=remaining)
                span.set_attribute("rpc.grpc.status_code", 0)
                version = response.model.version
                return response
        finally:
            request_trace = current_trace()
            if request_trace is not None:
                emit_node(
                    request_trace,
                    "backend_select",
                    select_started,
                    selected,
                    {
                        "classify.backend": backend.name,
                        "classify.replica": target,
                        "classify.model": backend.model,
                        "classify.model_version": version,
                    },
                )

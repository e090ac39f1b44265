"""The orchestrator's domain step: pick the route, call its backends, complete the answer.

A ClassifyBatch call is many such calls at once (orchestrator.batch_items): each
item is routed, retried, sent to a fallback or answered PROCESSING on its own,
and answered with its response or its error; the items' upstream calls meet
again in the coalescers (orchestrator.upstream.coalescer), which send those
bound for one replica together.

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

Each call is an `UpstreamCall` run by a `RouteCaller` (orchestrator.calls); the
retry decision is `RetryPolicy.decide` (orchestrator.policy.retries).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from opentelemetry import trace
from prometheus_client import Histogram

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.context import RequestContext
from classify_common.errors import (
    DeadlineExpired,
    InternalError,
    RateLimited,
    ServerDraining,
    ServiceError,
    grpc_code_for,
    internal_error,
)
from classify_common.intake import current_batch_intake
from classify_common.interceptor import is_cut_off
from classify_common.metrics import RequestOutcomes
from classify_common.nodes import (
    CLASSIFY_ROUTE,
    CLASSIFY_RULES_VERSION,
    ROUTE_MATCH,
    cancelled_code,
    current_trace,
    node,
)
from classify_common.tracing import exemplar_for
from orchestrator.batch_items import (
    LateAnswerAllowance,
    answer_items_by,
    answer_unstarted,
    classify_item,
    refuse_repeated_request_ids,
)
from orchestrator.calls import RouteCaller, RoutingState, UpstreamCall
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.policy.retries import DEADLINE_SAFETY_MARGIN_SECONDS
from orchestrator.results import ResultStore
from orchestrator.routing import RequestFacts, Route
from orchestrator.security.gate import current_caller
from orchestrator.shadow import ShadowTraffic

log = logging.getLogger(__name__)

# How much longer than the caller's due time a hold of its result's place is waited
# for: a hold started `hold_seconds` before it ends by then, give or take a turn of
# a busy event loop; one in this process's memory ends at its first step.
HOLD_GRACE_SECONDS = 0.005

# The ErrorInfo key of a deadline answered while the work goes on (GetResult will have
# its result).
RESULT_KEPT = "result_kept"
# The `code` of classify_request_duration_seconds for a PROCESSING answer: an OK of
# gRPC's, but no answer, and out of the latency objective's code="OK".
PROCESSING_CODE = "PROCESSING"


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


class Dispatcher:
    def __init__(
        self,
        state: RoutingState,
        metrics: OrchestratorMetrics,
        results: ResultStore,
        outcomes: RequestOutcomes,
        on_internal_error: Callable[[], None] = lambda: None,
        shadow: ShadowTraffic | None = None,
    ) -> None:
        """`outcomes` counts each request's outcome where this dispatcher ends it (a
        batch item's, a PROCESSING call's when its work ends); the request lifecycle
        counts the others. `on_internal_error()` counts a bug answered INTERNAL here
        rather than by the request lifecycle (a batch item's, a background call's).
        `shadow` sends routes' shadow shares (default: a ShadowTraffic with its
        default cap)."""
        self.state = state
        self.shadow = shadow if shadow is not None else ShadowTraffic(metrics.shadow)
        self._on_internal_error = on_internal_error
        self.results = results
        self._metrics = metrics
        self._outcomes = outcomes
        self._caller = RouteCaller(metrics, on_internal_error)
        # Looked up once per (route, model, code): a labels() call per request costs more.
        self._durations: dict[tuple[str, str, str], Histogram] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        # Calls that outlived their budget and still run, for GetResult.
        self._background: set[asyncio.Task[pb.ClassifyResponse]] = set()
        # Tasks that hold a place in the result store for a background call's outcome,
        # and those that store it there.
        self._holding: set[asyncio.Task[str | None]] = set()
        self._storing: set[asyncio.Task[None]] = set()
        # Time kept before a ClassifyBatch call's deadline to answer its late items.
        self._late_answers = LateAnswerAllowance()

    def replace(self, state: RoutingState) -> None:
        """Serve new calls from `state`; the old one closes once its calls are done."""
        old, self.state = self.state, state
        task = asyncio.get_running_loop().create_task(old.close_when_drained())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        await self.shadow.close()
        for work in self._background:
            work.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*self._holding, return_exceptions=True)
        await asyncio.gather(*self._storing, return_exceptions=True)
        await asyncio.gather(*self._retiring)
        await self.state.upstream.close()

    async def classify(
        self,
        request: pb.ClassifyRequest,
        ids: RequestContext,
        client_remaining: float | None,
        headers: Mapping[str, str],
        answer_due: float | None = None,
    ) -> pb.ClassifyResponse:
        """One call: routed, sent, retried, fallen back. `answer_due` (loop time): when a
        ClassifyBatch call answers its items, if sooner than `client_remaining`'s
        deadline less the margin; a route with a budget keeps the result then."""
        # Taken once: a reload during this call does not change the rules it follows.
        state = self.state
        with node(ROUTE_MATCH) as span:
            route = state.table.select(request_facts(request, ids, headers))
            span.set_attributes(
                {CLASSIFY_ROUTE: route.name, CLASSIFY_RULES_VERSION: state.table.rules_version}
            )
        request_trace = current_trace()
        if request_trace is not None:
            request_trace.log_fields["route"] = route.name
            started = request_trace.started
        else:
            started = time.perf_counter()
        deadline = None
        if client_remaining is not None:
            deadline = asyncio.get_running_loop().time() + client_remaining
            due = deadline - DEADLINE_SAFETY_MARGIN_SECONDS
            answer_due = due if answer_due is None else min(answer_due, due)
        call = UpstreamCall(state, route, request, ids, deadline)
        model, code = "", "OK"
        # Whether the caller was answered before the work ended (PROCESSING, or a
        # deadline with the result kept): the work's outcome is then counted when it
        # ends (_count_when_done), not this answer.
        answered_early = False
        # The routes version's channels stay open until the shadow call has entered it
        # too. The work's own hold (_run) is not enough on a route with a budget: the
        # work runs as a task of its own, ends some turns before this call resumes, and
        # an edit's drain closed the channels in between (the shadow call failed).
        state.enter()
        try:
            if route.budget_seconds is None:
                response = await self._run(call)
            else:
                response = await self._classify_within_budget(call, answer_due)
                answered_early = response.status == pb.RESULT_STATUS_PROCESSING
            model = response.model.name
            self.shadow.after_answer(state, route, request, response)
            return response
        except ServiceError as error:
            code = grpc_code_for(error).name
            answered_early = error.context.get(RESULT_KEPT) == "true"
            raise
        except asyncio.CancelledError as cancelled:
            # The client went away (CANCELLED), a batch item's answer is due before it has
            # one (DEADLINE_EXCEEDED, as it is answered: batch_items.answer_items_by), or
            # the server's grace ran out (UNAVAILABLE, SERVER_DRAINING as it is answered).
            code = cancelled_code(cancelled).name
            raise
        finally:
            state.leave()
            exemplar = exemplar_for(
                ids.trace_id,
                trace.get_current_span(),
                code,
                timed_out=request_trace is not None and request_trace.timed_out,
            )
            if answered_early:
                if request_trace is not None:
                    request_trace.outcome_counted_elsewhere = True
                if code == "OK":
                    # What its caller waited, apart from the answers: the latency
                    # objective reads code="OK", and a PROCESSING answer comes at
                    # the route's budget whatever the work then takes.
                    code = PROCESSING_CODE
            key = (route.name, model, code)
            duration = self._durations.get(key)
            if duration is None:
                duration = self._durations[key] = self._metrics.request_duration.labels(*key)
            duration.observe(time.perf_counter() - started, exemplar=exemplar)

    async def classify_batch(
        self,
        request: pb.ClassifyBatchRequest,
        ids: RequestContext,
        client_remaining: float | None,
        headers: Mapping[str, str],
    ) -> pb.ClassifyBatchResponse:
        """Every item as its own call, all at once; one result per item, in order."""
        self._metrics.batch_items.observe(len(request.items))
        refused = refuse_repeated_request_ids(request.items, current_batch_intake().refused)
        over_limit = sum(isinstance(refusal, RateLimited) for refusal in refused.values())
        if over_limit:
            tenant = current_caller().tenant
            self._metrics.rate_limited_items.labels(tenant).inc(over_limit)
        contexts = request.item_contexts
        call_trace = current_trace()
        if call_trace is not None:
            call_trace.outcome_counted_elsewhere = True  # one per item, not the call's
        answer = pb.ClassifyBatchResponse()
        results = [answer.results.add() for _ in request.items]
        due = None
        if client_remaining is not None:
            due = client_remaining - DEADLINE_SAFETY_MARGIN_SECONDS
            due -= self._late_answers.seconds_for(len(results))
            due = max(due, 0.0)
        loop = asyncio.get_running_loop()
        due_at = loop.time() + (due or 0.0)
        # Each item's answer is due with the call's: a route with a budget keeps its
        # result by then.
        classify = (
            self.classify if due is None else functools.partial(self.classify, answer_due=due_at)
        )
        items = asyncio.gather(
            *(
                classify_item(
                    results[index],
                    classify,
                    self._on_internal_error,
                    item,
                    contexts[index] if contexts else None,
                    refused.get(index),
                    ids,
                    client_remaining,
                    headers,
                    call_trace,
                    self._outcomes,
                    index,
                )
                for index, item in enumerate(request.items)
            )
        )
        # When this call is cancelled (its caller left, the server stopped), Python
        # 3.11's gather ends as an error nobody reads, and asyncio logs it as such.
        items.add_done_callback(_read_outcome)
        try:
            # Past `due`, the items not yet answered are cancelled, and each answers
            # DEADLINE_EXCEEDED as it is (batch_items.classify_item), so the call's
            # answer carries every item.
            if not await answer_items_by(items, due):
                # An item cancelled before its task first ran has no answer yet.
                answer_unstarted(results, request, ids, call_trace, self._outcomes, refused)
                self._late_answers.record(len(results), loop.time() - due_at)
        except asyncio.CancelledError as cancelled:
            if not is_cut_off(cancelled):
                raise  # the caller has gone: nobody reads an answer
            # The server's grace is over: the items answered keep their answers, and
            # each other one says SERVER_DRAINING, so the caller sends only those again
            # (answered whole, it sent every item again). Answered now, not cancelled.
            answer_unstarted(
                results, request, ids, call_trace, self._outcomes, refused, cut_off=True
            )
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
        request_trace = current_trace()
        if request_trace is not None:
            failed = sum(1 for result in results if result.HasField("error"))
            request_trace.log_fields.update(items=len(results), items_failed=failed)
        return answer

    async def _run(self, call: UpstreamCall) -> pb.ClassifyResponse:
        call.state.enter()
        try:
            return await self._caller.call_route(call)
        finally:
            call.state.leave()

    async def _classify_within_budget(
        self, call: UpstreamCall, answer_due: float | None
    ) -> pb.ClassifyResponse:
        """Wait for the answer up to the route's budget; past it, answer PROCESSING and keep
        the work going so GetResult can return its result. When the caller's answer is
        due first (`answer_due`, loop time: its deadline less the margin, or when its
        ClassifyBatch call is answered), answer DEADLINE_EXCEEDED with `result_kept`
        then instead.

        Either way the work's place in the result store is held before it is promised,
        and a hold may take up to the store's `hold_seconds` (a shared store's
        timeout). So when the caller's answer comes due first, the hold starts that
        long before it, while the work may still answer in time. (Started at the due
        time, a slow store took the caller past its deadline: a bare DEADLINE_EXCEEDED,
        no result kept, and the place left PROCESSING with nothing to fill it.)

        The upstream calls are not bound by the client's deadline here: the work is
        meant to outlive the wait, bounded by each backend's own timeout.
        """
        route, ids = call.route, call.ids
        assert route.budget_seconds is not None
        work = asyncio.create_task(self._run(dataclasses.replace(call, deadline=None)))
        self._background.add(work)
        work.add_done_callback(self._background.discard)
        loop = asyncio.get_running_loop()
        budget_ends = loop.time() + route.budget_seconds
        # Which answer comes first is the budget's and the caller's to say; the store's
        # time to hold a place only moves the hold earlier.
        due_first = answer_due is not None and answer_due < budget_ends
        answer_at = answer_due if answer_due is not None and due_first else budget_ends
        hold_at = budget_ends
        if answer_due is not None:
            hold_at = min(hold_at, answer_due - self.results.hold_seconds)
        pending = self._processing_response(route, ids)
        keeping: asyncio.Task[str | None] | None = None
        try:
            try:
                # shield: the client leaving (its deadline, a cancel) must not stop the work.
                return await asyncio.wait_for(
                    asyncio.shield(work), timeout=max(hold_at - loop.time(), 0)
                )
            except TimeoutError:
                keeping = self._keep_outcome(work, ids, pending)
            if answer_at > loop.time():
                try:  # the work may still answer in time (its outcome is then kept too)
                    return await asyncio.wait_for(
                        asyncio.shield(work), timeout=answer_at - loop.time()
                    )
                except TimeoutError:
                    pass
            token = await _held_by(keeping, answer_due)
        except asyncio.CancelledError as cancelled:
            if keeping is None:
                keeping = self._keep_outcome(work, ids, pending)
            if cancelled_code(cancelled) != grpc.StatusCode.DEADLINE_EXCEEDED:
                # The caller went, or the server stops: the work goes on, kept if it can.
                _drop_unless_kept(work, keeping)
                raise
            # A batch item whose call's answer is due (batch_items.answer_items_by) before
            # the route's budget and the item's own deadline margin ran out: as for a
            # single call whose deadline comes first, the work goes on, GetResult will
            # have its result, and the item says so. Cancelled, it said neither, and its
            # outcome was counted as a time-out whatever the work then did.
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            token = await _held_by(keeping, answer_due)
            if token is None:
                # Not held (the shared store down or slow): the item says only that its
                # call's answer came due.
                _drop_unless_kept(work, keeping)
                raise cancelled from None
            self._answered_before_the_work_ended(work, route)
            raise DeadlineExpired(
                "the deadline passed while the model was working; poll GetResult",
                request_id=ids.request_id,
                **{RESULT_KEPT: "true"},
            ) from None
        if token is None:
            if keeping.done():  # the store could not keep a place
                return await self._answer_unstored(work, call)
            _drop_unless_kept(work, keeping)
            raise DeadlineExpired(
                "the deadline passed while the model was working, before the result store "
                "kept a place for its result; send the call again",
                request_id=ids.request_id,
            )
        self._answered_before_the_work_ended(work, route)
        if due_first:
            # `result_kept`: the work goes on and GetResult will have its result, which
            # a client tells from a deadline that ended the work.
            raise DeadlineExpired(
                "the deadline passed while the model was working; poll GetResult",
                request_id=ids.request_id,
                **{RESULT_KEPT: "true"},
            )
        self._metrics.processing.labels(route.name).inc()
        return pending

    def _keep_outcome(
        self,
        work: asyncio.Task[pb.ClassifyResponse],
        ids: RequestContext,
        pending: pb.ClassifyResponse,
    ) -> asyncio.Task[str | None]:
        """Hold a place in the result store for `work`'s outcome, and once held, store
        the outcome there when the work ends; the task's result is the place's token
        (None: the store could not keep one)."""

        async def hold_then_store() -> str | None:
            try:
                token = await self.results.hold(ids.request_id, pending)
            except Exception:  # a bug: no place held, and said so once
                log.exception(
                    "holding a result's place failed", extra={"request_id": ids.request_id}
                )
                self._on_internal_error()
                return None
            if token is not None:
                self._store_when_done(work, ids, token)
            return token

        task = asyncio.get_running_loop().create_task(hold_then_store())
        self._holding.add(task)
        task.add_done_callback(self._holding.discard)
        return task

    def _answered_before_the_work_ended(
        self, work: asyncio.Task[pb.ClassifyResponse], route: Route
    ) -> None:
        """The caller is answered (PROCESSING, or its deadline with the result kept)
        while `work` goes on: its spans end later, and its outcome is counted then."""
        request_trace = current_trace()
        if request_trace is not None:
            # The work goes on: its spans end later, marked, and are still exported.
            request_trace.mark_timed_out()
        self._count_when_done(work, route)

    async def _answer_unstored(
        self, work: asyncio.Task[pb.ClassifyResponse], call: UpstreamCall
    ) -> pb.ClassifyResponse:
        """The result store could not keep a place (the shared store is down): nobody
        could poll a PROCESSING answer, so answer when the work is done, within the
        client's deadline; past it, DEADLINE_EXCEEDED and the work is dropped."""
        timeout = None
        if call.deadline is not None:
            loop_now = asyncio.get_running_loop().time()
            timeout = max(call.deadline - loop_now - DEADLINE_SAFETY_MARGIN_SECONDS, 0)
        try:
            return await asyncio.wait_for(asyncio.shield(work), timeout=timeout)
        except TimeoutError:
            work.cancel()
            raise DeadlineExpired(
                "the deadline passed while the model was working, and the result store "
                "is unavailable, so there is no result to poll",
                request_id=call.ids.request_id,
            ) from None
        except asyncio.CancelledError:
            work.cancel()  # the client left and no store would keep the result
            raise

    def _count_when_done(self, work: asyncio.Task[pb.ClassifyResponse], route: Route) -> None:
        """Once `work`, a call answered before it ended, ends: count its outcome, as any
        other request's is when answered. The early answer itself is not an outcome:
        counted as one, a route whose background work all failed looked healthy."""

        def count(_: asyncio.Task[pb.ClassifyResponse]) -> None:
            code, reason = "OK", ""
            if work.cancelled():  # the orchestrator stopped first (close())
                code, reason = "UNAVAILABLE", ServerDraining.reason
            else:
                error = work.exception()
                if isinstance(error, ServiceError):
                    code, reason = grpc_code_for(error).name, error.reason
                elif error is not None:
                    code, reason = "INTERNAL", InternalError.reason
            self._outcomes.count(route.name, code, reason)

        work.add_done_callback(count)

    def _processing_response(self, route: Route, ids: RequestContext) -> pb.ClassifyResponse:
        return pb.ClassifyResponse(
            request_id=ids.request_id,
            trace_id=ids.trace_id,
            status=pb.RESULT_STATUS_PROCESSING,
            route=route.name,
        )

    def _store_when_done(
        self, work: asyncio.Task[pb.ClassifyResponse], ids: RequestContext, token: str
    ) -> None:
        """Store the work's outcome for GetResult once it is done, in the place `token`
        holds, off the caller's path."""

        async def store() -> None:
            finish = functools.partial(self.results.finish, ids.request_id, token)
            await asyncio.wait([work])
            if work.cancelled():
                # The server stopped with the work unfinished (close()): the held
                # entry says so, or a shared store would answer PROCESSING on every
                # other orchestrator until it expired, with nothing running behind it.
                stopped = ServerDraining(
                    "the orchestrator running this call stopped before it finished; "
                    "send the call again",
                    result_trace_id=ids.trace_id,
                )
                await finish(error=stopped)
                return
            error = work.exception()
            if error is None:
                await finish(response=work.result())
            elif isinstance(error, ServiceError):
                # A poll is a call of its own, in a trace of its own: the error it is
                # answered with names the trace the failure happened in.
                failed = error.with_context(result_trace_id=ids.trace_id)
                await finish(error=failed)
            else:
                log.error("unhandled error", exc_info=error, extra={"request_id": ids.request_id})
                self._on_internal_error()
                await finish(error=internal_error(ids.request_id, ids.trace_id))

        task = asyncio.get_running_loop().create_task(store())
        self._storing.add(task)
        task.add_done_callback(self._storing.discard)


def _read_outcome(future: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as read, so that asyncio does not log it unread."""
    if not future.cancelled():
        future.exception()


async def _held_by(keeping: asyncio.Task[str | None], answer_due: float | None) -> str | None:
    """The token of the place `keeping` holds, once held; None when the store could not
    hold one, or had not by `answer_due` (loop time; None: no limit but the store's
    own timeout), give or take HOLD_GRACE_SECONDS."""
    timeout = None
    if answer_due is not None:
        timeout = max(answer_due - asyncio.get_running_loop().time(), 0) + HOLD_GRACE_SECONDS
    done, _ = await asyncio.wait((keeping,), timeout=timeout)
    return keeping.result() if done else None


def _drop_unless_kept(
    work: asyncio.Task[pb.ClassifyResponse], keeping: asyncio.Task[str | None]
) -> None:
    """Cancel `work` once `keeping` ends without a place held for its outcome: nobody
    waits for it then, and nobody could poll it."""

    def drop(_: asyncio.Task[str | None]) -> None:
        # hold_then_store answers a failed hold None; cancelled, the orchestrator stops.
        if keeping.cancelled() or keeping.result() is None:
            work.cancel()

    keeping.add_done_callback(drop)

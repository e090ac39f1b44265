"""One call's way through its route's backends: the primary under its retry policy,
then the fallbacks in order.

`UpstreamCall` is the per-call value (route, request, IDs, deadline, attempt and
the reasons for the next attempt); `RouteCaller` runs it. Whether a failed
attempt is tried again is `RetryPolicy.decide`'s answer (orchestrator.policy);
this module only acts on it and counts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.context import RequestContext
from classify_common.errors import (
    ConcurrencyLimited,
    DeadlineUnreachable,
    InternalError,
    ServiceError,
    UnreadableText,
    is_fallback_eligible,
    is_routine_refusal,
)
from classify_common.nodes import (
    BACKEND_SELECT,
    CLASSIFY_ATTEMPT,
    CLASSIFY_BACKEND,
    CLASSIFY_FALLBACK_REASON,
    CLASSIFY_MODEL,
    CLASSIFY_MODEL_VERSION,
    CLASSIFY_REPLICA,
    CLASSIFY_RETRY_REASON,
    CLASSIFY_SENT,
    UPSTREAM_CALL,
    current_trace,
    emit_node,
    node,
)
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.policy import GiveUp, RetryAfter, RetryBudget
from orchestrator.routing import Backend, Route, RouteTable
from orchestrator.upstream import UpstreamPools
from orchestrator.upstream.pool import BackendPool

log = logging.getLogger(__name__)


class RoutingState:
    """One version of routes.yaml and what it needs to serve: channels, retry budget.

    Calls count themselves in and out, so a replaced state closes its channels
    only after the calls that started on it have finished.
    """

    def __init__(
        self,
        table: RouteTable,
        upstream: UpstreamPools,
        *,
        carried_from: RoutingState | None = None,
    ) -> None:
        """`carried_from`: the state of the routes in force, when this one replaces it.
        Its retry budget carries on if `table` sets the budget as before: the budget
        counts the orchestrator's traffic, not one version of the file's, and an edit
        made during a retry storm (even a comment) must not hand out a fresh window of
        retries. Calls still running on the old state spend from the same budget."""
        self.table = table
        self.upstream = upstream
        self.retry_budget: RetryBudget
        if carried_from is not None and carried_from.retry_budget.settings == table.retry_budget:
            self.retry_budget = carried_from.retry_budget
        else:
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
        # Checked again on waking: a call that entered in the turn the last one left
        # (a shadow call, entered as its primary's answer returns) has cleared the
        # event, and the channels closed under it.
        while self.in_flight:
            await self._drained.wait()
        await self.upstream.close()


@dataclass
class UpstreamCall:
    """One call to a route: what it asks, under which IDs and deadline, and how far it has come."""

    # The routes version the call follows, taken once: a reload does not change its rules.
    state: RoutingState
    route: Route
    request: pb.ClassifyRequest
    ids: RequestContext
    # Event-loop time by which the caller wants its answer; None: it set no deadline.
    deadline: float | None
    # Attempts across all the route's backends, numbered from 1 for traces and logs.
    attempts: int = 0
    # Why the next attempt happens: the failure retried, or the one that sent it on.
    retry_reason: str = ""
    fallback_reason: str = ""

    def time_left(self) -> float | None:
        """Seconds until the deadline, None without one."""
        if self.deadline is None:
            return None
        return self.deadline - asyncio.get_running_loop().time()

    def forwarded_to(self, backend: Backend) -> pb.ClassifyRequest:
        """The request as `backend` gets it: its one model, and our request ID, which the
        capability server logs under."""
        forwarded = pb.ClassifyRequest()
        forwarded.CopyFrom(self.request)
        forwarded.model = backend.model
        forwarded.request_id = self.ids.request_id
        return forwarded


class RouteCaller:
    """Runs UpstreamCalls: attempts, retries and fallbacks, with their metrics."""

    def __init__(
        self, metrics: OrchestratorMetrics, on_internal_error: Callable[[], None] = lambda: None
    ) -> None:
        """`on_internal_error()` counts a call answered INTERNAL because a backend
        answered a code the orchestrator does not expect (orchestrator.upstream.errors):
        a fault of the deployment, such as a wrong internal token, that no exception of
        ours raised, so the request lifecycle does not count it as it counts a bug."""
        self._metrics = metrics
        self._on_internal_error = on_internal_error

    async def call_route(self, call: UpstreamCall) -> pb.ClassifyResponse:
        """The answer of the first backend that gives one; otherwise the last failure of
        a backend the call reached, or else the last refusal. Client errors are raised
        at once, never sent to a fallback, except a text the model cannot read
        (UnreadableText), which another model's vocabulary may."""
        route = call.route
        call.state.retry_budget.record_request()
        failure: ServiceError | None = None
        failed_on = route.backend
        # How the primary failed: what a fallback's answer is counted under (the failure
        # the caller would hear may be a later backend's).
        primary_failure: ServiceError | None = None
        for backend in route.backends:
            try:
                response = await self._call_backend(call, backend)
            except ServiceError as error:
                if not is_fallback_eligible(error):
                    self._fail(call, backend, error)
                    raise
                if primary_failure is None:
                    primary_failure = error
                if _tells_more(error, failure):
                    failure, failed_on = error, backend
                call.fallback_reason = error.reason
                log.log(
                    logging.DEBUG if is_routine_refusal(error) else logging.INFO,
                    "backend failed",
                    extra={"route": route.name, "backend": backend.name, "reason": error.reason},
                )
                continue
            if backend is not route.backend:
                assert primary_failure is not None
                self._metrics.fallbacks.labels(
                    route.name, route.backend.name, backend.name, primary_failure.reason
                ).inc()
            return self._complete(call, backend, response)
        assert failure is not None, "a route has at least one backend"
        self._fail(call, failed_on, failure)
        raise failure

    def _fail(self, call: UpstreamCall, backend: Backend, error: ServiceError) -> None:
        """What a call that fails with `error` from `backend` leaves behind: the backend,
        the model it was bound for and the attempts in its log line (as an answered
        call's), and the count of an INTERNAL answer that no exception of ours raised."""
        request_trace = current_trace()
        if request_trace is not None:
            request_trace.log_fields.update(
                backend=backend.name, model=backend.model, attempts=call.attempts
            )
        if isinstance(error, InternalError):
            self._on_internal_error()

    def _complete(
        self, call: UpstreamCall, backend: Backend, response: pb.ClassifyResponse
    ) -> pb.ClassifyResponse:
        response.request_id = call.ids.request_id
        response.trace_id = call.ids.trace_id
        response.route = call.route.name
        response.status = pb.RESULT_STATUS_DONE
        response.fallback = backend is not call.route.backend
        request_trace = current_trace()
        if request_trace is not None:
            request_trace.log_fields.update(
                backend=backend.name,
                model=response.model.name,
                model_version=response.model.version,
                attempts=call.attempts,
                fallback=response.fallback,
            )
        return response

    async def _call_backend(self, call: UpstreamCall, backend: Backend) -> pb.ClassifyResponse:
        """Attempts on one backend, each on a replica not yet tried, under the route's
        retry policy."""
        route = call.route
        pool = call.state.upstream.pool(backend)
        forwarded = call.forwarded_to(backend)
        tried: set[str] = set()
        attempt_on_backend = 1
        while True:
            call.attempts += 1
            try:
                return await self._attempt(call, pool, tried, forwarded)
            except ServiceError as error:
                decision = route.retry.decide(
                    error,
                    attempt_on_backend,
                    call.time_left(),
                    call.state.retry_budget,
                    untried_replica=pool.has_untried(tried),
                )
                if decision is GiveUp.BUDGET_EXHAUSTED:
                    self._metrics.retry_budget_exhausted.labels(route.name, backend.name).inc()
                if not isinstance(decision, RetryAfter):
                    # The next attempt, if any, is a fallback: it has a fallback reason,
                    # not this one as a retry reason.
                    call.retry_reason = ""
                    raise
                call.retry_reason, call.fallback_reason = error.reason, ""
                self._metrics.retries.labels(route.name, backend.name, error.reason).inc()
                await asyncio.sleep(decision.seconds)
                attempt_on_backend += 1

    async def _attempt(
        self,
        call: UpstreamCall,
        pool: BackendPool,
        tried: set[str],
        forwarded: pb.ClassifyRequest,
    ) -> pb.ClassifyResponse:
        """One call to a replica not yet tried, as the `upstream_call` node; its
        `backend_select` node is recorded once the answer names the model version.

        The node's client span, the child the capability's spans hang under, is the
        replica's coalescer's to start when the call leaves: a call refused before it
        is sent (at the backend's limit, short of time), or out of time while it
        gathers, never reached the capability, and a client span would say it did.
        The node starts as not sent (CLASSIFY_SENT) and the coalescer marks it sent."""
        backend = pool.backend
        select_started = time.time_ns()
        target = pool.pick(avoid=tried, time_left=call.time_left())
        selected = time.time_ns()
        tried.add(target)
        remaining = call.time_left()
        version = ""
        reasons = {
            CLASSIFY_RETRY_REASON: call.retry_reason,
            CLASSIFY_FALLBACK_REASON: call.fallback_reason,
        }
        try:
            with node(
                UPSTREAM_CALL,
                {
                    CLASSIFY_ATTEMPT: call.attempts,
                    CLASSIFY_BACKEND: backend.name,
                    CLASSIFY_SENT: False,
                    **{key: value for key, value in reasons.items() if value},
                },
                current=True,
            ):
                response = await pool.classify(forwarded, target=target, client_remaining=remaining)
                version = response.model.version
                return response
        finally:
            request_trace = current_trace()
            if request_trace is not None:
                emit_node(
                    request_trace,
                    BACKEND_SELECT,
                    select_started,
                    selected,
                    {
                        CLASSIFY_BACKEND: backend.name,
                        CLASSIFY_REPLICA: target,
                        CLASSIFY_MODEL: backend.model,
                        CLASSIFY_MODEL_VERSION: version,
                    },
                )


def _tells_more(error: ServiceError, failure: ServiceError | None) -> bool:
    """Whether a later backend's `error` is what the caller should hear rather than an
    earlier backend's `failure`.

    A backend that refused the call before any work (it could not make the deadline,
    or was at its limit) says less than the failure before it: with the primary down,
    the caller is told UNAVAILABLE, not DEADLINE_EXCEEDED with ten seconds left on its
    deadline. A backend whose model cannot read the text says less than any other
    failure, before or after it: the other backend, back or less busy, may read it, and
    INVALID_ARGUMENT would tell the caller never to try again."""
    if failure is None:
        return True
    if isinstance(error, UnreadableText):
        return False
    if isinstance(failure, UnreadableText):
        return True
    return not _refused_here(error) or _refused_here(failure)


def _refused_here(error: ServiceError) -> bool:
    """Whether a backend turned the call away before any work was spent on it."""
    return isinstance(error, DeadlineUnreachable | ConcurrencyLimited)

"""The orchestrator's domain step: pick the route, call its backends, complete the answer.

A call tries the route's primary backend with its retry policy: a retryable
failure is tried again on another replica after a jittered backoff, within the
attempt limit and the caller's deadline. When the backend still fails with a
model error or overload, the route's fallback backends are tried in order, and
the answer says `fallback=true`. Client errors are returned at once, never
retried or sent elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.context import RequestContext
from classify_common.errors import FALLBACK_ELIGIBLE_CODES, ServiceError, grpc_code_for
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.policy import RetryBudget, backoff_seconds
from orchestrator.routing import Backend, RequestFacts, Route, RouteTable
from orchestrator.upstream import UpstreamPools

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


class Dispatcher:
    def __init__(self, state: RoutingState, metrics: OrchestratorMetrics) -> None:
        self.state = state
        self._metrics = metrics
        self._retiring: set[asyncio.Task[None]] = set()

    def replace(self, state: RoutingState) -> None:
        """Serve new calls from `state`; the old one closes once its calls are done."""
        old, self.state = self.state, state
        task = asyncio.get_running_loop().create_task(old.close_when_drained())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
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
        state.enter()
        try:
            route = state.table.select(request_facts(request, ids, headers))
            return await self._classify(state, route, request, ids, client_remaining)
        finally:
            state.leave()

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
        for backend in route.backends:
            try:
                response = await self._call_backend(state, route, backend, request, ids, deadline)
            except ServiceError as error:
                if grpc_code_for(error) not in FALLBACK_ELIGIBLE_CODES:
                    raise
                failure = error
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
            target = pool.pick(avoid=tried)
            tried.add(target)
            remaining = None if deadline is None else deadline - loop.time()
            try:
                return await pool.classify(
                    forwarded, target=target, request_id=ids.request_id, client_remaining=remaining
                )
            except ServiceError as error:
                code = grpc_code_for(error)
                if attempt >= route.retry.max_attempts or not route.retry.retries(code):
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

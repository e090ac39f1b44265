"""Shadow traffic: a share of a route's answered calls also goes to its shadow backend.

A route in routes.yaml may name `shadow: {backend: NAME, percent: N}`. Once the
primary backend has answered a call (not a fallback, not PROCESSING), and when
the call's request ID falls in the N% share (a hash of the ID, so the same
request is always shadowed or never), the same request goes to the shadow
backend in a task of its own. The caller already has its answer: the shadow
call never delays it, and nothing the shadow does can fail it.

What the shadow call finds is counted, never returned:
`classify_shadow_comparisons_total{route,primary,shadow,outcome}` with outcome
`agree` (same top label), `disagree` or `error` (the shadow call failed), and
the largest score difference of any label both answers carry in
`classify_shadow_score_difference`. A disagreement is logged with the request
ID, which the capability servers' log lines for both calls carry too, and the
trace ID of the primary call.

Shadow calls are bounded: at most `max_in_flight` at once in the process; a
call that would exceed it is not made and is counted in
`classify_shadow_dropped_total{route}`. A shadow call makes one attempt on one
replica, within its backend's timeout, with no retry and no fallback. The shadow
backend may serve routes of its own, whose callers a shadow call must not turn
away or hold up: it takes no slot under the backend's `max_concurrency` or
adaptive limit, and goes at batch priority (those callers' calls leave beside
it and are computed first). It runs in
an empty context, so it joins no caller's trace and adds nothing to the caller's
lifecycle nodes or access-log line; the capability server traces it on its own.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.context import RequestContext, bind_request
from classify_common.errors import ServiceError
from orchestrator.calls import RoutingState
from orchestrator.metrics import ShadowMetrics
from orchestrator.routing import Route
from orchestrator.security.gate import context_of_caller, current_caller

log = logging.getLogger(__name__)

AGREE = "agree"
DISAGREE = "disagree"
ERROR = "error"
# Shadow calls in flight at most, by default (the --shadow-max-in-flight flag).
DEFAULT_MAX_IN_FLIGHT = 64

Scores = tuple[tuple[str, float], ...]  # (label, score), highest score first


@dataclass(frozen=True)
class Comparison:
    """How a shadow answer compares with the primary one."""

    agrees: bool  # the same top label
    # Largest |score difference| over the labels both answers carry; None when they
    # share none (top_k answers that disagree).
    largest_difference: float | None


def answer_scores(answer: pb.ClassifyResponse) -> Scores:
    return tuple((label.name, label.score) for label in answer.labels)


def compare(primary: Scores, shadow: Scores) -> Comparison:
    shadow_scores = dict(shadow)
    differences = [
        abs(score - shadow_scores[name]) for name, score in primary if name in shadow_scores
    ]
    top_primary = primary[0][0] if primary else ""
    top_shadow = shadow[0][0] if shadow else ""
    return Comparison(
        agrees=top_primary == top_shadow,
        largest_difference=max(differences) if differences else None,
    )


class ShadowTraffic:
    """Sends the shadowed share of answered calls to their route's shadow backend and
    counts what comes back; owns the shadow tasks."""

    def __init__(self, metrics: ShadowMetrics, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT):
        self._metrics = metrics
        self._max_in_flight = max_in_flight
        self._in_flight: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def after_answer(
        self,
        state: RoutingState,
        route: Route,
        request: pb.ClassifyRequest,
        answer: pb.ClassifyResponse,
    ) -> None:
        """Start a shadow call for `answer` if its route shadows this request; returns at
        once, never raises for the shadow's sake."""
        shadow = route.shadow
        if (
            shadow is None
            or answer.fallback
            or answer.status != pb.RESULT_STATUS_DONE
            or not shadow.takes(answer.request_id)
        ):
            return
        if len(self._in_flight) >= self._max_in_flight:
            self._metrics.dropped.labels(route.name).inc()
            return
        forwarded = pb.ClassifyRequest()
        forwarded.CopyFrom(request)
        forwarded.model = shadow.backend.model
        forwarded.request_id = answer.request_id
        # The routes version's channels stay open until the shadow task is done, however
        # it ends: a task cancelled before it ever ran leaves through the callback too.
        state.enter()
        # NOTE: a context holding only the caller and the request's IDs: its trace and
        # request-scoped state (its nodes, its log line) must not see the shadow call;
        # the shadow's result-cache scope is the caller's tenant's (in an empty
        # context every tenant's shadow calls were cached under the anonymous caller's
        # scope, answered to a tenant named "anonymous" as its own); and its log lines
        # carry the request's IDs (a failed shadow call's line carried neither).
        context = context_of_caller(current_caller())
        context.run(bind_request, RequestContext(answer.request_id, answer.trace_id))
        task = asyncio.get_running_loop().create_task(
            self._compare(
                state, route, forwarded, answer.trace_id, answer_scores(answer), answer.model.name
            ),
            context=context,
        )
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        task.add_done_callback(lambda _: state.leave())

    async def _compare(
        self,
        state: RoutingState,
        route: Route,
        request: pb.ClassifyRequest,
        trace_id: str,
        primary: Scores,
        primary_model: str,
    ) -> None:
        """Send `request` to the shadow and compare its answer with the primary call's
        (in trace `trace_id`, `primary` scores from `primary_model`)."""
        assert route.shadow is not None
        backend = route.shadow.backend
        labels = (route.name, route.backend.name, backend.name)
        # At batch priority: interactive callers of the shadow backend's own routes go
        # first at the capability, and their calls leave beside the shadow's instead of
        # gathering behind it (orchestrator.upstream.coalescer).
        low = pb.ClassifyRequest()
        low.CopyFrom(request)
        low.priority = pb.PRIORITY_BATCH
        try:
            pool = state.upstream.pool(backend)
            answer = await pool.classify(
                low, target=pool.pick(), client_remaining=None, shadow=True
            )
        except ServiceError:
            self._metrics.comparisons.labels(*labels, ERROR).inc()
            return
        except Exception:
            # A shadow is never worth failing over: count it, keep the traceback.
            log.exception("shadow call failed unexpectedly")
            self._metrics.comparisons.labels(*labels, ERROR).inc()
            return
        shadow = answer_scores(answer)
        comparison = compare(primary, shadow)
        self._metrics.comparisons.labels(*labels, AGREE if comparison.agrees else DISAGREE).inc()
        if comparison.largest_difference is not None:
            self._metrics.score_difference.labels(*labels).observe(comparison.largest_difference)
        if not comparison.agrees:
            log.warning(
                "shadow disagreement",
                extra={
                    "route": route.name,
                    "primary": route.backend.name,
                    "primary_model": primary_model,
                    "primary_label": primary[0][0] if primary else "",
                    "shadow": backend.name,
                    "shadow_model": answer.model.name,
                    "shadow_label": shadow[0][0] if shadow else "",
                },
            )

    async def close(self) -> None:
        """Cancel the shadow calls still in flight (the server is stopping)."""
        for task in self._in_flight:
            task.cancel()
        await asyncio.gather(*self._in_flight, return_exceptions=True)

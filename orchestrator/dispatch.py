"""The orchestrator's domain step: pick the route, call its backend, complete the answer."""

from __future__ import annotations

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.context import RequestContext
from orchestrator.routing import RouteTable
from orchestrator.upstream import UpstreamPools


class Dispatcher:
    def __init__(self, routes: RouteTable, upstream: UpstreamPools) -> None:
        self._routes = routes
        self._upstream = upstream

    async def classify(
        self, request: pb.ClassifyRequest, ids: RequestContext, client_remaining: float | None
    ) -> pb.ClassifyResponse:
        route = self._routes.select()
        forwarded = pb.ClassifyRequest()
        forwarded.CopyFrom(request)
        # The capability server logs under the same ID as the orchestrator.
        forwarded.request_id = ids.request_id
        response = await self._upstream.pool(route.backend).classify(
            forwarded, request_id=ids.request_id, client_remaining=client_remaining
        )
        response.request_id = ids.request_id
        response.trace_id = ids.trace_id
        response.route = route.name
        response.status = pb.RESULT_STATUS_DONE
        response.fallback = False
        return response

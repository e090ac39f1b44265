"""Thin servicer for the public ClassifyService.

Validation, request IDs, tracing and error statuses happen around these
methods in classify_common.interceptor; routing and upstream calls in Dispatcher.
"""

from __future__ import annotations

from typing import Any

import grpc

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from classify_common.context import current_request
from orchestrator.dispatch import Dispatcher
from orchestrator.security.gate import ANONYMOUS, TENANT_HEADER, current_caller

Context = grpc.aio.ServicerContext[Any, Any]


class ClassifyServicer(pb_grpc.ClassifyServiceServicer):
    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        ids = current_request()
        assert ids is not None, "the lifecycle interceptor binds every contract call"
        headers = {
            key.lower(): value
            for key, value in context.invocation_metadata() or ()
            if isinstance(value, str)
        }
        # The authenticated tenant, not what the client claims, is what routes see.
        caller = current_caller()
        if caller is not ANONYMOUS:
            headers[TENANT_HEADER] = caller.tenant
        return await self._dispatcher.classify(request, ids, context.time_remaining(), headers)

    async def GetResult(
        self, request: pb.GetResultRequest, context: Context
    ) -> pb.ClassifyResponse:
        return self._dispatcher.results.get(request.request_id)

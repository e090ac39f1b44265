"""Thin servicer for the public ClassifyService.

Validation, request IDs, tracing and error statuses happen around these
methods in classify_common.interceptor; routing and upstream calls in Dispatcher.
"""

from __future__ import annotations

from typing import Any

import grpc

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from ai.classify.v1 import model_service_pb2_grpc as model_pb_grpc
from classify_common.context import current_request
from orchestrator.dispatch import Dispatcher
from orchestrator.fleet import FleetModels
from orchestrator.security.gate import ANONYMOUS, TENANT_HEADER, current_caller

Context = grpc.aio.ServicerContext[Any, Any]


class ModelServicer(model_pb_grpc.ModelServiceServicer):
    """The fleet's models; reloading needs the admin role (see orchestrator.fleet)."""

    def __init__(self, fleet: FleetModels) -> None:
        self._fleet = fleet

    async def ListModels(
        self, request: model_pb.ListModelsRequest, context: Context
    ) -> model_pb.ListModelsResponse:
        return await self._fleet.list_models(request)

    async def GetModel(
        self, request: model_pb.GetModelRequest, context: Context
    ) -> model_pb.GetModelResponse:
        return await self._fleet.get_model(request)

    async def ReloadModel(
        self, request: model_pb.ReloadModelRequest, context: Context
    ) -> model_pb.ReloadModelResponse:
        return await self._fleet.reload_model(request)


def route_headers(context: Context) -> dict[str, str]:
    """The call's metadata as routes match on it (lower-case keys), with the
    authenticated tenant, not what the client claims, as `x-tenant`."""
    headers = {
        key.lower(): value
        for key, value in context.invocation_metadata() or ()
        if isinstance(value, str)
    }
    caller = current_caller()
    if caller is not ANONYMOUS:
        headers[TENANT_HEADER] = caller.tenant
    return headers


class ClassifyServicer(pb_grpc.ClassifyServiceServicer):
    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        ids = current_request()
        assert ids is not None, "the lifecycle interceptor binds every contract call"
        return await self._dispatcher.classify(
            request, ids, context.time_remaining(), route_headers(context)
        )

    async def ClassifyBatch(
        self, request: pb.ClassifyBatchRequest, context: Context
    ) -> pb.ClassifyBatchResponse:
        ids = current_request()
        assert ids is not None, "the lifecycle interceptor binds every contract call"
        return await self._dispatcher.classify_batch(
            request, ids, context.time_remaining(), route_headers(context)
        )

    async def GetResult(
        self, request: pb.GetResultRequest, context: Context
    ) -> pb.ClassifyResponse:
        return await self._dispatcher.results.get(request.request_id)

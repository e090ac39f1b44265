"""Thin servicers: protobuf in, one engine call, protobuf out.

Validation, request IDs, tracing and error statuses are handled around these
methods by classify_common.interceptor.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from ai.classify.v1 import (
    classify_service_pb2 as pb,
)
from ai.classify.v1 import (
    classify_service_pb2_grpc as pb_grpc,
)
from ai.classify.v1 import (
    model_service_pb2 as model_pb,
)
from ai.classify.v1 import (
    model_service_pb2_grpc as model_pb_grpc,
)
from capability.inference import InferenceEngine, ServedModel
from classify_common.context import current_request
from classify_common.errors import MethodNotServed

Context = grpc.aio.ServicerContext[Any, Any]


class ClassifyServicer(pb_grpc.ClassifyServiceServicer):
    def __init__(self, engine: InferenceEngine) -> None:
        self._engine = engine

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        max_length = request.max_length if request.HasField("max_length") else None
        result = await self._engine.classify(request.text, max_length)
        scores = result.scores[: request.top_k] if request.HasField("top_k") else result.scores
        ids = current_request()
        return pb.ClassifyResponse(
            labels=[pb.Label(name=name, score=score) for name, score in scores],
            confidence=result.scores[0][1],
            model=pb.ModelRef(name=result.model.name, version=result.model.version),
            request_id=ids.request_id if ids else request.request_id,
            trace_id=ids.trace_id if ids else "",
            status=pb.RESULT_STATUS_DONE,
        )

    async def GetResult(
        self, request: pb.GetResultRequest, context: Context
    ) -> pb.ClassifyResponse:
        # Results that outlive a time budget are kept by the orchestrator, not here.
        raise MethodNotServed(
            "GetResult is served by the orchestrator; capability servers keep no results",
            request_id=request.request_id,
        )


def describe(model: ServedModel, device: str) -> model_pb.ModelInfo:
    loaded_at = timestamp_pb2.Timestamp()
    loaded_at.FromDatetime(model.loaded_at)
    load_duration = duration_pb2.Duration()
    load_duration.FromNanoseconds(int(model.load_seconds * 1e9))
    return model_pb.ModelInfo(
        name=model.name,
        version=model.version,
        state=model_pb.MODEL_STATE_READY,
        labels=[
            model_pb.ModelLabel(name=label.name, description=label.description)
            for label in model.labels
        ],
        max_sequence_length=model.classifier.max_seq_length,
        devices=[device],
        source=str(model.source),
        loaded_at=loaded_at,
        load_duration=load_duration,
    )


class ModelServicer(model_pb_grpc.ModelServiceServicer):
    def __init__(self, engine: InferenceEngine) -> None:
        self._engine = engine

    async def ListModels(
        self, request: model_pb.ListModelsRequest, context: Context
    ) -> model_pb.ListModelsResponse:
        served = self._engine.served
        if served is None:
            info = model_pb.ModelInfo(
                name=self._engine.model_name,
                state=model_pb.MODEL_STATE_LOADING,
                devices=[str(self._engine.device)],
                source=str(self._engine.source),
            )
        else:
            info = describe(served, str(self._engine.device))
        return model_pb.ListModelsResponse(models=[info])

    async def GetModel(
        self, request: model_pb.GetModelRequest, context: Context
    ) -> model_pb.GetModelResponse:
        served = self._engine.model(request.name)
        return model_pb.GetModelResponse(model=describe(served, str(self._engine.device)))

    async def ReloadModel(
        self, request: model_pb.ReloadModelRequest, context: Context
    ) -> model_pb.ReloadModelResponse:
        served, previous_version = await self._engine.reload(request.name)
        return model_pb.ReloadModelResponse(
            model=describe(served, str(self._engine.device)), previous_version=previous_version
        )

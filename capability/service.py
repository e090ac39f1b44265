"""Thin servicers: protobuf in, one domain call, protobuf out.

Validation, request IDs, tracing and error statuses are handled around these
methods by classify_common.interceptor.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from ai.classify.v1 import model_service_pb2_grpc as model_pb_grpc
from capability.batching import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from capability.bundle import LoadedBundle
from capability.lifecycle import ModelLifecycle
from capability.workers import WorkerPool
from classify_common.context import current_request
from classify_common.errors import MethodNotServed

Context = grpc.aio.ServicerContext[Any, Any]


class ClassifyServicer(pb_grpc.ClassifyServiceServicer):
    def __init__(self, pool: WorkerPool, default_model: str) -> None:
        self._pool = pool
        self._default_model = default_model

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        ids = current_request()
        assert ids is not None, "the lifecycle interceptor binds every contract call"
        remaining = context.time_remaining()
        result = await self._pool.classify(
            request.model or self._default_model,
            request.text,
            max_length=request.max_length if request.HasField("max_length") else None,
            priority=PRIORITY_BATCH
            if request.priority == pb.PRIORITY_BATCH
            else PRIORITY_INTERACTIVE,
            request_id=ids.request_id,
            deadline=None if remaining is None else asyncio.get_running_loop().time() + remaining,
        )
        names = (label.name for label in result.bundle.classifier.labels)
        ranked = sorted(
            zip(names, result.probabilities, strict=True), key=lambda p: p[1], reverse=True
        )
        if request.HasField("top_k"):
            ranked = ranked[: request.top_k]
        return pb.ClassifyResponse(
            labels=[pb.Label(name=name, score=score) for name, score in ranked],
            confidence=ranked[0][1],
            model=pb.ModelRef(name=result.bundle.name, version=result.bundle.version),
            request_id=ids.request_id,
            trace_id=ids.trace_id,
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


def describe(bundle: LoadedBundle, pool: WorkerPool) -> model_pb.ModelInfo:
    loaded_at = timestamp_pb2.Timestamp()
    loaded_at.FromDatetime(pool.live_since(bundle.name))
    load_duration = duration_pb2.Duration()
    load_duration.FromNanoseconds(int(bundle.load_seconds * 1e9))
    classifier = bundle.classifier
    return model_pb.ModelInfo(
        name=bundle.name,
        version=bundle.version,
        state=model_pb.MODEL_STATE_READY,
        labels=[
            model_pb.ModelLabel(name=label.name, description=label.description)
            for label in classifier.labels
        ],
        max_sequence_length=classifier.max_seq_length,
        devices=[worker.name for worker in pool.workers],
        source=str(bundle.directory),
        loaded_at=loaded_at,
        load_duration=load_duration,
        precision=bundle.precision,
        memory_bytes=bundle.memory_bytes,
        digest=bundle.digest,
        architecture=bundle.architecture,
    )


class ModelServicer(model_pb_grpc.ModelServiceServicer):
    def __init__(self, pool: WorkerPool, lifecycle: ModelLifecycle) -> None:
        self._pool = pool
        self._lifecycle = lifecycle

    async def ListModels(
        self, request: model_pb.ListModelsRequest, context: Context
    ) -> model_pb.ListModelsResponse:
        return model_pb.ListModelsResponse(
            models=[describe(bundle, self._pool) for bundle in self._pool.models().values()]
        )

    async def GetModel(
        self, request: model_pb.GetModelRequest, context: Context
    ) -> model_pb.GetModelResponse:
        return model_pb.GetModelResponse(
            model=describe(self._pool.serving(request.name), self._pool)
        )

    async def ReloadModel(
        self, request: model_pb.ReloadModelRequest, context: Context
    ) -> model_pb.ReloadModelResponse:
        bundle, previous = await self._lifecycle.reload(request.name, request.version or None)
        return model_pb.ReloadModelResponse(
            model=describe(bundle, self._pool), previous_version=previous
        )

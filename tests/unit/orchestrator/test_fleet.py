"""The front door's ModelService over replicas that do not agree: a fleet split between
versions shows in ListModels, and GetModel describes the version most replicas serve."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ai.classify.v1 import model_service_pb2 as model_pb
from ai.classify.v1 import model_service_pb2_grpc
from capability.server import CapabilityServer
from tests.conftest import StartCapability, StartOrchestrator, closed_port, wait_until
from tests.unit.orchestrator.test_reload import (
    applied_reloads,
    replace_file,
    watching_orchestrator,
)

MODEL = "topic-static"


def model_root_with(model_root: Path, root: Path, versions: tuple[str, ...]) -> Path:
    """A model root holding `versions` of topic-static, each a copy of the session's 1."""
    for version in versions:
        shutil.copytree(model_root / MODEL / "1", root / MODEL / version)
    return root


def fleet_routes(replicas: list[CapabilityServer]) -> str:
    targets = ", ".join(f'"127.0.0.1:{replica.port}"' for replica in replicas)
    return (
        "version: 1\n"
        "backends:\n"
        f"  static: {{model: {MODEL}, targets: [{targets}]}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: static\n"
    )


async def test_a_fleet_split_between_versions_shows_at_the_front_door(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    orchestrator_with: StartOrchestrator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three replicas, the first asked serving version 2 (as after a fleet reload the
    others refused), the other two version 1 (the same bundle)."""
    newer = model_root_with(model_root, tmp_path / "newer", ("1", "2"))
    older = model_root_with(model_root, tmp_path / "older", ("1",))
    replicas = [
        await start_capability(model_root=newer, models=(MODEL,)),
        await start_capability(model_root=older, models=(MODEL,)),
        await start_capability(model_root=older, models=(MODEL,)),
    ]
    orchestrator = await orchestrator_with(fleet_routes(replicas))

    with caplog.at_level(logging.WARNING, logger="orchestrator.fleet"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            models = model_service_pb2_grpc.ModelServiceStub(channel)
            listed = await models.ListModels(model_pb.ListModelsRequest())
            described = await models.GetModel(model_pb.GetModelRequest(name=MODEL))

    # Once per version served, the version most replicas serve first.
    assert [(m.name, m.version) for m in listed.models] == [(MODEL, "1"), (MODEL, "2")]
    assert described.model.version == "1"
    [split] = [r for r in caplog.records if r.getMessage().startswith("replicas serve different")]
    digest = described.model.digest[:12]
    assert getattr(split, "served", None) == f"1 ({digest}) on 2, 2 ({digest}) on 1"
    # The split is in the answer too, for whoever rolls the fleet forward.
    ready = model_pb.MODEL_STATE_READY
    assert [(v.version, v.digest, v.state, v.replicas) for v in described.served_versions] == [
        ("1", described.model.digest, ready, 2),
        ("2", described.model.digest, ready, 1),
    ]
    assert (described.replicas_asked, described.replicas_answered) == (3, 3)


async def test_replicas_that_agree_are_one_model_at_the_front_door(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    orchestrator_with: StartOrchestrator,
) -> None:
    root = model_root_with(model_root, tmp_path / "models", ("1", "2"))
    replicas = [await start_capability(model_root=root, models=(MODEL,)) for _ in range(2)]
    orchestrator = await orchestrator_with(fleet_routes(replicas))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        listed = await models.ListModels(model_pb.ListModelsRequest())
        described = await models.GetModel(model_pb.GetModelRequest(name=MODEL))

    assert [(m.name, m.version) for m in listed.models] == [(MODEL, "2")]
    assert described.model.version == "2"
    [served] = described.served_versions
    assert (served.version, served.state, served.replicas) == ("2", model_pb.MODEL_STATE_READY, 2)
    assert (described.replicas_asked, described.replicas_answered) == (2, 2)


class HeldReplica(model_service_pb2_grpc.ModelServiceServicer):
    """A replica whose GetModel answers only once released: a frozen pod, say."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.asked = 0

    async def ListModels(  # noqa: N802 - the gRPC method's name
        self, request: model_pb.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> model_pb.ListModelsResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not held")

    async def ReloadModel(  # noqa: N802 - the gRPC method's name
        self, request: model_pb.ReloadModelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> model_pb.ReloadModelResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not held")

    async def GetModel(  # noqa: N802 - the gRPC method's name
        self, request: model_pb.GetModelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> model_pb.GetModelResponse:
        self.asked += 1
        await self.release.wait()
        return model_pb.GetModelResponse(model=model_pb.ModelInfo(name=request.name, version="9"))


async def test_get_model_does_not_wait_for_a_replica_that_does_not_answer(
    capability: CapabilityServer, orchestrator_with: StartOrchestrator
) -> None:
    """Every replica asked, in turn or all awaited: one frozen replica held GetModel up
    to the backend's timeout (30 s here; the call's own is 15 s)."""
    held = HeldReplica()
    server = grpc.aio.server()
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(held, server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    for service in ("", "ai.classify.v1.ClassifyService"):  # what the channels check
        await checks.set(service, health_pb2.HealthCheckResponse.SERVING)
    try:
        orchestrator = await orchestrator_with(
            "version: 1\nbackends:\n"
            f"  static: {{model: {MODEL}, targets: ['127.0.0.1:{port}',"
            f" '127.0.0.1:{capability.port}'], timeout: 30s}}\n"
            "routes:\n  - name: default\n    backend: static\n"
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            models = model_service_pb2_grpc.ModelServiceStub(channel)
            described = await models.GetModel(model_pb.GetModelRequest(name=MODEL), timeout=15)
        assert held.asked == 1
        assert described.model.version == "1"
        # The frozen replica was asked and is in no entry.
        assert [(v.version, v.replicas) for v in described.served_versions] == [("1", 1)]
        assert (described.replicas_asked, described.replicas_answered) == (2, 1)
    finally:
        held.release.set()
        await server.stop(grace=0)


class HeldLister(HeldReplica):
    """A replica whose ListModels, too, answers only once released."""

    async def ListModels(  # noqa: N802 - the gRPC method's name
        self, request: model_pb.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> model_pb.ListModelsResponse:
        self.asked += 1
        await self.release.wait()
        return model_pb.ListModelsResponse(models=[model_pb.ModelInfo(name=MODEL, version="9")])


async def test_a_routes_edit_waits_for_an_operator_call_walking_the_replicas(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """An edit applied while ListModels waited on a replica closed the old routes'
    channels under it: the call ended CANCELLED, unanswered (ReloadModel, which asks
    the replicas in turn, never asked those after it)."""
    held = HeldLister()
    server = grpc.aio.server()
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(held, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    routes = tmp_path / "routes.yaml"

    def routes_with(timeout: str) -> str:
        return (
            "version: 1\nbackends:\n"
            f"  static: {{model: {MODEL}, targets: ['127.0.0.1:{port}'], timeout: {timeout}}}\n"
            "routes:\n  - name: default\n    backend: static\n"
        )

    routes.write_text(routes_with("5s"))
    orchestrator = await watching_orchestrator(routes)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            models = model_service_pb2_grpc.ModelServiceStub(channel)
            listing = asyncio.ensure_future(
                models.ListModels(model_pb.ListModelsRequest(), timeout=15)
            )
            await wait_until(lambda: held.asked == 1, "the held replica asked")
            replace_file(routes, routes_with("4s"))  # its backend changes: a new pool
            await wait_until(lambda: applied_reloads(orchestrator) == 1, "the edit applied")
            held.release.set()
            listed = await listing
    finally:
        held.release.set()
        await orchestrator.stop(grace_seconds=0)
        await server.stop(grace=0)
    # The held replica's answer, given after the edit, is the call's.
    assert [(info.name, info.version) for info in listed.models] == [(MODEL, "9")]


async def test_list_models_does_not_wait_for_a_replica_that_does_not_answer(
    capability: CapabilityServer, orchestrator_with: StartOrchestrator
) -> None:
    """ListModels asked the replicas in turn, each up to its backend's timeout: one
    frozen replica held the call 30 s here, past the caller's 5 s, although the other
    had answered at once."""
    held = HeldLister()
    server = grpc.aio.server()
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(held, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        orchestrator = await orchestrator_with(
            "version: 1\nbackends:\n"
            f"  static: {{model: {MODEL}, targets: ['127.0.0.1:{port}',"
            f" '127.0.0.1:{capability.port}'], timeout: 30s}}\n"
            f"  gone: {{model: gone, targets: ['127.0.0.1:{closed_port()}']}}\n"
            "routes:\n"
            "  - {name: gone, match: {model: gone}, backend: gone}\n"
            "  - {name: default, backend: static}\n"
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            models = model_service_pb2_grpc.ModelServiceStub(channel)
            listed = await models.ListModels(model_pb.ListModelsRequest(), timeout=5)
        assert held.asked == 1
        # The frozen replica's version 9 is in no entry.
        assert [info.version for info in listed.models if info.name == MODEL] == ["1"]
    finally:
        held.release.set()
        await server.stop(grace=0)


async def test_list_models_with_no_replica_answering_is_unavailable_not_an_empty_fleet(
    orchestrator_with: StartOrchestrator,
) -> None:
    orchestrator = await orchestrator_with(
        "version: 1\nbackends:\n"
        f"  gone: {{model: {MODEL}, targets: ['127.0.0.1:{closed_port()}']}}\n"
        "routes:\n  - name: default\n    backend: gone\n"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await models.ListModels(model_pb.ListModelsRequest(), timeout=15)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

"""The room a loading version needs is held for it from the moment it is made until the
version serves or is refused: before, its weights sat on the device uncounted, and a
cold start of an on_demand model, or another load, took the same room."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability.bundle.errors import MemoryBudgetExceeded
from capability.metrics import MODEL_COLD_STARTS_TOTAL
from tests.conftest import STRIKER, StartCapability, metric_sum
from tests.status_details import error_info, refusal
from tests.unit.capability.test_residency import (
    a_idle_on_the_device_and_b_version_2_on_disk,
    on_demand_in_room_for_one,
)


async def test_a_cold_start_does_not_take_the_room_made_for_a_loading_version(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """a and b on_demand in room for one, a idle on the device. A version of b loading
    has room made (a leaves) and held; a's next caller finds it held and is refused,
    where before a came back beside the loading weights, over the budget."""
    server = await on_demand_in_room_for_one(start_capability, model_root, tmp_path)
    worker = server.pool.workers[0]
    b = worker.replicas["static-b"]
    assert b.ledger is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
        # As b's loader does once it knows the size of the new version's weights.
        held = await worker.make_room_for_load(b.ledger.footprint_bytes, "static-b")
        assert not worker.replicas["static-a"].is_resident  # a left to make the room
        assert held + b.ledger.footprint_bytes <= worker.memory_budget_bytes
        assert worker.held_bytes() == b.ledger.footprint_bytes
        refused = await refusal(
            stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"), timeout=5)
        )
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_info(refused).reason == "DEVICE_MEMORY_PRESSURE"
        assert "versions being replaced or loaded" in (refused.details() or "")
        # The load ended (here: never went on): the room is a's again.
        worker.release_room("static-b")
        answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model="static-a"))
    assert answer.model.name == "static-a"
    assert metric_sum(server.registry, MODEL_COLD_STARTS_TOTAL, model="static-a") == 2
    assert worker.held_bytes() <= worker.memory_budget_bytes


async def test_a_second_load_is_refused_naming_the_room_held_for_the_first(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """Two versions loading at once each made room for itself alone, and both came onto
    a device that held one."""
    server = await on_demand_in_room_for_one(start_capability, model_root, tmp_path)
    worker = server.pool.workers[0]
    footprint = worker.memory_budget_bytes * 2 // 3
    held = await worker.make_room_for_load(footprint, "static-a")
    assert held == 0
    second = await worker.make_room_for_load(footprint, "static-b")
    assert second == footprint  # the first load's room, held for it
    with pytest.raises(MemoryBudgetExceeded, match=r"of it held for other versions loading"):
        worker.refuse_over_budget("static-b", "2", footprint, "predicted", second)
    # Made again for the same model (its measured footprint), its own room is not held
    # against it.
    assert await worker.make_room_for_load(footprint, "static-a") == 0


async def test_the_room_held_for_a_load_is_released_once_it_serves_or_is_refused(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    server = await a_idle_on_the_device_and_b_version_2_on_disk(
        start_capability, model_root, tmp_path
    )
    worker = server.pool.workers[0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        await models.ReloadModel(model_pb.ReloadModelRequest(name="static-b"))
        assert worker.replicas["static-b"].bundle.version == "2"
        assert worker._reserved == {}
        # Refused once its room was made and held: a's bundle under b's folder is read
        # (its weights admitted) before its name is checked. (A budget too small for
        # any version would be refused before any room is held, and show nothing.)
        shutil.copytree(
            tmp_path / "models" / "static-a" / "1", tmp_path / "models" / "static-b" / "3"
        )
        refused = await refusal(models.ReloadModel(model_pb.ReloadModelRequest(name="static-b")))
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "names model 'static-a'" in (refused.details() or "")
    assert worker._reserved == {}


async def test_an_abandoned_load_holds_no_room(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    """A load abandoned (the server stops, a ReloadModel caller leaves) while the event
    loop made room for its weights: WorkerPool.load's end may have released its room
    before that room was held, and nothing would release it again."""
    server = await on_demand_in_room_for_one(start_capability, model_root, tmp_path)
    worker = server.pool.workers[0]
    watch = worker.load_watch("static-b", "2")
    watch.predicted_bytes = worker.memory_budget_bytes // 2
    watch.abandon()
    # What admit_weights has the event loop run, as it runs when the abandon's cancel
    # reaches it too late (the task may finish in its first step).
    assert await watch._room_for_weights() == 0
    assert worker._reserved == {}

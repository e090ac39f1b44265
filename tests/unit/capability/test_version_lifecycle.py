"""A model version's life over a real capability server: which version a start settles
on when newer ones are refused, what a live swap costs the other models on the worker
and how long it is reported to take, a serving version's folder changed under it, and
a load abandoned by the server's stop."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import weakref
from pathlib import Path
from typing import Any

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability.bundle import BundleError, load_bundle, write_manifest
from capability.lifecycle import FOLDER_REMOVED, FOLDER_REPLACED
from capability.metrics import (
    MODEL_FOLDER_CHANGES_TOTAL,
    MODEL_LOAD_SECONDS,
    QUEUE_DEPTH,
    RELOADS_TOTAL,
)
from capability.server import CapabilityServer
from capability.workers.worker import WARM_UP_SHAPES
from tests.conftest import STRIKER, StartCapability, metric_sum, wait_until
from tests.status_details import refusal
from tests.unit.capability.test_model_watcher import (
    LIFECYCLE_LOGGER,
    MODEL,
    deploy,
    logged,
    reload_model,
    reloads,
    retries,
    serving_version,
    truncate_weights,
    watching,
)
from tests.unit.capability.test_serving import device_occupied

WORKER_LOGGER = "capability.workers.worker"
POOL_LOGGER = "capability.workers.pool"


async def described(server: CapabilityServer) -> model_pb.ModelInfo:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        return (await models.GetModel(model_pb.GetModelRequest(name=MODEL))).model


async def unwatched(
    model_root: Path, tmp_path: Path, start_capability: StartCapability, **settings: Any
) -> tuple[CapabilityServer, Path]:
    """A capability server serving version 1 from a model root of its own, with no
    watcher: only the test's ReloadModel loads a version."""
    root = tmp_path / "models"
    deploy(model_root, root, "1")
    server = await start_capability(model_root=root, models=(MODEL,), **settings)
    return server, root


def folder_changes(server: CapabilityServer, change: str) -> float:
    return metric_sum(server.registry, MODEL_FOLDER_CHANGES_TOTAL, model=MODEL, change=change)


async def test_a_start_serves_the_newest_version_that_loads_and_counts_the_refused_one(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A version a running server refused, left in the root, costs the next start that
    model's newest version, not the start; the watcher loads it once it is fixed."""
    caplog.set_level(logging.INFO, logger=LIFECYCLE_LOGGER)
    root = tmp_path / "models"
    deploy(model_root, root, "1")
    truncate_weights(deploy(model_root, root, "2"))

    server = await start_capability(model_root=root, models=(MODEL,), watch_seconds=0.1)

    assert await serving_version(server) == "1"
    assert reloads(server, "refused") == 1
    (refused,) = [r for r in caplog.records if r.getMessage().startswith("version refused at")]
    assert refused.levelno == logging.ERROR
    assert (refused.__dict__["model"], refused.__dict__["version"]) == (MODEL, "2")
    assert refused.__dict__["folder"] == str(root / MODEL / "2")
    assert logged(caplog, "model started on an older version", model=MODEL, version="1")
    # Both outcomes are exported from the start, so that a later refusal is an increase.
    exported = {
        sample.labels["outcome"]: sample.value
        for family in server.registry.collect()
        for sample in family.samples
        if sample.name == RELOADS_TOTAL
    }
    assert exported == {"ok": 0, "refused": 1}

    # Remembered as a watcher's refusal: tried again once a fixed copy is there.
    shutil.rmtree(root / MODEL / "2")
    deploy(model_root, root, "2", staged_as=".2.partial")
    await wait_until(lambda: reloads(server, "ok") == 1, "the fixed version 2 loaded")
    assert await serving_version(server) == "2"
    assert (reloads(server, "refused"), retries(server)) == (1, 1)


async def test_a_version_asking_to_read_more_than_any_request_can_is_refused_at_start(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    """A static-embedding model has no position table to bound its max_seq_length, and
    the memory warm-up computes a batch at it: 100,000,000 asked for 51 GB in one
    allocation, a RuntimeError that ended the whole start instead of costing the
    version. Past the contract's largest max_length (1,024) it is a config refusal."""
    root = tmp_path / "models"
    deploy(model_root, root, "1")
    too_long = deploy(model_root, root, "2")
    config = json.loads((too_long / "config.json").read_text())
    (too_long / "config.json").write_text(json.dumps({**config, "max_seq_length": 100_000_000}))
    (too_long / "manifest.json.sig").unlink(missing_ok=True)
    write_manifest(too_long)

    server = await start_capability(
        model_root=root, models=(MODEL,), memory_warm_up="largest", watch_seconds=0.1
    )

    assert await serving_version(server) == "1"
    assert reloads(server, "refused") == 1
    with pytest.raises(BundleError, match=r"max_seq_length 100000000 must be .* at most 1024"):
        load_bundle(too_long)


async def test_a_version_whose_config_overflows_torch_is_refused_naming_config_json(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    """vocab_size 2**62 overflowed torch's storage size as the module was built: a
    RuntimeError, not a refusal, so the start exited although version 1 loads, and
    ReloadModel answered INTERNAL."""
    root = tmp_path / "models"
    deploy(model_root, root, "1")
    oversized = deploy(model_root, root, "2")
    config = json.loads((oversized / "config.json").read_text())
    config["dimensions"]["vocab_size"] = 2**62
    (oversized / "config.json").write_text(json.dumps(config))
    (oversized / "manifest.json.sig").unlink(missing_ok=True)
    write_manifest(oversized)

    server = await start_capability(model_root=root, models=(MODEL,))

    assert await serving_version(server) == "1"
    assert reloads(server, "refused") == 1
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        error = await refusal(
            models.ReloadModel(model_pb.ReloadModelRequest(name=MODEL, version="2"))
        )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"config.json: dimensions.vocab_size {2**62} is over the limit" in str(error.details())


async def test_a_start_is_refused_only_when_no_version_of_a_model_loads(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    root = tmp_path / "models"
    truncate_weights(deploy(model_root, root, "1"))
    truncate_weights(deploy(model_root, root, "2"))

    with pytest.raises(BundleError) as refused:
        await start_capability(model_root=root, models=(MODEL,))

    message = str(refused.value)
    assert "embeddings.safetensors" in message.partition(" (version 2")[0]
    assert f"(version 2 of model {MODEL!r}, {root.resolve() / MODEL / '2'})" in message
    assert "no version of this one does (refused: 2, 1; each refusal is logged)" in message


async def test_a_live_swap_of_a_version_that_computes_alike_runs_no_largest_warm_up(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The largest warm-up holds the device for one forward of 64 x 256 tokens, and
    every model on the worker waits for it: a version with the same dimensions, batch
    and residency carries the serving version's measured overhead over instead."""
    caplog.set_level(logging.INFO, logger=WORKER_LOGGER)
    server, root = await unwatched(model_root, tmp_path, start_capability, memory_warm_up="largest")
    (before,) = (await described(server)).memory
    deploy(model_root, root, "2")

    swapped = await reload_model(server)

    assert swapped.model.version == "2"
    # The loader's own warm-up, then the worker's shapes, each once untimed and once
    # timed: nothing at 64 x 256.
    classifier = server.pool.workers[0].replicas[MODEL].bundle.classifier
    assert classifier.forward_count == 1 + 2 * len(WARM_UP_SHAPES)
    assert logged(caplog, "memory measurement carried over", model=MODEL, carried_from="1")
    (entry,) = swapped.model.memory
    assert (entry.warm_up_batch_size, entry.warm_up_tokens) == (
        before.warm_up_batch_size,
        before.warm_up_tokens,
    )
    overhead = before.footprint_bytes - before.weights_bytes
    assert entry.footprint_bytes == entry.weights_bytes + overhead == entry.predicted_bytes


async def test_the_start_version_is_freed_once_a_swap_retires_it(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    """The heap frozen when the server starts serving (freeze_heap) is never collected,
    and a replica sits in a reference cycle with its batcher: frozen with them, the
    start version's weights stayed allocated, uncounted, after every swap."""
    server, root = await unwatched(model_root, tmp_path, start_capability, gc_freeze="on")
    worker = server.pool.workers[0]
    start_version = weakref.ref(worker.replicas[MODEL].bundle.classifier)
    deploy(model_root, root, "2")

    assert (await reload_model(server)).model.version == "2"

    # The retirement's own collection (release_cached, once the old version has let go
    # of its last text) frees it; the test runs none.
    await wait_until(lambda: start_version() is None, "the start version freed")


async def test_a_retired_version_leaves_the_queue_depth_series_to_its_successor(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    """Both versions' series have the same labels (model, worker): the retiring one
    removed it, and the serving version's queue went unreported until its next
    admission; and, draining, wrote its own queue's length over the serving one's."""
    server, root = await unwatched(model_root, tmp_path, start_capability)
    worker = server.pool.workers[0]
    old = worker.replicas[MODEL]

    def depth() -> float | None:
        labels = {"model": MODEL, "worker": worker.name}
        return server.registry.get_sample_value(QUEUE_DEPTH, labels)

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
        deploy(model_root, root, "2")
        assert (await reload_model(server)).model.version == "2"
        await wait_until(lambda: not worker._retiring_replicas)
        assert depth() == 0
        async with device_occupied(worker):
            queued = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
            )
            await wait_until(lambda: depth() == 1, "the serving version's text queued")
            old.batcher.show_queue_depth()  # as the old one's queue changes
            assert depth() == 1
        await queued


async def test_load_duration_runs_until_the_version_serves_warm_up_included(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    """The worker's warm-up waits for the device while the test holds it: that wait is
    part of the load GetModel and classify_model_load_seconds report, on top of the
    loader's own part."""
    server, root = await unwatched(model_root, tmp_path, start_capability)
    deploy(model_root, root, "2")
    worker = server.pool.workers[0]
    async with device_occupied(worker):
        swapping = asyncio.create_task(reload_model(server))
        await wait_until(lambda: worker.others_waiting, "the new version waits to warm up")
        held_from = time.perf_counter()
        await asyncio.sleep(0.3)
        held_seconds = time.perf_counter() - held_from
    swapped = await swapping

    loader_seconds = worker.replicas[MODEL].bundle.load_seconds
    reported = swapped.model.load_duration.ToNanoseconds() / 1e9
    assert reported >= loader_seconds + held_seconds
    gauge = metric_sum(server.registry, MODEL_LOAD_SECONDS, model=MODEL)
    assert gauge == pytest.approx(reported, abs=1e-6)


async def test_a_serving_versions_folder_replaced_then_removed_is_logged_and_counted_once_each(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LIFECYCLE_LOGGER)
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    serving = root / MODEL / "1"
    # Another bundle under the same version name: its manifest's bytes differ (a line
    # added stands for any other content here).
    other = deploy(model_root, root, ".1.new")
    (other / "manifest.json").write_bytes((other / "manifest.json").read_bytes() + b"\n")
    serving.rename(tmp_path / "old-1")
    other.rename(serving)

    await wait_until(lambda: folder_changes(server, FOLDER_REPLACED) == 1, "replacement seen")
    (warning,) = [r for r in caplog.records if "serving version's folder" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert warning.getMessage().startswith("serving version's folder replaced")
    fields = {key: warning.__dict__[key] for key in ("model", "version", "folder", "change")}
    assert fields == {
        "model": MODEL,
        "version": "1",
        "folder": str(serving.resolve()),
        "change": FOLDER_REPLACED,
    }

    shutil.rmtree(serving)
    await wait_until(lambda: folder_changes(server, FOLDER_REMOVED) == 1, "removal seen")
    # Each change once, however many polls saw it; the loaded bundle serves on.
    assert folder_changes(server, FOLDER_REPLACED) == 1
    assert await serving_version(server) == "1"
    assert reloads(server, "ok") == 0


async def test_a_serving_numbered_link_pointed_at_another_bundle_is_logged_and_counted(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    """`2 -> .release-2` serves; `2` is then pointed at `.release-2b`, another bundle. The
    folder loaded was left as it was, so nothing was seen, and the next start served the
    other bundle under the same version name."""
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    deploy(model_root, root, ".release-2")
    (root / MODEL / "2").symlink_to(".release-2")
    await wait_until(lambda: reloads(server, "ok") == 1, "version 2 loaded")
    other = deploy(model_root, root, ".release-2b")
    (other / "manifest.json").write_bytes((other / "manifest.json").read_bytes() + b"\n")
    (root / MODEL / "2.new").symlink_to(".release-2b")
    (root / MODEL / "2.new").rename(root / MODEL / "2")  # re-pointed at once, as `ln -sfn`

    await wait_until(lambda: folder_changes(server, FOLDER_REPLACED) == 1, "re-pointing seen")
    assert await serving_version(server) == "2"
    assert reloads(server, "ok") == 1


async def test_a_load_under_way_when_the_server_stops_is_abandoned_and_logged(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LIFECYCLE_LOGGER)
    caplog.set_level(logging.INFO, logger=POOL_LOGGER)
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    assert logged(caplog, "model version serving", version="1")
    worker = server.pool.workers[0]
    # The device's turn held, not its thread: the stop joins the device thread.
    async with worker.turn():
        deploy(model_root, root, "2", staged_as=".2.partial")
        await wait_until(lambda: worker.others_waiting, "version 2 waits to warm up")
        stopping = asyncio.create_task(server.stop(grace_seconds=0))
        await wait_until(
            lambda: logged(caplog, "load abandoned: shutting down", model=MODEL, version="2"),
            "the load abandoned",
        )
    await stopping

    assert reloads(server, "ok") == 0
    assert not logged(caplog, "model version serving", version="2")


async def test_a_serving_manifest_replaced_by_a_fifo_is_a_replacement_and_the_watch_goes_on(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    """Read whole by its path, a manifest.json made a FIFO held the watcher's thread
    forever (every model's watch stopped with it); one linked to /dev/zero grew until
    memory ran out, and a 1 GiB file cost 1 GiB at every look. It is read as a load
    reads it: capped, never through a link, never waiting on a FIFO."""
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    manifest = root / MODEL / "1" / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    await wait_until(lambda: folder_changes(server, FOLDER_REPLACED) == 1, "the FIFO seen")
    # The watch goes on past the FIFO: the folder, removed next, is seen as removed.
    shutil.rmtree(root / MODEL / "1")
    await wait_until(lambda: folder_changes(server, FOLDER_REMOVED) == 1, "the removal seen")
    assert await serving_version(server) == "1"

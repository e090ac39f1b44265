"""The model-root watcher over a real capability server: which folder names it loads,
a rollback by ReloadModel that it leaves alone, and errors it outlives."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability import lifecycle
from capability.bundle import write_manifest
from capability.config import CapabilitySettings
from capability.lifecycle import ModelRoot
from capability.metrics import RELOAD_RETRIES_TOTAL, RELOADS_TOTAL
from capability.server import CapabilityServer
from capability.workers import pool as pool_module
from classify_common.nodes import BATCH_SPAN_NAME
from tests.conftest import REPO_ROOT, STRIKER, StartCapability, metric_sum, wait_until
from tests.status_details import refusal
from tests.unit.capability.own_bundle import PANICS_ON_WARM_UP, split_first_by

MODEL = "topic-static"
LIFECYCLE_LOGGER = "capability.lifecycle"


def deploy(model_root: Path, root: Path, version: str, *, staged_as: str | None = None) -> Path:
    """Copy version 1 from the session root in as `version`; with `staged_as`, under that
    name first, renamed when whole, as docs/models.md says to deploy."""
    folder = root / MODEL / (staged_as or version)
    shutil.copytree(model_root / MODEL / "1", folder)
    if staged_as is None:
        return folder
    return folder.rename(root / MODEL / version)


def truncate_weights(version: Path) -> None:
    """A copy broken off halfway through the weights: refused (hash mismatch)."""
    weights = version / "embeddings.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])


def reloads(server: CapabilityServer, outcome: str) -> float:
    return metric_sum(server.registry, RELOADS_TOTAL, model=MODEL, outcome=outcome)


def retries(server: CapabilityServer) -> float:
    return metric_sum(server.registry, RELOAD_RETRIES_TOTAL, model=MODEL)


async def watching(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    *versions: str,
    **settings: Any,
) -> tuple[CapabilityServer, Path]:
    """A capability server watching (every 0.1 s) a model root of its own that holds
    `versions` of the model: the server and the root."""
    root = tmp_path / "models"
    for version in versions:
        deploy(model_root, root, version)
    server = await start_capability(model_root=root, models=(MODEL,), watch_seconds=0.1, **settings)
    return server, root


async def watched_with_warm_texts(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> tuple[CapabilityServer, Path, Path]:
    """A watched model root serving version 1, whose model reads the warm_texts file
    `hot.txt` (good for now): the server, the root and that file."""
    hot = tmp_path / "hot.txt"
    hot.write_text(f"{STRIKER}\n")
    config = tmp_path / "models.yaml"
    config.write_text(f"{MODEL}:\n  warm_texts: hot.txt\n")
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    server, root = await watching(model_root, tmp_path, start_capability, "1", per_model=per_model)
    return server, root, hot


async def loaded_at_its_one_retry(server: CapabilityServer, version: str) -> None:
    """`version`, refused once, loads when tried again: the server's one retry."""
    await wait_until(lambda: reloads(server, "ok") == 1, f"version {version} loaded")
    assert await serving_version(server) == version
    assert (reloads(server, "refused"), retries(server)) == (1, 1)


async def serving_version(server: CapabilityServer) -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        described = await models.GetModel(model_pb.GetModelRequest(name=MODEL))
    return str(described.model.version)


async def reload_model(server: CapabilityServer, version: str = "") -> model_pb.ReloadModelResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        reloaded: model_pb.ReloadModelResponse = await models.ReloadModel(
            model_pb.ReloadModelRequest(name=MODEL, version=version)
        )
    return reloaded


def logged(caplog: pytest.LogCaptureFixture, message: str, **fields: str) -> bool:
    return any(
        record.getMessage().startswith(message)
        and all(getattr(record, key, None) == value for key, value in fields.items())
        for record in caplog.records
    )


async def test_a_version_copied_in_under_a_temporary_name_loads_only_once_renamed(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    server, root = await watching(model_root, tmp_path, start_capability, "1")

    # A finished copy still under its temporary name, then a numbered version the watcher
    # refuses: the refusal shows that the watcher looked while `2.tmp` was there.
    deploy(model_root, root, "2.tmp")
    truncate_weights(deploy(model_root, root, "3"))
    await wait_until(lambda: reloads(server, "refused") == 1, "version 3 refused")
    assert await serving_version(server) == "1"

    shutil.rmtree(root / MODEL / "3")
    (root / MODEL / "2.tmp").rename(root / MODEL / "2")
    await wait_until(lambda: reloads(server, "ok") == 1, "version 2 loaded")
    assert await serving_version(server) == "2"

    # A later version, staged under a hidden name as the bundle builder does.
    deploy(model_root, root, "4", staged_as=".4.partial")
    await wait_until(lambda: reloads(server, "ok") == 2, "version 4 loaded")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
    assert response.model.version == "4"
    assert reloads(server, "refused") == 1


async def test_a_rollback_by_reload_model_stays_until_a_reload_of_the_newest(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LIFECYCLE_LOGGER)
    server, root = await watching(model_root, tmp_path, start_capability, "1", "2")
    assert await serving_version(server) == "2"

    rolled_back = await reload_model(server, "1")
    assert (rolled_back.model.version, rolled_back.previous_version) == ("1", "2")
    # A newer version appears: the watcher sees it and, the model pinned, leaves it.
    deploy(model_root, root, "3", staged_as=".3.partial")
    await wait_until(
        lambda: logged(caplog, "new version found, not loaded", model=MODEL, version="3"),
        "the watcher saw version 3",
    )
    assert await serving_version(server) == "1"
    assert reloads(server, "ok") == 1

    # A named version is loaded only when asked for, and pins the model too.
    deploy(model_root, root, "canary", staged_as=".canary.partial")
    assert (await reload_model(server, "canary")).model.version == "canary"

    # ReloadModel of the newest lets the watcher follow the numbered versions again.
    latest = await reload_model(server)
    assert (latest.model.version, latest.previous_version) == ("3", "canary")
    assert logged(caplog, "model unpinned", model=MODEL)
    deploy(model_root, root, "4", staged_as=".4.partial")
    await wait_until(lambda: reloads(server, "ok") == 4, "version 4 loaded by the watcher")
    assert await serving_version(server) == "4"
    assert reloads(server, "refused") == 0


async def test_a_good_version_deployed_with_a_broken_newer_one_is_loaded(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    """Versions 2 (good) and 3 (damaged) arrive together while 1 serves. The watcher
    tried 3 alone and served 1 on, while a restart of the same root would serve 2 (a
    start takes the newest that loads): a fleet split by when each replica started."""
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    broken = root / MODEL / ".3.partial"
    shutil.copytree(model_root / MODEL / "1", broken)
    truncate_weights(broken)
    # The broken one first: whenever the watcher looks, 3 is the newest it sees.
    broken.rename(root / MODEL / "3")
    deploy(model_root, root, "2", staged_as=".2.partial")
    await wait_until(lambda: reloads(server, "refused") == 1 and reloads(server, "ok") == 1)
    assert await serving_version(server) == "2"
    await asyncio.sleep(0.3)  # three more polls: neither is tried again
    assert (reloads(server, "refused"), reloads(server, "ok")) == (1, 1)


async def test_a_version_whose_tokenizer_panics_is_refused_and_the_watcher_goes_on(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The panic went past every `except Exception` and ended the watcher's task:
    no later version was ever loaded, and nothing counted the refusal."""
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    panics = root / MODEL / ".2.partial"
    shutil.copytree(model_root / MODEL / "1", panics)
    split_first_by(panics, PANICS_ON_WARM_UP)
    panics.rename(root / MODEL / "2")
    await wait_until(lambda: reloads(server, "refused") == 1, "version 2 refused")
    [refused] = [r for r in caplog.records if r.getMessage() == "reload refused"]
    assert str(getattr(refused, "error", "")) == (
        "tokenizer.json: fails on the warm-up texts: the tokenizer panicked: Onig: Regex "
        "search error: retry-limit-in-match over"
    )
    deploy(model_root, root, "3", staged_as=".3.partial")

    async def serving_version_3() -> bool:
        return await serving_version(server) == "3"

    await wait_until(serving_version_3, "version 3 loaded")
    assert reloads(server, "refused") == 1


async def test_a_refused_reload_of_the_newest_leaves_the_model_pinned(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LIFECYCLE_LOGGER)
    server, root = await watching(model_root, tmp_path, start_capability, "1", "2")
    await reload_model(server, "1")
    truncate_weights(deploy(model_root, root, "3"))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        error = await refusal(models.ReloadModel(model_pb.ReloadModelRequest(name=MODEL)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not logged(caplog, "model unpinned")
    # Still pinned: a newer folder is seen and left alone.
    deploy(model_root, root, "4", staged_as=".4.partial")
    await wait_until(
        lambda: logged(caplog, "new version found, not loaded", model=MODEL, version="4"),
        "the watcher saw version 4",
    )
    assert await serving_version(server) == "1"
    assert (reloads(server, "ok"), reloads(server, "refused")) == (1, 1)


async def test_a_numbered_folder_linked_from_outside_the_root_is_refused_once(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LIFECYCLE_LOGGER)
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(model_root / MODEL / "1", elsewhere)
    (root / MODEL / "2").symlink_to(elsewhere)

    await wait_until(lambda: reloads(server, "refused") == 1, "version 2 refused")
    await asyncio.sleep(0.5)  # five polls of the unchanged link try nothing
    assert (reloads(server, "refused"), retries(server)) == (1, 0)
    [refused] = [r for r in caplog.records if r.getMessage() == "reload refused"]
    assert getattr(refused, "error", None) == (
        f"{root.resolve() / MODEL / '2'}: resolves to {elsewhere.resolve()}, outside the model "
        f"root {root.resolve()}; a version's folder must lie under the model root"
    )
    assert [r.getMessage() for r in caplog.records].count("new version found") == 1

    # A folder of its own in the link's place is tried again, and loads.
    (root / MODEL / "2").unlink()
    deploy(model_root, root, "2", staged_as=".2.partial")
    await loaded_at_its_one_retry(server, "2")


@pytest.mark.parametrize("target", [".release-2", "1"], ids=["staged-release", "alias"])
async def test_a_numbered_folder_linked_within_the_root_serves_under_its_own_name(
    model_root: Path, tmp_path: Path, start_capability: StartCapability, target: str
) -> None:
    """`2 -> .release-2` (a release staged under a hidden name) and `2 -> 1` (an alias)
    are version 2: served under their target's name, they were "older" than the
    numbered folder beside them, and the watcher reloaded them every poll."""
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    if not (root / MODEL / target).exists():
        deploy(model_root, root, target)
    (root / MODEL / "2").symlink_to(target)

    await wait_until(lambda: reloads(server, "ok") == 1, "version 2 loaded")
    assert await serving_version(server) == "2"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answered = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
    assert answered.model.version == "2"
    await asyncio.sleep(0.5)  # five polls: version 2 serves, and nothing is newer
    assert (reloads(server, "ok"), reloads(server, "refused")) == (1, 0)


async def test_a_refused_version_fixed_by_a_copy_that_keeps_times_is_tried_again(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    good = model_root / MODEL / "1" / "head.safetensors"
    staged = deploy(model_root, root, ".2.partial")  # each file keeps its source's times
    damaged = staged / "head.safetensors"
    content = bytearray(damaged.read_bytes())
    content[-1] ^= 0x01
    damaged.write_bytes(bytes(content))
    os.utime(damaged, ns=(good.stat().st_atime_ns, good.stat().st_mtime_ns))
    staged.rename(root / MODEL / "2")
    await wait_until(lambda: reloads(server, "refused") == 1, "version 2 refused")

    # Fixed as `cp -p` (rsync -a, tar) fixes it: written through the same file, then its
    # modification time set back. Same name, size, modification time and inode.
    shutil.copy2(good, root / MODEL / "2" / "head.safetensors")
    await loaded_at_its_one_retry(server, "2")


async def test_a_version_refused_for_its_warm_texts_is_tried_again_once_they_are_fixed(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    server, root, hot = await watched_with_warm_texts(model_root, tmp_path, start_capability)
    hot.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    deploy(model_root, root, "2", staged_as=".2.partial")
    await wait_until(lambda: reloads(server, "refused") == 1, "version 2 refused")

    hot.write_text(f"{STRIKER}\n")
    await loaded_at_its_one_retry(server, "2")


async def test_a_version_refused_for_want_of_room_is_tried_again_with_its_files_unchanged(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bundle is sound, the device was too full for it just then (another model's
    load, a version retiring). Remembered as a broken bundle is, it stayed unloaded
    once the room came, until someone touched its files or restarted the server."""
    monkeypatch.setattr(lifecycle, "ROOM_RETRY_FIRST_SECONDS", 0.3)
    server, root = await watching(model_root, tmp_path, start_capability, "1")
    (worker,) = server.pool.workers
    room = worker.memory_budget_bytes
    worker.memory_budget_bytes = worker.held_bytes() + 1  # no room for a second version
    deploy(model_root, root, "2", staged_as=".2.partial")
    await wait_until(lambda: reloads(server, "refused") == 1, "version 2 refused")
    refused_at = asyncio.get_running_loop().time()
    worker.memory_budget_bytes = room  # the room comes back

    await loaded_at_its_one_retry(server, "2")
    assert asyncio.get_running_loop().time() - refused_at >= 0.25  # not at the next poll


async def test_a_warm_texts_file_that_is_not_utf8_is_refused_and_the_watcher_goes_on(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, root, hot = await watched_with_warm_texts(model_root, tmp_path, start_capability)

    hot.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    deploy(model_root, root, "2", staged_as=".2.partial")
    await wait_until(lambda: reloads(server, "refused") == 1, "version 2 refused")
    [refusal] = [r for r in caplog.records if r.getMessage() == "reload refused"]
    assert (getattr(refusal, "version", None), getattr(refusal, "serving", None)) == ("2", "1")
    assert str(getattr(refusal, "error", "")).startswith(
        f"{hot}: warm_texts file is not UTF-8 text (byte 0xe9"
    )
    assert await serving_version(server) == "1"

    hot.write_text(f"{STRIKER}\n")
    deploy(model_root, root, "3", staged_as=".3.partial")

    async def serving_version_3() -> bool:
        return await serving_version(server) == "3"

    # Version 2 may load first: fixing warm_texts makes it worth a retry (test above).
    await wait_until(serving_version_3, "version 3 loaded")
    await server.stop(grace_seconds=5)


async def test_batches_after_a_reload_are_not_part_of_the_reload_calls_trace(
    start_capability: StartCapability, span_exporter: InMemorySpanExporter
) -> None:
    """The new version's batching loop is started by the ReloadModel call; its batch
    spans (and log lines) must not join that call's trace for the replica's lifetime."""
    server = await start_capability(models=(MODEL,))
    span_exporter.clear()
    await reload_model(server)

    def reload_spans() -> list[ReadableSpan]:
        return [
            span
            for span in span_exporter.get_finished_spans()
            if span.name == "ai.classify.v1.ModelService/ReloadModel" and span.context is not None
        ]

    # The server span ends once the answer is sent, which can be after the client has it.
    await wait_until(lambda: len(reload_spans()) == 1, "the ReloadModel span ended")
    (reload_span,) = reload_spans()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
    await wait_until(
        lambda: any(span.name == BATCH_SPAN_NAME for span in span_exporter.get_finished_spans())
    )
    batches = [span for span in span_exporter.get_finished_spans() if span.name == BATCH_SPAN_NAME]
    assert reload_span.context is not None
    for batch in batches:
        assert batch.context is not None
        assert batch.context.trace_id != reload_span.context.trace_id
        assert batch.parent is None
    assert answer.trace_id != format(reload_span.context.trace_id, "032x")


async def described(server: CapabilityServer) -> model_pb.ModelInfo:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        answer = await models.GetModel(model_pb.GetModelRequest(name=MODEL))
    return answer.model


async def test_get_model_names_the_refused_versions_and_the_pinned_one(
    model_root: Path, tmp_path: Path, start_capability: StartCapability
) -> None:
    """An operator asks why the newest version is not serving: GetModel says which
    versions were refused, why and when, and which version a ReloadModel pinned."""
    root = tmp_path / "models"
    deploy(model_root, root, "1")
    truncate_weights(deploy(model_root, root, "2"))
    before = datetime.now(UTC)
    server = await start_capability(model_root=root, models=(MODEL,), watch_seconds=0.1)
    after = datetime.now(UTC)

    info = await described(server)
    assert (info.version, info.pinned_version) == ("1", "")
    [refused] = info.refused_versions
    assert refused.version == "2"
    assert "embeddings.safetensors" in refused.reason
    assert before <= refused.refused_at.ToDatetime(UTC) <= after

    # A third version damaged the same way joins the list, newest first; a rollback by
    # ReloadModel pins the model.
    truncate_weights(deploy(model_root, root, "3", staged_as=".3.partial"))
    await wait_until(lambda: reloads(server, "refused") == 2, "version 3 refused")
    await reload_model(server, "1")
    info = await described(server)
    assert [r.version for r in info.refused_versions] == ["3", "2"]
    assert info.pinned_version == "1"

    # A reload of the serving version refused (its folder damaged since) leaves the
    # loaded copy serving: it is not listed as refused beside it.
    truncate_weights(root / MODEL / "1")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        error = await refusal(
            models.ReloadModel(model_pb.ReloadModelRequest(name=MODEL, version="1"))
        )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = await described(server)
    assert (info.version, [r.version for r in info.refused_versions]) == ("1", ["3", "2"])

    # A refused folder removed leaves the list; one that loads leaves it too.
    shutil.rmtree(root / MODEL / "3")
    shutil.rmtree(root / MODEL / "2")
    deploy(model_root, root, "2", staged_as=".2.partial")
    await reload_model(server)  # the newest, unpinned
    info = await described(server)
    # Version 1's damaged folder is refused, now that another version serves.
    assert (info.version, info.pinned_version) == ("2", "")
    assert [r.version for r in info.refused_versions] == ["1"]


class HeldOpenRoot(ModelRoot):
    """The server's own model root, whose first call of `held` (a listing, or a
    version's folder resolved) waits until the test lets it go, at most 2 s: a network
    volume's slow listing, on any file system."""

    def __init__(self, root: Path, held: str) -> None:
        super().__init__(root)
        self.held = held
        self.entered = threading.Event()  # the held call has begun
        self.let_go = threading.Event()
        self.holding = False  # the held call waits now

    def _hold(self, method: str) -> None:
        if method != self.held or self.entered.is_set():
            return
        self.holding = True
        self.entered.set()
        self.let_go.wait(timeout=2.0)
        self.holding = False

    def versions(self, name: str) -> list[str]:
        self._hold("versions")
        return super().versions(name)

    def version_dir(self, name: str, version: str) -> Path:
        self._hold("version_dir")
        return super().version_dir(name, version)


@pytest.mark.parametrize(
    ("held", "version", "watch_seconds"),
    [("versions", None, 0.1), ("versions", "", 0), ("version_dir", "1", 0)],
    ids=["watcher-poll", "reload-of-the-newest", "reload-of-a-named-version"],
)
async def test_calls_are_answered_while_the_model_root_is_slow_to_list(
    model_root: Path,
    tmp_path: Path,
    start_capability: StartCapability,
    held: str,
    version: str | None,
    watch_seconds: float,
) -> None:
    """The watcher listed the model folder on the event loop at every poll (and
    ReloadModel listed it and resolved the version's folder there): 50,000 stale
    numbered folders stalled every call the server answered for about a second a
    poll. A Classify is answered while the listing is still held open."""
    root = tmp_path / "models"
    deploy(model_root, root, "1")
    server = await start_capability(model_root=root, models=(MODEL,), watch_seconds=watch_seconds)
    slow = server.lifecycle.root = HeldOpenRoot(root, held)
    reloading = None if version is None else asyncio.create_task(reload_model(server, version))
    try:
        assert await asyncio.to_thread(slow.entered.wait, 5.0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            answered = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
        assert answered.labels[0].name == "sports"
        assert slow.holding, f"the call waited for {held} to end: it ran on the event loop"
    finally:
        slow.let_go.set()
        if reloading is not None:
            await reloading


# Run as root, a process reads every folder whatever its mode: the look at the model root
# runs in a child process without the capabilities that let it (as a server runs, under
# a user of its own).
AS_A_PLAIN_USER = (
    ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all"]
    if os.geteuid() == 0
    else []
)
LOOK_AT_THE_ROOT = """
import json, sys
from pathlib import Path
from capability.lifecycle import ModelRoot
root = ModelRoot(Path(sys.argv[1]))
print(json.dumps([root.versions("topic-static"), [p.name for p, _ in root.skipped_folders()]]))
"""


@pytest.mark.skipif(
    os.geteuid() == 0 and shutil.which("setpriv") is None,
    reason="root reads every folder, and setpriv (util-linux) is not here to drop that",
)
def test_a_folder_the_server_may_not_read_is_left_out_not_a_failed_start(
    tmp_path: Path, model_root: Path
) -> None:
    """Another user's folder (mode 700) under the model root: its PermissionError
    stopped the start, although another model was asked for, and live, each look of
    the watcher failed as a bug (a refused reload counted every poll)."""
    root = tmp_path / "models"
    shutil.copytree(model_root / "topic-static" / "1", root / "topic-static" / "1")
    (root / "topic-static" / "2").mkdir()
    (root / "topic-static" / "2" / "manifest.json").write_text("{}")
    (root / "other-model" / "1").mkdir(parents=True)
    (root / "other-model" / "1" / "manifest.json").write_text("{}")
    closed = [root / "topic-static" / "2", root / "other-model"]
    for folder in closed:
        folder.chmod(0)
    try:
        looked = subprocess.run(
            [*AS_A_PLAIN_USER, sys.executable, "-c", LOOK_AT_THE_ROOT, str(root)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for folder in closed:
            folder.chmod(0o755)
    assert looked.returncode == 0, looked.stderr
    assert json.loads(looked.stdout) == [["1"], ["other-model"]]
    assert looked.stderr.count("model folder left out: this server may not read it") == 2


async def test_a_version_rewritten_while_two_workers_read_it_is_refused_not_served_split(
    start_capability: StartCapability,
    model_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each worker reads and verifies the version folder on its own. Re-published under
    the same number while they read it (a label renamed), the workers served two
    bundles as one version: answers named `sport` and `sports` at once, and GetModel
    and the folder check saw the first worker's alone. Here the second worker's read
    waits until the first's is done, and the folder is rewritten in between."""
    root = tmp_path / "models"
    shutil.copytree(model_root / "topic-static" / "1", root / "topic-static" / "1")
    server = await start_capability(model_root=root, cpu_workers=2)
    version_2 = root / "topic-static" / "2"
    shutil.copytree(root / "topic-static" / "1", version_2)
    (version_2 / "manifest.json.sig").unlink(missing_ok=True)
    load_on = pool_module._load_on
    first_read = threading.Event()
    reads = itertools.count()

    def read_then_republish(directory: Path, *args: Any) -> Any:
        if next(reads) == 0:
            try:
                return load_on(directory, *args)
            finally:
                first_read.set()
        first_read.wait(30)
        config = json.loads((directory / "config.json").read_text())
        config["labels"][1]["name"] = "sport"
        (directory / "config.json").write_text(json.dumps(config))
        write_manifest(directory)
        return load_on(directory, *args)

    monkeypatch.setattr(pool_module, "_load_on", read_then_republish)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        error = await refusal(
            models.ReloadModel(model_pb.ReloadModelRequest(name="topic-static", version="2"))
        )
        classify = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answers = [
            await classify.Classify(pb.ClassifyRequest(text=STRIKER, model="topic-static"))
            for _ in range(4)
        ]
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "the folder changed while the workers read it" in (error.details() or "")
    assert {(a.model.version, a.labels[0].name) for a in answers} == {("1", "sports")}

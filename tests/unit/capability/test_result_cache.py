"""The result cache over real gRPC: a repeated text is answered without a forward, a
version swap never serves the old version's result and refills the cache with the
most hit texts (each in its own scope), one scope's (tenant's) entries never answer
another's, a bundle rebuilt under the same version (another digest) never
serves the other's, and the bounds hold."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability.bundle.manifest import write_manifest
from capability.config import CapabilitySettings
from capability.metrics import (
    ADMISSIONS_REFUSED_TOTAL,
    CACHE_HIT,
    CACHE_MISS,
    CACHE_REQUESTS_TOTAL,
    MODEL_FORWARD_TOTAL,
    RESULT_CACHE_HIT_FLOOR,
    RESULT_CACHE_WARMED_TOTAL,
    CapabilityMetrics,
)
from capability.model import EncodedText
from capability.result_cache import (
    ENTRY_OVERHEAD_BYTES,
    WARM_TEXTS_LIMIT,
    WARM_TEXTS_MAX_BYTES,
    ResultCache,
    WarmText,
    WarmTextsUnreadable,
    read_warm_texts,
)
from capability.server import CapabilityServer
from classify_common import interceptor
from classify_common.context import CACHE_SCOPE_HEADER
from tests.conftest import STRIKER, LineCollector, StartCapability, metric_sum, wait_until

MODEL = "topic-static"
# Bundle digests (SHA-256 of a manifest.json) for the ResultCache's own tests.
SERVING_DIGEST = "5e" * 32
RETIRED_DIGEST = "0d" * 32
OTHER = "Shares fell sharply after the bank reported lower quarterly profits"


def counted(server: CapabilityServer, name: str) -> float:
    return metric_sum(server.registry, name, model=MODEL)


def looked_up(server: CapabilityServer, outcome: str) -> float:
    """The model's texts the cache answered (CACHE_HIT) or did not (CACHE_MISS)."""
    return metric_sum(server.registry, CACHE_REQUESTS_TOTAL, model=MODEL, outcome=outcome)


async def cached_server(start_capability: StartCapability, **settings: object) -> CapabilityServer:
    return await start_capability(models=(MODEL,), result_cache_entries=1000, **settings)


async def test_the_same_text_twice_is_computed_once(start_capability: StartCapability) -> None:
    server = await cached_server(start_capability)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        forwards = counted(server, MODEL_FORWARD_TOTAL)
        first = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
        assert counted(server, MODEL_FORWARD_TOTAL) == forwards + 1
        second = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL, top_k=2))
        assert counted(server, MODEL_FORWARD_TOTAL) == forwards + 1
    assert list(second.labels) == list(first.labels)[:2]
    assert second.model == first.model
    assert second.request_id != first.request_id
    assert looked_up(server, CACHE_MISS) == 1
    assert looked_up(server, CACHE_HIT) == 1


async def test_batch_items_already_cached_never_reach_the_device(
    start_capability: StartCapability,
) -> None:
    server = await cached_server(start_capability)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        alone = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
        forwards = counted(server, MODEL_FORWARD_TOTAL)
        items = [
            pb.ClassifyRequest(text=STRIKER, model=MODEL),
            pb.ClassifyRequest(text=OTHER, model=MODEL),
            pb.ClassifyRequest(text=STRIKER, model=MODEL),
        ]
        batch = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items))
    # One forward, for the one text not cached.
    assert counted(server, MODEL_FORWARD_TOTAL) == forwards + 1
    assert [r.response.labels[0].name for r in batch.results] == ["sports", "business", "sports"]
    assert list(batch.results[0].response.labels) == list(alone.labels)
    assert list(batch.results[2].response.labels) == list(alone.labels)
    assert looked_up(server, CACHE_HIT) == 2


async def test_a_swap_never_serves_the_old_versions_result_and_refills_the_most_hit(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    shutil.copytree(model_root / MODEL / "1", root / MODEL / "1")
    server = await cached_server(start_capability, model_root=root)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        for text in (STRIKER, STRIKER, OTHER):  # STRIKER is hit once, OTHER never
            await stub.Classify(pb.ClassifyRequest(text=text, model=MODEL))

        shutil.copytree(root / MODEL / "1", root / MODEL / "2")
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        await models.ReloadModel(model_pb.ReloadModelRequest(name=MODEL, version="2"))
        await wait_until(lambda: counted(server, RESULT_CACHE_WARMED_TOTAL) == 1, "refilled")

        forwards = counted(server, MODEL_FORWARD_TOTAL)
        refilled = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
        assert refilled.model.version == "2"
        assert counted(server, MODEL_FORWARD_TOTAL) == forwards  # computed by the refill
        dropped = await stub.Classify(pb.ClassifyRequest(text=OTHER, model=MODEL))
        assert dropped.model.version == "2"
        assert counted(server, MODEL_FORWARD_TOTAL) == forwards + 1


async def test_no_cache_computes_every_text(start_capability: StartCapability) -> None:
    server = await start_capability(models=(MODEL,), result_cache_entries=0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        forwards = counted(server, MODEL_FORWARD_TOTAL)
        for _ in range(2):
            await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
    assert counted(server, MODEL_FORWARD_TOTAL) == forwards + 2
    assert looked_up(server, CACHE_HIT) == looked_up(server, CACHE_MISS)
    assert looked_up(server, CACHE_HIT) == 0


def test_the_least_recently_used_entry_leaves_first_when_bytes_run_out() -> None:
    def text(n: int) -> EncodedText:
        return EncodedText(ids=(101, n, 102), truncated=False)

    entry_bytes = ENTRY_OVERHEAD_BYTES + sys.getsizeof("x") + sys.getsizeof("") + 32 * (3 + 2)
    cache = ResultCache(
        CapabilityMetrics(CollectorRegistry()), max_entries=100, max_bytes=2 * entry_bytes, warm=0
    )
    cache.switch_bundle(MODEL, SERVING_DIGEST)
    for n in (1, 2):
        cache.store(MODEL, SERVING_DIGEST, "", text(n), "x", None, (0.5, 0.5))
    assert cache.lookup(MODEL, SERVING_DIGEST, "", text(1)) == (0.5, 0.5)  # now the most recent
    cache.store(MODEL, SERVING_DIGEST, "", text(3), "x", None, (0.5, 0.5))
    assert len(cache) == 2
    assert cache.size_bytes == 2 * entry_bytes
    assert cache.lookup(MODEL, SERVING_DIGEST, "", text(2)) is None
    assert cache.lookup(MODEL, SERVING_DIGEST, "", text(1)) is not None
    # A bundle not serving is neither stored nor found.
    cache.store(MODEL, RETIRED_DIGEST, "", text(4), "x", None, (0.5, 0.5))
    assert cache.lookup(MODEL, RETIRED_DIGEST, "", text(4)) is None


def test_a_text_is_counted_at_the_bytes_python_holds_it_in() -> None:
    """One character outside the Basic Multilingual Plane makes CPython hold every
    character of the text in 4 bytes: 400 KB for 100,000 characters, not 100 KB."""
    cache = ResultCache(
        CapabilityMetrics(CollectorRegistry()), max_entries=10, max_bytes=2**20, warm=0
    )
    cache.switch_bundle(MODEL, SERVING_DIGEST)
    text = "a" * 99_999 + "\N{GRINNING FACE}"
    encoded = EncodedText(ids=(101, 7, 102), truncated=False)
    cache.store(MODEL, SERVING_DIGEST, "", encoded, text, None, (0.5, 0.5))
    assert cache.size_bytes >= 400_000


def test_a_result_the_replaced_bundle_finishes_after_the_swap_is_never_kept() -> None:
    """The race a version-keyed cache loses when a bundle is rebuilt under the same
    version: the old bundle's batch ends after the new one serves."""
    striker = EncodedText(ids=(101, 7, 102), truncated=False)
    cache = ResultCache(
        CapabilityMetrics(CollectorRegistry()), max_entries=10, max_bytes=2**20, warm=0
    )
    cache.switch_bundle(MODEL, RETIRED_DIGEST)
    cache.switch_bundle(MODEL, SERVING_DIGEST)  # rebuilt, same version directory
    cache.store(MODEL, RETIRED_DIGEST, "", striker, "x", None, (0.9, 0.1))  # old batch ends
    assert len(cache) == 0
    assert cache.lookup(MODEL, SERVING_DIGEST, "", striker) is None
    assert cache.lookup(MODEL, RETIRED_DIGEST, "", striker) is None


async def test_a_bundle_rebuilt_under_the_same_version_never_serves_the_others_results(
    start_capability: StartCapability, model_root: Path, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    shutil.copytree(model_root / MODEL / "1", root / MODEL / "1")
    server = await cached_server(start_capability, model_root=root)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        before = (await models.GetModel(model_pb.GetModelRequest(name=MODEL))).model
        old, hit = [
            await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL)) for _ in range(2)
        ]
        assert hit.cached

        # Rebuilt: the same weights served at bf16 by default, a new manifest, the
        # same version directory "1".
        rebuilt = tmp_path / "rebuilt"
        shutil.copytree(root / MODEL / "1", rebuilt)
        config = json.loads((rebuilt / "config.json").read_text())
        config["precision"] = "bf16"
        (rebuilt / "config.json").write_text(json.dumps(config))
        write_manifest(rebuilt)
        shutil.rmtree(root / MODEL / "1")
        rebuilt.rename(root / MODEL / "1")
        reloaded = await models.ReloadModel(model_pb.ReloadModelRequest(name=MODEL, version="1"))
        assert (reloaded.model.version, reloaded.previous_version) == ("1", "1")
        assert reloaded.model.digest != before.digest

        # The old bundle's most hit text is computed again, by the rebuilt one.
        await wait_until(lambda: counted(server, RESULT_CACHE_WARMED_TOTAL) == 1, "refilled")
        forwards = counted(server, MODEL_FORWARD_TOTAL)
        refilled = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
        assert (refilled.cached, counted(server, MODEL_FORWARD_TOTAL)) == (True, forwards)
        bypass = pb.CACHE_POLICY_BYPASS
        computed = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL, cache=bypass))
    # The rebuilt bundle's scores (bf16) differ from the old one's, and the cache
    # answers with the rebuilt bundle's.
    assert [label.score for label in old.labels] != [label.score for label in computed.labels]
    assert list(refilled.labels) == list(computed.labels)


async def test_a_caller_may_bypass_the_cache_and_the_answer_says_where_it_came_from(
    start_capability: StartCapability,
) -> None:
    server = await cached_server(start_capability)
    bypass = pb.CACHE_POLICY_BYPASS
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        computed = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
        cached = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL))
        forwards = counted(server, MODEL_FORWARD_TOTAL)
        bypassed = await stub.Classify(pb.ClassifyRequest(text=STRIKER, model=MODEL, cache=bypass))
        items = [pb.ClassifyRequest(text=STRIKER, model=MODEL, cache=bypass)]
        batch = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items))
    assert counted(server, MODEL_FORWARD_TOTAL) == forwards + 2
    assert [computed.cached, cached.cached, bypassed.cached] == [False, True, False]
    assert not batch.results[0].response.cached
    # Neither looked up nor counted.
    assert looked_up(server, CACHE_HIT) == looked_up(server, CACHE_MISS)
    assert looked_up(server, CACHE_HIT) == 1


async def test_warm_texts_past_the_queue_capacity_are_all_computed_and_none_counted_refused(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    """40 warm texts for a queue of 8: fed in chunks that fit it, each computed; none
    is refused, and none reads as overload in classify_admissions_refused_total."""
    texts = [f"{STRIKER} in round {number}" for number in range(40)]
    (tmp_path / "hot.txt").write_text("\n".join(texts) + "\n")
    config = tmp_path / "models.yaml"
    config.write_text(f"{MODEL}:\n  warm_texts: hot.txt\n  queue_capacity: 8\n")
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    server = await cached_server(start_capability, model_config=config, per_model=per_model)
    await server.pool.wait_cache_refilled()
    assert counted(server, RESULT_CACHE_WARMED_TOTAL) == 40
    assert counted(server, ADMISSIONS_REFUSED_TOTAL) == 0
    assert len(server.pool.cache) == 40
    forwards = counted(server, MODEL_FORWARD_TOTAL)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        last = await stub.Classify(pb.ClassifyRequest(text=texts[-1], model=MODEL))
    assert last.cached
    assert counted(server, MODEL_FORWARD_TOTAL) == forwards


async def test_warm_texts_fill_the_cache_at_load_and_the_floor_is_exported(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    (tmp_path / "hot.txt").write_text(f"{STRIKER}\n\n{OTHER}\n")
    config = tmp_path / "models.yaml"
    config.write_text(f"{MODEL}:\n  warm_texts: hot.txt\n  cache_hit_floor: 0.9\n")
    per_model = CapabilitySettings(model_config=config).with_model_config().per_model
    assert per_model[MODEL].warm_texts == tmp_path / "hot.txt"
    server = await cached_server(start_capability, per_model=per_model)
    await wait_until(lambda: counted(server, RESULT_CACHE_WARMED_TOTAL) == 2, "warmed")
    assert counted(server, RESULT_CACHE_HIT_FLOOR) == 0.9
    forwards = counted(server, MODEL_FORWARD_TOTAL)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        answers = [
            await stub.Classify(pb.ClassifyRequest(text=text, model=MODEL))
            for text in (STRIKER, OTHER)
        ]
    assert [a.cached for a in answers] == [True, True]
    assert counted(server, MODEL_FORWARD_TOTAL) == forwards


def scoped(scope: str) -> tuple[tuple[str, str], ...]:
    return ((CACHE_SCOPE_HEADER, scope),)


async def test_one_scopes_result_never_answers_another_scope(
    start_capability: StartCapability,
) -> None:
    """What the orchestrator sends per tenant: in a Classify call's header, and per item
    of a ClassifyBatch call in its ItemContext."""
    server = await cached_server(start_capability)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        request = pb.ClassifyRequest(text=STRIKER, model=MODEL)
        first = await stub.Classify(request, metadata=scoped("a"))
        forwards = counted(server, MODEL_FORWARD_TOTAL)
        other = await stub.Classify(request, metadata=scoped("b"))
        unscoped = await stub.Classify(request)
        assert counted(server, MODEL_FORWARD_TOTAL) == forwards + 2
        repeat = await stub.Classify(request, metadata=scoped("a"))
        assert counted(server, MODEL_FORWARD_TOTAL) == forwards + 2
        items = [
            pb.ClassifyRequest(text=OTHER, model=MODEL),
            pb.ClassifyRequest(text=OTHER, model=MODEL),
            pb.ClassifyRequest(text=STRIKER, model=MODEL),
        ]
        await stub.Classify(pb.ClassifyRequest(text=OTHER, model=MODEL), metadata=scoped("a"))
        contexts = [pb.ItemContext(cache_scope=scope) for scope in ("a", "c", "b")]
        batch = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(items=items, item_contexts=contexts)
        )
    assert [first.cached, other.cached, unscoped.cached, repeat.cached] == [
        False,
        False,
        False,
        True,
    ]
    assert [r.response.cached for r in batch.results] == [True, False, True]


def test_a_swap_refills_each_text_into_its_scope_and_warm_texts_into_the_shared_one() -> None:
    striker = EncodedText(ids=(101, 7, 102), truncated=False)
    cache = ResultCache(
        CapabilityMetrics(CollectorRegistry()), max_entries=10, max_bytes=2**20, warm=10
    )
    cache.switch_bundle(MODEL, RETIRED_DIGEST)
    cache.store(MODEL, RETIRED_DIGEST, "a", striker, "x", None, (0.9, 0.1))
    assert cache.lookup(MODEL, RETIRED_DIGEST, "b", striker) is None
    assert cache.lookup(MODEL, RETIRED_DIGEST, "a", striker) == (0.9, 0.1)
    assert cache.switch_bundle(MODEL, SERVING_DIGEST) == [WarmText("x", None, "a")]
    # A warm_texts file's text (no scope: the shared one) answers every scope.
    (shared,) = [WarmText("y", None)]
    cache.store(MODEL, SERVING_DIGEST, shared.scope, striker, "y", None, (0.2, 0.8))
    assert cache.lookup(MODEL, SERVING_DIGEST, "a", striker) == (0.2, 0.8)
    assert cache.lookup(MODEL, SERVING_DIGEST, "", striker) == (0.2, 0.8)
    # A scope's own entry comes first.
    cache.store(MODEL, SERVING_DIGEST, "a", striker, "x", None, (0.9, 0.1))
    assert cache.lookup(MODEL, SERVING_DIGEST, "a", striker) == (0.9, 0.1)
    assert cache.lookup(MODEL, SERVING_DIGEST, "b", striker) == (0.2, 0.8)


async def test_a_cache_hits_log_line_names_the_model_that_answered(
    start_capability: StartCapability,
    interceptor_log: LineCollector,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A computed answer's `rpc` line names its model, version and worker; a cache hit's
    named none of them."""
    server = await cached_server(start_capability)
    caplog.set_level(logging.INFO, logger=interceptor.__name__)  # the "rpc" lines
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        for request_id in ("computed-1", "cached-1"):
            await stub.Classify(
                pb.ClassifyRequest(text=STRIKER, model=MODEL, request_id=request_id)
            )
    lines = {
        line["request_id"]: line
        for line in map(json.loads, interceptor_log.lines)
        if line["event"] == "rpc" and "request_id" in line
    }
    assert looked_up(server, CACHE_HIT) == 1  # the second call was the hit
    computed, cached = lines["computed-1"], lines["cached-1"]
    for field in ("model", "model_version", "worker"):
        assert cached[field] == computed[field], field
    assert cached["model"] == MODEL


async def test_both_cache_outcomes_are_exported_at_zero_once_a_version_serves(
    start_capability: StartCapability,
) -> None:
    """The `hit` series appeared at the first hit: with nothing hitting, the hit ratio
    had no value and ClassifyResultCacheHitRatioLow could never fire."""
    server = await cached_server(start_capability)
    for outcome in (CACHE_HIT, CACHE_MISS):
        labels = {"model": MODEL, "outcome": outcome}
        assert server.registry.get_sample_value(CACHE_REQUESTS_TOTAL, labels) == 0


def test_a_warm_texts_file_is_read_to_its_byte_cap_in_whole_lines(tmp_path: Path) -> None:
    """Read line by line, a line with no end (a file of one endless line, a device)
    was read whole into memory before its text was cut to 100,000 characters."""
    hot = tmp_path / "hot.txt"
    with hot.open("wb") as out:
        out.write(b"first\r\n\nsecond\rthird\x0cstill third\n")
        out.write(b"x" * WARM_TEXTS_MAX_BYTES)  # no line break before the cap
    assert read_warm_texts(hot) == [
        WarmText("first", None),
        WarmText("second", None),
        WarmText("third\x0cstill third", None),
    ]


def test_a_warm_texts_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    hot = tmp_path / "hot.txt"
    hot.write_bytes("ok\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(WarmTextsUnreadable) as refused:
        read_warm_texts(hot)
    assert str(refused.value) == (
        f"{hot}: warm_texts file is not UTF-8 text (byte 0xe9 on line 2: unexpected end of data)"
    )


def test_a_bad_byte_past_the_last_text_used_is_never_read(tmp_path: Path) -> None:
    """Read by line, a file stopped at its 10,000th text; decoded in one block, the bytes
    after it refused a file that had loaded before."""
    hot = tmp_path / "hot.txt"
    hot.write_bytes(b"".join(b"text %d\n" % n for n in range(WARM_TEXTS_LIMIT)) + b"caf\xe9\n")
    texts = read_warm_texts(hot)
    assert (len(texts), texts[-1].text) == (WARM_TEXTS_LIMIT, f"text {WARM_TEXTS_LIMIT - 1}")

"""The capability's result cache answers a tenant only with its own results: over a real
orchestrator (two tenants' keys, the internal token) in front of a capability with the
cache on, another tenant's identical text is computed again (`cached: false`, a
forward), a tenant's own repeat is not, a caller cannot name another tenant's scope
in its ClassifyBatch's item_contexts, a merged upstream call keeps each item's
scope, and so does a shadow call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.metrics import CLASSIFY_BATCH_METHOD, MODEL_FORWARD_TOTAL, RPC_ITEMS
from capability.server import CapabilityServer
from classify_common.context import cache_scope_of
from orchestrator.metrics import SHADOW_COMPARISONS_TOTAL
from orchestrator.security import hash_key
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, StartCapability, metric_sum, orchestrator_settings, wait_until
from tests.unit.capability.test_serving import device_occupied
from tests.unit.orchestrator.test_result_isolation import (
    ACME,
    ACME_KEY,
    ZENITH,
    ZENITH_KEY,
    acme_and_zenith_front_door,
)

MODEL = "topic-static"
SHARES = "Shares fell sharply after the bank cut its profit forecast"
TOKEN = "internal-token-for-cache-scope-tests"


@contextlib.asynccontextmanager
async def two_tenants(
    start_capability: StartCapability, tmp_path: Path
) -> AsyncIterator[tuple[classify_service_pb2_grpc.ClassifyServiceAsyncStub, CapabilityServer]]:
    """A stub for an orchestrator with tenants `acme` and `zenith`, in front of a
    capability with the result cache on; both require the internal token."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    capability = await start_capability(
        models=(MODEL,), result_cache_entries=1000, internal_token_file=token_file
    )
    async with acme_and_zenith_front_door(
        tmp_path, MODEL, capability.port, internal_token_file=token_file
    ) as stub:
        yield stub, capability


def forwards(capability: CapabilityServer) -> float:
    return metric_sum(capability.registry, MODEL_FORWARD_TOTAL, model=MODEL)


async def test_another_tenants_identical_text_is_computed_and_the_own_repeat_is_cached(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    async with two_tenants(start_capability, tmp_path) as (stub, capability):
        request = pb.ClassifyRequest(text=STRIKER)
        first = await stub.Classify(request, metadata=ACME)
        before = forwards(capability)
        other_tenant = await stub.Classify(request, metadata=ZENITH)
        assert forwards(capability) == before + 1
        repeat = await stub.Classify(request, metadata=ACME)
        other_repeat = await stub.Classify(request, metadata=ZENITH)
        assert forwards(capability) == before + 1
    assert [first.cached, other_tenant.cached] == [False, False]
    assert [repeat.cached, other_repeat.cached] == [True, True]
    assert list(other_tenant.labels) == list(first.labels)


async def test_a_callers_item_contexts_cannot_name_another_tenants_scope(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    async with two_tenants(start_capability, tmp_path) as (stub, capability):
        await stub.Classify(pb.ClassifyRequest(text=STRIKER), metadata=ACME)
        await stub.Classify(pb.ClassifyRequest(text=SHARES), metadata=ACME)
        before = forwards(capability)
        batch_items = metric_sum(
            capability.registry, f"{RPC_ITEMS}_sum", method=CLASSIFY_BATCH_METHOD
        )
        # Both items go up as one ClassifyBatch, whose ItemContexts the orchestrator makes.
        probe = pb.ClassifyBatchRequest(
            items=[pb.ClassifyRequest(text=STRIKER), pb.ClassifyRequest(text=SHARES)],
            item_contexts=[pb.ItemContext(cache_scope=cache_scope_of("acme"))] * 2,
        )
        answer = await stub.ClassifyBatch(probe, metadata=ZENITH)
        assert (
            metric_sum(capability.registry, f"{RPC_ITEMS}_sum", method=CLASSIFY_BATCH_METHOD)
            == batch_items + 2
        )
    assert [result.response.cached for result in answer.results] == [False, False]
    assert forwards(capability) > before


async def test_a_callers_cache_scope_is_ignored_whatever_its_length(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    """Over the 256 characters the contract allows a scope: the front door sets the
    scope itself, so what the caller sent is not checked either."""
    async with two_tenants(start_capability, tmp_path) as (stub, _):
        answer = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(
                items=[pb.ClassifyRequest(text=STRIKER)],
                item_contexts=[pb.ItemContext(cache_scope="s" * 300)],
            ),
            metadata=ACME,
        )
    assert answer.results[0].response.labels[0].name == "sports"


async def test_a_merged_upstream_call_keeps_each_items_tenant_scope(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    """acme's text is cached; then, while a call is in flight (the device held), acme and
    zenith send it again: the two gather and leave as one ClassifyBatch, and only acme's
    item is answered from the cache."""
    async with two_tenants(start_capability, tmp_path) as (stub, capability):
        await stub.Classify(pb.ClassifyRequest(text=STRIKER), metadata=ACME)
        batch_items = metric_sum(
            capability.registry, f"{RPC_ITEMS}_sum", method=CLASSIFY_BATCH_METHOD
        )
        async with device_occupied(capability.pool.workers[0]):
            in_flight = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=SHARES), metadata=ACME)
            )
            await asyncio.sleep(0.2)
            acme = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER), metadata=ACME)
            )
            zenith = asyncio.ensure_future(
                stub.Classify(pb.ClassifyRequest(text=STRIKER), metadata=ZENITH)
            )
            await asyncio.sleep(0.2)
        await in_flight
        acme_answer, zenith_answer = await acme, await zenith
        merged = metric_sum(capability.registry, f"{RPC_ITEMS}_sum", method=CLASSIFY_BATCH_METHOD)
    assert merged == batch_items + 2
    assert (acme_answer.cached, zenith_answer.cached) == (True, False)


async def test_a_shadow_call_is_cached_in_its_callers_scope(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    """acme's call to topic-minilm is shadowed to topic-static: the shadow's answer is kept
    in acme's scope (acme's own topic-static call for the text is a cache hit), not in
    that of the anonymous caller, which a keys file may name a real tenant after (here
    zenith's key is tenant `anonymous`: it never sent the text, so it must not hit)."""
    capability = await start_capability(models=("topic-minilm", MODEL), result_cache_entries=1000)
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{id: a, sha256: {hash_key(ACME_KEY)}, tenant: acme, role: user}}\n"
        f"  - {{id: z, sha256: {hash_key(ZENITH_KEY)}, tenant: anonymous, role: user}}\n"
    )
    target = f"127.0.0.1:{capability.port}"
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"""version: 1
backends:
  minilm: {{model: topic-minilm, targets: ["{target}"]}}
  static: {{model: {MODEL}, targets: ["{target}"]}}
routes:
  - {{name: static, match: {{model: {MODEL}}}, backend: static}}
  - name: default
    backend: minilm
    shadow: {{backend: static, percent: 100}}
"""
    )
    server = OrchestratorServer(
        orchestrator_settings(
            routes_file=routes, routes_poll_seconds=0, auth="required", api_keys_file=keys
        ),
        registry=CollectorRegistry(),
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            await stub.Classify(pb.ClassifyRequest(text=STRIKER), metadata=ACME)
            await wait_until(
                lambda: metric_sum(server.registry, SHADOW_COMPARISONS_TOTAL) == 1,
                "the shadow call compared",
            )
            direct = pb.ClassifyRequest(text=STRIKER, model=MODEL)
            anonymous_tenant = await stub.Classify(direct, metadata=ZENITH)
            acme = await stub.Classify(direct, metadata=ACME)
    finally:
        await server.stop(grace_seconds=0)
    assert (anonymous_tenant.cached, acme.cached) == (False, True)

"""Each lifecycle node emits exactly the span attributes its row in the node table
lists, through real servers: a plain call, an invalid one, a retried and fallen-back
one, a rate-limited tenant's, a ClassifyBatch straight to a capability server, and
a result-cache hit; and the keys are spelled only beside the table."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Sequence

import grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.nodes import (
    ANY_NODE_ATTRIBUTES,
    CLASSIFY_BATCH_INDEX,
    CLASSIFY_REQUEST_ID,
    NODES,
    RPC_SYSTEM_NAME,
    UPSTREAM_CLIENT_ATTRIBUTES,
)
from orchestrator.server import OrchestratorServer
from tests.conftest import REPO_ROOT, STRIKER, StartCapability, StartOrchestrator, wait_until
from tests.unit.capability.test_classify_batch import classify_batch
from tests.unit.orchestrator.test_policy import (
    dead_primary_with_fallback,
)
from tests.unit.orchestrator.test_security import ACME_KEY, Start, bearer, secured  # noqa: F401

LISTED = {n.name: set(n.attributes) for n in NODES}


async def classify(
    port: int, text: str = STRIKER, metadata: Sequence[tuple[str, str]] = ()
) -> grpc.StatusCode:
    """The code a Classify call of `text` ends with."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        try:
            await stub.Classify(pb.ClassifyRequest(text=text), metadata=metadata, timeout=30)
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK


def emitted_keys(spans: Sequence[ReadableSpan]) -> dict[str, set[str]]:
    """Each node's attribute keys over `spans`, less those any node may carry (a failed
    node's code and reason, the timeout mark) that its row does not list."""
    keys: dict[str, set[str]] = defaultdict(set)
    for span in spans:
        if span.name in LISTED:
            any_node = set(ANY_NODE_ATTRIBUTES) - LISTED[span.name]
            keys[span.name] |= set(span.attributes or {}) - any_node
    return keys


async def test_every_node_emits_the_attributes_its_table_row_lists(
    orchestrator: OrchestratorServer,
    capability: CapabilityServer,
    capability_stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    orchestrator_with: StartOrchestrator,
    secured: Start,  # noqa: F811
    start_capability: StartCapability,
    span_exporter: InMemorySpanExporter,
) -> None:
    before = len(span_exporter.get_finished_spans())
    ok, invalid = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
    assert await classify(orchestrator.port) == ok
    # input_validate's violation fields
    assert await classify(orchestrator.port, text=" ") == invalid
    retried = await orchestrator_with(dead_primary_with_fallback(capability.port))
    assert await classify(retried.port) == ok  # upstream_call's retry and fallback reasons
    limited, internal = await secured("tenants:\n  acme: {rate_per_second: 1, burst: 5}\n")
    assert await classify(limited.port, metadata=bearer(ACME_KEY)) == ok  # tokens_left
    # The receive nodes' mark of a large message left unread: no key, no token.
    for refusing in (limited, internal):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{refusing.port}") as channel:
            raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                "/ai.classify.v1.ClassifyService/ClassifyBatch"
            )
            with contextlib.suppress(grpc.aio.AioRpcError):
                await raw(b"\x0a\x00" * 40_000, timeout=30)
    # An item's own capability_receive: its index, and its violations when refused.
    await classify_batch(capability_stub, [pb.ClassifyRequest(text=STRIKER), pb.ClassifyRequest()])
    # capability_receive's violation fields, on a whole call
    assert await classify(capability.port, text="") == invalid
    # queue_admit's cache mark and the device nodes' skipped mark, on a cache hit
    cached = await start_capability(
        models=("topic-static",), default_model="topic-static", result_cache_entries=100
    )
    assert [await classify(cached.port) for _ in range(2)] == [ok, ok]

    keys: dict[str, set[str]] = {}

    def all_listed_emitted() -> bool:
        nonlocal keys
        keys = emitted_keys(span_exporter.get_finished_spans()[before:])
        return keys == LISTED

    # Server spans and device nodes end after the answers; what is missing by the
    # limit is reported below.
    with contextlib.suppress(AssertionError):
        await wait_until(all_listed_emitted, "every listed key emitted", limit_seconds=3)
    unlisted = {name: sorted(keys[name] - LISTED[name]) for name in keys}
    never = {name: sorted(LISTED[name] - keys.get(name, set())) for name in LISTED}
    assert {name: found for name, found in unlisted.items() if found} == {}
    assert {name: missing for name, missing in never.items() if missing} == {}


def test_span_attribute_keys_are_spelled_only_beside_the_node_table() -> None:
    """Emit sites use the constants in classify_common.nodes, never the keys' text."""
    keys = {key for n in NODES for key in n.attributes} | set(ANY_NODE_ATTRIBUTES)
    keys |= {RPC_SYSTEM_NAME, CLASSIFY_REQUEST_ID, CLASSIFY_BATCH_INDEX}
    keys |= set(UPSTREAM_CLIENT_ATTRIBUTES)
    # The dotted ones: "timeout" is also a message field's name (HasField("timeout")).
    keys = {key for key in keys if "." in key}
    root = REPO_ROOT
    spelled = [
        f"{path.relative_to(root)}: {key}"
        for package in ("capability", "orchestrator", "classify_common")
        for path in sorted((root / package).rglob("*.py"))
        if path.name != "nodes.py"
        for key in sorted(keys)
        if f'"{key}"' in path.read_text()
    ]
    assert spelled == []

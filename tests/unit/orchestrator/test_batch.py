"""ClassifyBatch through a real orchestrator and a real capability server: every item is
answered on its own, in order, with its own route, fallback and error."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.metrics import MODEL_TEXTS_TOTAL
from capability.server import CapabilityServer
from classify_common.context import is_valid_request_id
from orchestrator import batch_items
from orchestrator.metrics import (
    MODEL_FALLBACK_TOTAL,
    RATE_LIMITED_ITEMS_TOTAL,
    RATE_LIMITED_TOTAL,
)
from orchestrator.security.keys import hash_key
from orchestrator.server import OrchestratorServer
from tests.conftest import (
    STRIKER,
    LineCollector,
    StartCapability,
    StartOrchestrator,
    closed_port,
    metric_sum,
    orchestrator_for,
    orchestrator_settings,
    wait_until,
    write_routes,
)
from tests.status_details import error_reason, refusal, trailers_of, unpack, violations_of
from tests.unit.capability.test_serving import device_occupied

SHARES = "Shares fell sharply after the bank cut its profit forecast"


def item_violations(status: status_pb2.Status) -> list[tuple[str, str]]:
    return [
        (v.field, v.reason)
        for bad in unpack(status, error_details_pb2.BadRequest)
        for v in bad.field_violations
    ]


def item_error_info(status: status_pb2.Status) -> error_details_pb2.ErrorInfo:
    (info,) = unpack(status, error_details_pb2.ErrorInfo)
    return info


async def classify_batch(
    port: int, items: list[pb.ClassifyRequest], **kwargs: object
) -> pb.ClassifyBatchResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response: pb.ClassifyBatchResponse = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(items=items, **kwargs),  # type: ignore[arg-type]
            timeout=30,
        )
        return response


async def test_one_invalid_item_is_refused_with_its_field_and_the_others_are_answered(
    orchestrator: OrchestratorServer,
) -> None:
    response = await classify_batch(
        orchestrator.port,
        [
            pb.ClassifyRequest(text=STRIKER, request_id="item-0"),
            pb.ClassifyRequest(text="   ", top_k=0, request_id="item-1"),
            pb.ClassifyRequest(text=SHARES, top_k=2),
        ],
    )
    assert len(response.results) == 3
    first, bad, last = response.results
    assert first.WhichOneof("outcome") == "response"
    assert first.response.request_id == "item-0"
    assert first.response.labels[0].name == "sports"
    assert first.response.status == pb.RESULT_STATUS_DONE
    assert last.WhichOneof("outcome") == "response"
    assert last.response.labels[0].name == "business"
    assert len(last.response.labels) == 2
    assert last.response.request_id  # generated for an item that sent none
    assert last.response.request_id != first.response.request_id

    assert bad.WhichOneof("outcome") == "error"
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert item_violations(bad.error) == [
        ("items[1].text", "text.not_blank"),
        ("items[1].top_k", "int32.gte_lte"),
    ]
    info = item_error_info(bad.error)
    assert info.reason == "INVALID_REQUEST"
    assert info.metadata["x-request-id"] == "item-1"
    assert info.metadata["x-trace-id"] == first.response.trace_id


def with_bytes(message: pb.ClassifyBatchRequest, *swaps: tuple[bytes, bytes]) -> bytes:
    """`message` on the wire with each marker (`swaps`: marker, bytes of the same length)
    replaced: strings that are not UTF-8, as a C++ client, which checks only in debug
    builds, sends them (Python's protobuf refuses to encode them)."""
    raw = message.SerializeToString()
    for marker, replacement in swaps:
        assert raw.count(marker) == 1
        assert len(replacement) == len(marker)
        raw = raw.replace(marker, replacement)
    return raw


async def classify_batch_raw(port: int, raw: bytes) -> pb.ClassifyBatchResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/ai.classify.v1.ClassifyService/ClassifyBatch"
        )
        return pb.ClassifyBatchResponse.FromString(await call(raw, timeout=30))


async def test_an_item_whose_strings_are_not_utf8_is_refused_alone_naming_them(
    either_server: OrchestratorServer | CapabilityServer,
) -> None:
    """protobuf refuses a whole message for one string that is not UTF-8, without
    saying which: an item read from a Latin-1 file failed the other items of its
    batch, as `wire_format` with no field."""
    port = either_server.port
    message = pb.ClassifyBatchRequest(
        items=[
            pb.ClassifyRequest(text=STRIKER, request_id="item-0"),
            pb.ClassifyRequest(text="Caf# prices rose again", request_id="item-1"),
            pb.ClassifyRequest(text=SHARES, request_id="item#2"),
        ]
    )
    raw = with_bytes(message, (b"Caf#", b"Caf\xe9"), (b"item#2", b"item\xff2"))
    with pytest.raises(DecodeError):  # what a server's plain decoding makes of it
        pb.ClassifyBatchRequest.FromString(raw)

    first, bad_text, bad_id = (await classify_batch_raw(port, raw)).results
    assert first.response.request_id == "item-0"
    assert first.response.labels[0].name == "sports"
    for bad in (bad_text, bad_id):
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert item_error_info(bad.error).metadata["x-trace-id"] == first.response.trace_id
    assert item_violations(bad_text.error) == [("items[1].text", "utf8")]
    assert "byte 0xe9 at offset 3" in str(bad_text.error.details)
    assert item_error_info(bad_text.error).metadata["x-request-id"] == "item-1"
    # Only the UTF-8 rule: not the ID pattern its stand-in (U+FFFD) breaks; the item is
    # answered under a fresh ID, as one whose request_id breaks the pattern.
    assert item_violations(bad_id.error) == [("items[2].request_id", "utf8")]
    assert is_valid_request_id(item_error_info(bad_id.error).metadata["x-request-id"])


async def test_an_item_context_that_is_not_utf8_refuses_its_item(
    capability: CapabilityServer,
) -> None:
    message = pb.ClassifyBatchRequest(
        items=[pb.ClassifyRequest(text=STRIKER)],
        item_contexts=[pb.ItemContext(cache_scope="tenant#")],
    )
    # An item's context belongs to its item, as violations of its rules do.
    (answer,) = (
        await classify_batch_raw(capability.port, with_bytes(message, (b"#", b"\x80")))
    ).results
    assert item_violations(answer.error) == [("item_contexts[0].cache_scope", "utf8")]


async def test_a_cache_scope_the_front_door_ignores_refuses_nothing_for_its_bytes(
    orchestrator: OrchestratorServer,
) -> None:
    """The orchestrator sets each item's scope from the caller's tenant and ignores the
    caller's: bytes in it that are not UTF-8 still got the item refused (`utf8`)."""
    message = pb.ClassifyBatchRequest(
        items=[pb.ClassifyRequest(text=STRIKER), pb.ClassifyRequest(text="Caf# prices rose")],
        item_contexts=[pb.ItemContext(cache_scope="tenant#"), pb.ItemContext()],
    )
    raw = with_bytes(message, (b"tenant#", b"tenant\x80"), (b"Caf#", b"Caf\xe9"))
    served, bad_text = (await classify_batch_raw(orchestrator.port, raw)).results
    assert served.response.labels[0].name == "sports"
    # Another item's string is still refused as before.
    assert item_violations(bad_text.error) == [("items[1].text", "utf8")]


async def test_batch_answers_equal_single_answers(orchestrator: OrchestratorServer) -> None:
    texts = [STRIKER, SHARES, "A new telescope found water on a distant planet"]
    batch = await classify_batch(orchestrator.port, [pb.ClassifyRequest(text=t) for t in texts])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        singles = [await stub.Classify(pb.ClassifyRequest(text=t), timeout=30) for t in texts]
    for result, single in zip(batch.results, singles, strict=True):
        batched = result.response.labels
        assert [label.name for label in batched] == [label.name for label in single.labels]
        assert [label.score for label in batched] == pytest.approx(
            [label.score for label in single.labels], abs=1e-5
        )
        assert result.response.model == single.model


async def test_a_broken_batch_fails_whole_naming_the_batch_rule(
    orchestrator: OrchestratorServer,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await classify_batch(
            orchestrator.port,
            [pb.ClassifyRequest(text=STRIKER)] * 2,
            item_contexts=[pb.ItemContext()],
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Named on the field the rule checks (protovalidate reports a rule on the whole
    # message with no field).
    assert violations_of(refused.value) == [("item_contexts", "item_contexts.count")]
    assert refused.value.details() == (
        "invalid request: item_contexts: must be empty or hold one entry per item"
    )

    with pytest.raises(grpc.aio.AioRpcError) as too_long:
        await classify_batch(orchestrator.port, [pb.ClassifyRequest(text="x" * 100_000)] * 11)
    assert violations_of(too_long.value) == [("items", "items.total_chars")]

    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await classify_batch(orchestrator.port, [])
    assert violations_of(empty.value) == [("items", "repeated.min_items")]


async def test_an_oversized_batch_is_refused_before_any_item_is_checked(
    orchestrator: OrchestratorServer,
) -> None:
    """Under gRPC's 8 MiB a call holds over a million tiny items: checked one by one
    against the contract, they held the event loop for 6 s before the count refused
    the call. The size rules now come first, alone: nothing else of the call is
    looked at (its mismatched item_contexts and empty texts go unreported)."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await classify_batch(
            orchestrator.port,
            [pb.ClassifyRequest(text="")] * 200_000,
            item_contexts=[pb.ItemContext()],
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations_of(refused.value) == [("items", "repeated.max_items")]
    # The same for item_contexts: each has rules of its own, and a million empty ones
    # fit in 2 MB; one item beside them passed the items' count.
    with pytest.raises(grpc.aio.AioRpcError) as contexts:
        await classify_batch(
            orchestrator.port,
            [pb.ClassifyRequest(text=STRIKER)],
            item_contexts=[pb.ItemContext(cache_scope="x")] * 200_000,
        )
    assert violations_of(contexts.value) == [("item_contexts", "repeated.max_items")]
    assert (
        refused.value.details() == "invalid request: items: must contain no more than 1024 item(s)"
    )


async def test_items_take_their_own_routes_and_one_falls_back(
    orchestrator_with: StartOrchestrator,
    capability: CapabilityServer,
) -> None:
    """Items with the `topic-static` hint take the static route; the others take the
    default route, whose primary is down and whose fallback answers."""
    server = await orchestrator_with(
        f"""version: 1
backends:
  minilm-dead:
    model: topic-minilm
    targets: ["127.0.0.1:{closed_port()}"]
  minilm:
    model: topic-minilm
    targets: ["127.0.0.1:{capability.port}"]
  static:
    model: topic-static
    targets: ["127.0.0.1:{capability.port}"]
routes:
  - name: static
    match: {{model: topic-static}}
    backend: static
  - name: default
    backend: minilm-dead
    fallback: [minilm]
    retry: {{max_attempts: 1}}
"""
    )
    response = await classify_batch(
        server.port,
        [
            pb.ClassifyRequest(text=STRIKER, model="topic-static"),
            pb.ClassifyRequest(text=STRIKER),
            pb.ClassifyRequest(text=SHARES, model="topic-static"),
        ],
    )
    static_one, fell_back, static_two = (r.response for r in response.results)
    assert (static_one.route, static_one.model.name, static_one.fallback) == (
        "static",
        "topic-static",
        False,
    )
    assert (fell_back.route, fell_back.model.name, fell_back.fallback) == (
        "default",
        "topic-minilm",
        True,
    )
    assert fell_back.labels[0].name == "sports"
    assert (static_two.route, static_two.fallback) == ("static", False)
    fallbacks = metric_sum(
        server.registry, MODEL_FALLBACK_TOTAL, route="default", **{"from": "minilm-dead"}
    )
    assert fallbacks == 1


async def test_an_item_whose_own_timeout_is_spent_gets_deadline_exceeded_alone(
    orchestrator: OrchestratorServer,
) -> None:
    spent = pb.ItemContext(timeout=duration_pb2.Duration(nanos=1000))  # 1 µs
    response = await classify_batch(
        orchestrator.port,
        [pb.ClassifyRequest(text=STRIKER), pb.ClassifyRequest(text=SHARES)],
        item_contexts=[pb.ItemContext(), spent],
    )
    ok, late = response.results
    assert ok.response.labels[0].name == "sports"
    assert late.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert item_error_info(late.error).reason == "DEADLINE_EXPIRED"


@contextlib.asynccontextmanager
async def front_door_for_a_small_tenant(
    capability: CapabilityServer, directory: Path
) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator whose key `limited-secret` is tenant `small`'s: three calls, then
    (at 0.001 a second) none."""
    routes = write_routes(directory / "routes.yaml", [f"127.0.0.1:{capability.port}"])
    keys = directory / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{id: limited, sha256: {hash_key('limited-secret')}, tenant: small, role: user}}\n"
        "tenants:\n  small: {rate_per_second: 0.001, burst: 3}\n"
    )
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, auth="required", api_keys_file=keys),
        registry=CollectorRegistry(),
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_seconds=0)


async def test_rate_limit_counts_every_item_and_refuses_only_those_over_it(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    async with (
        front_door_for_a_small_tenant(capability, tmp_path) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        # The last item is blank as well: a single call of it would have been refused
        # for the rate limit, which is checked before the text is.
        items = [pb.ClassifyRequest(text=STRIKER)] * 4 + [pb.ClassifyRequest(text=" ")]
        response = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(items=items),
            metadata=(("authorization", "Bearer limited-secret"),),
            timeout=30,
        )
        codes = [r.error.code if r.HasField("error") else 0 for r in response.results]
        assert codes == [0, 0, 0, *[grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]] * 2]
        assert item_error_info(response.results[4].error).reason == "RATE_LIMITED"
        retry = unpack(response.results[4].error, error_details_pb2.RetryInfo)
        assert len(retry) == 1
        # Two items refused, in a call that was served: no call was refused whole
        # (what the SLO leaves out of its errors counts calls, as requests do).
        assert metric_sum(server.registry, RATE_LIMITED_ITEMS_TOTAL, tenant="small") == 2
        assert metric_sum(server.registry, RATE_LIMITED_TOTAL, tenant="small") == 0
        # The bucket is empty now: the next call is refused whole.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ClassifyBatch(
                pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=STRIKER)]),
                metadata=(("authorization", "Bearer limited-secret"),),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert metric_sum(server.registry, RATE_LIMITED_TOTAL, tenant="small") == 1
        assert metric_sum(server.registry, RATE_LIMITED_ITEMS_TOTAL, tenant="small") == 3


async def test_an_item_over_the_rate_that_repeats_a_request_id_is_counted_as_answered(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """The fourth item is past the tenant's three and repeats the first's request_id: it
    is answered for the repeat (INVALID_ARGUMENT), so the items refused for the rate
    are the fifth alone (it was counted for the rate as well)."""
    async with (
        front_door_for_a_small_tenant(capability, tmp_path) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        items = [pb.ClassifyRequest(text=STRIKER, request_id=name) for name in "xyzxw"]
        response = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(items=items),
            metadata=(("authorization", "Bearer limited-secret"),),
            timeout=30,
        )
        codes = [r.error.code if r.HasField("error") else 0 for r in response.results]
        assert codes == [
            0,
            0,
            0,
            grpc.StatusCode.INVALID_ARGUMENT.value[0],
            grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        ]
        assert metric_sum(server.registry, RATE_LIMITED_ITEMS_TOTAL, tenant="small") == 1


BROKEN_BATCHES = {
    "too-many-items": pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=STRIKER)] * 1025),
    "contexts-do-not-match": pb.ClassifyBatchRequest(
        items=[pb.ClassifyRequest(text=STRIKER)] * 5, item_contexts=[pb.ItemContext()] * 3
    ),
    "too-many-characters": pb.ClassifyBatchRequest(
        items=[pb.ClassifyRequest(text="word " * 20_000)] * 11
    ),
}


@pytest.mark.parametrize("broken", list(BROKEN_BATCHES))
async def test_a_batch_refused_whole_is_charged_as_one_call(
    capability: CapabilityServer, tmp_path: Path, broken: str
) -> None:
    """A batch that breaks a batch rule serves nothing: one token of the tenant's three
    is spent, not one per item (all three), so a batch of two still goes through."""
    key = (("authorization", "Bearer limited-secret"),)
    async with front_door_for_a_small_tenant(capability, tmp_path) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ClassifyBatch(BROKEN_BATCHES[broken], metadata=key, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            response = await stub.ClassifyBatch(
                pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=STRIKER)] * 2),
                metadata=key,
                timeout=30,
            )
        assert [result.WhichOneof("outcome") for result in response.results] == [
            "response",
            "response",
        ]
        assert metric_sum(server.registry, RATE_LIMITED_TOTAL, tenant="small") == 0


async def test_a_batch_whose_deadline_comes_first_answers_every_item_in_time(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """200 items, the device held for longer than the call's 3 s: the call still answers
    OK before its deadline, each item with its own outcome and IDs (those not answered
    when the call's answer is due are DEADLINE_EXCEEDED), not a bare DEADLINE_EXCEEDED
    for the whole call. A fresh orchestrator: its first large call, with nothing
    measured yet to size the time kept for answering late items."""
    items = [
        pb.ClassifyRequest(text=f"{STRIKER} {index}", request_id=f"i-{index}")
        for index in range(200)
    ]
    async with (
        orchestrator_for(capability, tmp_path) as orchestrator,
        grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel,
    ):
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        async with device_occupied(capability.pool.workers[0]):
            response = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), timeout=3)
    codes = collections.Counter(
        grpc.StatusCode.DEADLINE_EXCEEDED if result.error.code == 4 else result.error.code
        for result in response.results
    )
    assert len(response.results) == 200
    assert codes[grpc.StatusCode.DEADLINE_EXCEEDED] >= 1
    assert set(codes) <= {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
    }
    for index, result in enumerate(response.results):
        info = item_error_info(result.error)
        assert info.metadata["x-request-id"] == f"i-{index}"
        assert len(info.metadata["x-trace-id"]) == 32


async def test_an_item_with_an_invalid_request_id_is_answered_under_a_fresh_one(
    orchestrator: OrchestratorServer,
) -> None:
    """As a single call is: the bad ID is named in the violation, not echoed as the ID."""
    response = await classify_batch(
        orchestrator.port,
        [
            pb.ClassifyRequest(text=STRIKER, request_id="mine-1"),
            pb.ClassifyRequest(text=SHARES, request_id="-not an id"),
        ],
    )
    good, bad = response.results
    assert good.response.request_id == "mine-1"
    assert item_violations(bad.error) == [("items[1].request_id", "string.pattern")]
    fresh = item_error_info(bad.error).metadata["x-request-id"]
    assert fresh != "-not an id"
    assert is_valid_request_id(fresh)


async def test_a_batch_due_at_once_answers_every_item_without_starting_them(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """1,000 items with 0.4 s: answering them all takes longer than is left (50 ms, then
    0.4 ms an item on a fresh orchestrator, which has measured no call yet, and the
    margin), so none is started and each is DEADLINE_EXCEEDED with IDs."""
    texts_before = metric_sum(capability.registry, MODEL_TEXTS_TOTAL)
    items = [pb.ClassifyRequest(text=f"{STRIKER} {index}") for index in range(999)]
    items.append(pb.ClassifyRequest(text=STRIKER, request_id="last"))
    async with (
        orchestrator_for(capability, tmp_path) as orchestrator,
        grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel,
    ):
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), timeout=0.4)
    assert len(response.results) == 1000
    assert {result.error.code for result in response.results} == {
        grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    }
    request_ids = [item_error_info(r.error).metadata["x-request-id"] for r in response.results]
    assert request_ids[-1] == "last"
    assert len(set(request_ids)) == 1000
    assert metric_sum(capability.registry, MODEL_TEXTS_TOTAL) == texts_before


async def test_a_failed_item_is_logged_under_its_own_ids_naming_its_call(
    orchestrator: OrchestratorServer,
) -> None:
    collector = LineCollector()
    items_log = logging.getLogger(batch_items.__name__)
    items_log.addHandler(collector)
    level = items_log.level
    items_log.setLevel(logging.INFO)  # the line is INFO, as the servers' access lines
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            call = stub.ClassifyBatch(
                pb.ClassifyBatchRequest(
                    items=[
                        pb.ClassifyRequest(text=STRIKER, request_id="fine"),
                        pb.ClassifyRequest(text=" ", request_id="blank"),
                    ]
                ),
                metadata=(("x-request-id", "the-call"),),
                timeout=30,
            )
            response = await call
    finally:
        items_log.removeHandler(collector)
        items_log.setLevel(level)
    blank = response.results[1].error
    lines = [json.loads(line) for line in collector.lines]
    assert [(line["event"], line["request_id"]) for line in lines] == [
        ("batch item failed", "blank")
    ]
    (line,) = lines
    assert line["trace_id"] == item_error_info(blank).metadata["x-trace-id"]
    assert (line["code"], line["reason"], line["call_request_id"]) == (
        "INVALID_ARGUMENT",
        "INVALID_REQUEST",
        "the-call",
    )


@pytest.mark.parametrize("exporting", [True, False], ids=["spans-made", "no-spans"])
async def test_an_items_traceparent_puts_it_in_that_trace_whether_or_not_spans_are_made(
    orchestrator: OrchestratorServer, exporting: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans exported (made) or not (none made, as without an OTLP endpoint): the item
    that names a trace of its own is answered in it, the other in the call's."""
    monkeypatch.setattr("classify_common.nodes.spans_are_exported", lambda: exporting)
    call_trace, item_trace = "5ce13a1f2b7c4d1e9f0a6b3c8d2e4f70", "6d0f2b8c4e1a4f3b9c7d5e1a2b3c4d5e"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(
                items=[pb.ClassifyRequest(text=STRIKER), pb.ClassifyRequest(text="   ")] * 2,
                item_contexts=[
                    pb.ItemContext(traceparent=f"00-{item_trace}-b7ad6b7169203331-01"),
                    pb.ItemContext(traceparent=f"00-{item_trace}-b7ad6b7169203331-01"),
                    pb.ItemContext(),
                    pb.ItemContext(),
                ],
            ),
            metadata=(("traceparent", f"00-{call_trace}-00f067aa0ba902b7-01"),),
            timeout=30,
        )
    answered, refused, answered_in_call, refused_in_call = response.results
    assert answered.response.trace_id == item_trace
    assert item_error_info(refused.error).metadata["x-trace-id"] == item_trace
    assert answered_in_call.response.trace_id == call_trace
    assert item_error_info(refused_in_call.error).metadata["x-trace-id"] == call_trace


async def test_a_batch_cut_off_by_the_server_stopping_leaves_no_unread_error(
    capability: CapabilityServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler is cancelled with its items in flight; Python 3.11's gather then
    ends as an error no one reads, which asyncio logged as one (`_GatheringFuture
    exception was never retrieved`) on every such stop."""
    async with (
        orchestrator_for(capability, tmp_path) as server,
        device_occupied(capability.pool.workers[0]),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        call = stub.ClassifyBatch(
            pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=STRIKER)] * 4),
            timeout=30,
        )
        (pool,) = server.dispatcher.state.upstream.pools()
        await wait_until(lambda: pool.in_flight == 4, "the items in flight")
        # Stopped in the background, while the call is read. Cut off at once, it is
        # answered per item or, when gRPC's own cancel comes first, as a whole.
        stopping = asyncio.ensure_future(server.stop(grace_seconds=0))
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call
    await stopping
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


async def test_calls_still_in_flight_when_the_grace_ends_are_answered_with_their_ids(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """gRPC cancels what is left when a stop's grace ends, answering UNAVAILABLE
    "Cancelling all calls" with no IDs; the server answers them first, SERVER_DRAINING
    with the request and trace IDs."""
    async with (
        orchestrator_for(capability, tmp_path) as server,
        device_occupied(capability.pool.workers[0]),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        call = stub.Classify(pb.ClassifyRequest(text=STRIKER, request_id="held-1"), timeout=30)
        (pool,) = server.dispatcher.state.upstream.pools()
        await wait_until(lambda: pool.in_flight >= 1, "the call in flight")
        stopping = asyncio.ensure_future(server.stop(grace_seconds=0.5))  # as above
        cut_off = await refusal(call)
    await stopping
    assert cut_off.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason(cut_off) == "SERVER_DRAINING"
    assert trailers_of(cut_off)["x-request-id"] == "held-1"
    assert len(trailers_of(cut_off)["x-trace-id"]) == 32


async def test_a_batch_cut_off_by_the_grace_keeps_its_answers_and_names_the_items_cut_off(
    capability: CapabilityServer,
    start_capability: StartCapability,
    orchestrator_with: StartOrchestrator,
) -> None:
    """One item answered, one held on a replica when the grace ends: the call is
    answered, the first item with its result and the other SERVER_DRAINING with its
    IDs, so the caller sends that one again. It was answered SERVER_DRAINING whole,
    losing the answered item."""
    held = await start_capability(models=("topic-minilm",))
    server = await orchestrator_with(
        "version: 1\n"
        "backends:\n"
        f"  quick: {{model: topic-static, targets: ['127.0.0.1:{capability.port}']}}\n"
        f"  held: {{model: topic-minilm, targets: ['127.0.0.1:{held.port}'], timeout: 60s}}\n"
        "routes:\n"
        "  - name: quick\n"
        "    match: {model: topic-static}\n"
        "    backend: quick\n"
        "  - name: default\n"
        "    backend: held\n"
    )
    held_pool = next(
        p for p in server.dispatcher.state.upstream.pools() if p.backend.name == "held"
    )
    items = [
        pb.ClassifyRequest(text=STRIKER, model="topic-static", request_id="quick-1"),
        pb.ClassifyRequest(text=STRIKER, request_id="held-1"),
    ]
    async with (
        device_occupied(held.pool.workers[0]),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        call = stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), timeout=30)
        await wait_until(lambda: held_pool.in_flight == 1, "the held item in flight")
        stopping = asyncio.ensure_future(server.stop(grace_seconds=0.5))
        answer = await call
        await asyncio.wait_for(stopping, timeout=30)
    answered, cut_off = answer.results
    assert (answered.response.request_id, answered.response.model.name) == (
        "quick-1",
        "topic-static",
    )
    assert cut_off.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    info = item_error_info(cut_off.error)
    assert info.reason == "SERVER_DRAINING"
    assert info.metadata["x-request-id"] == "held-1"
    assert len(info.metadata["x-trace-id"]) == 32
    # Timed as it was answered, not as a caller that went away.
    durations = "classify_request_duration_seconds_count"
    assert metric_sum(server.registry, durations, route="default", code="UNAVAILABLE") == 1
    assert metric_sum(server.registry, durations, route="default", code="CANCELLED") == 0


async def test_a_stop_does_not_wait_for_upstream_calls_whose_callers_are_gone(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """Once the grace has cut its caller off, an upstream call to a replica that does
    not answer (here a held device; a frozen pod alike) is cancelled: the stop took
    the backend's timeout (60 s here) on top of the grace."""
    async with (
        orchestrator_for(capability, tmp_path, backend_timeout="60s") as server,
        device_occupied(capability.pool.workers[0]),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        call = stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=90)
        (pool,) = server.dispatcher.state.upstream.pools()
        await wait_until(lambda: pool.in_flight == 1, "the call in flight")
        stopping = asyncio.ensure_future(server.stop(grace_seconds=0.2))
        assert error_reason(await refusal(call)) == "SERVER_DRAINING"
        # Still inside the hold: the replica has not answered, and will not before 60 s.
        await asyncio.wait_for(stopping, timeout=30)
        assert pool.in_flight == 0


def test_the_time_kept_for_late_items_follows_what_answering_them_took() -> None:
    """A fixed allowance measured on an idle machine was too little on a busy one: the
    late items' answers ended after the caller's deadline, which then saw no result."""
    allowance = batch_items.LateAnswerAllowance()
    fixed = batch_items.LATE_ANSWER_FIXED_SECONDS
    floor = batch_items.LATE_ANSWER_FLOOR_SECONDS_PER_ITEM

    def per_item() -> float:
        return (allowance.seconds_for(1000) - fixed) / 1000

    # Before any measure, more than the floor: a slow hour's first call needs it.
    assert per_item() == pytest.approx(batch_items.LATE_ANSWER_START_SECONDS_PER_ITEM)
    assert per_item() > floor
    for _ in range(100):
        allowance.record(1000, 0.0)
    assert per_item() == pytest.approx(floor)
    allowance.record(1000, fixed + 1000 * 3 * floor)  # a busy machine: raised at once
    assert per_item() == pytest.approx(3 * floor)
    allowance.record(1000, 0.0)  # quick again: eased down, not dropped
    assert floor < per_item() < 3 * floor
    for _ in range(100):
        allowance.record(1000, 0.0)
    assert per_item() == pytest.approx(floor)  # never below
    # A small call's late time is mostly fixed cost: not read as a slow machine (it
    # kept 2 s of every later large call's time, which then tried none of its items).
    allowance.record(2, 0.5)
    assert per_item() == pytest.approx(floor)
    allowance.record(1000, 60.0)  # a stall: held to the ceiling
    assert per_item() == pytest.approx(batch_items.LATE_ANSWER_CEILING_SECONDS_PER_ITEM)

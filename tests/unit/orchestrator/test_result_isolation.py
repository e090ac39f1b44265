"""One stored result per tenant and request ID: another tenant cannot read a result or
learn that it exists, two tenants' equal IDs keep two results, a tenant's burst of
slow calls past the store's capacity pushes out its own results, not another's, and a
batch item that repeats an earlier item's request_id is refused (it would share that
item's slot).

Each store (in process, and Redis shared by orchestrators) is tested the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.errors import InvalidRequest, RateLimited
from orchestrator.batch_items import UNIQUE_REQUEST_ID_RULE, refuse_repeated_request_ids
from orchestrator.security import hash_key, new_key
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, orchestrator_settings, wait_until
from tests.status_details import error_reason, refusal, unpack
from tests.unit.capability.test_serving import device_occupied

SHARES = "Shares fell sharply after the bank cut its profit forecast"
ACME_KEY, ZENITH_KEY = new_key(), new_key()
ACME = (("authorization", f"Bearer {ACME_KEY}"),)
ZENITH = (("authorization", f"Bearer {ZENITH_KEY}"),)


@pytest.fixture(params=["local", "redis"])
def state_url(request: pytest.FixtureRequest) -> str | None:
    """Where results are stored: None in the orchestrator's memory, else a real Redis."""
    if request.param == "local":
        return None
    return str(request.getfixturevalue("redis_server").url)


@contextlib.asynccontextmanager
async def acme_and_zenith_front_door(
    directory: Path, model: str, capability_port: int, route_extra: str = "", **settings: Any
) -> AsyncIterator[classify_service_pb2_grpc.ClassifyServiceAsyncStub]:
    """A stub for an orchestrator with tenants `acme` and `zenith` (keys ACME_KEY and
    ZENITH_KEY, no rate limits) and one route, `default`, to `model` at the capability
    on `capability_port` (`route_extra`: more of the route's YAML); `settings`: more
    orchestrator settings."""
    keys = directory / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{id: a, sha256: {hash_key(ACME_KEY)}, tenant: acme, role: user}}\n"
        f"  - {{id: z, sha256: {hash_key(ZENITH_KEY)}, tenant: zenith, role: user}}\n"
    )
    routes = directory / "routes.yaml"
    routes.write_text(
        f"""version: 1
backends:
  model: {{model: {model}, targets: ["127.0.0.1:{capability_port}"], timeout: 30s}}
routes:
  - name: default
    backend: model
{route_extra}"""
    )
    server = OrchestratorServer(
        orchestrator_settings(
            routes_file=routes,
            routes_poll_seconds=0,
            auth="required",
            api_keys_file=keys,
            **settings,
        ),
        registry=CollectorRegistry(),
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield classify_service_pb2_grpc.ClassifyServiceStub(channel)
    finally:
        await server.stop(grace_seconds=0)


def tenants_stub(
    capability: CapabilityServer, tmp_path: Path, state_url: str | None
) -> contextlib.AbstractAsyncContextManager[classify_service_pb2_grpc.ClassifyServiceAsyncStub]:
    """The two tenants' front door with a 200 ms budget to topic-minilm, whose device
    the tests hold; results stored at `state_url` (None: in process)."""
    return acme_and_zenith_front_door(
        tmp_path, "topic-minilm", capability.port, "    budget: 200ms\n", state_url=state_url
    )


async def poll_until_done(
    stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    request_id: str,
    metadata: tuple[tuple[str, str], ...],
) -> pb.ClassifyResponse:
    answers: list[pb.ClassifyResponse] = []

    async def done() -> bool:
        request = pb.GetResultRequest(request_id=request_id)
        answers.append(await stub.GetResult(request, metadata=metadata))
        return answers[-1].status == pb.RESULT_STATUS_DONE

    await wait_until(done, f"the result of {request_id}", limit_seconds=10)
    return answers[-1]


def without_call_ids(error: grpc.aio.AioRpcError) -> status_pb2.Status:
    """A failed call's google.rpc.Status less the IDs of the call itself (every call has
    its own): what tells one outcome from another."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for packed in status.details:
        if packed.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            packed.Unpack(info)
            del info.metadata["x-request-id"], info.metadata["x-trace-id"]
            packed.Pack(info)
    return status


def item_violations(status: status_pb2.Status) -> list[tuple[str, str]]:
    return [
        (v.field, v.reason)
        for bad in unpack(status, error_details_pb2.BadRequest)
        for v in bad.field_violations
    ]


async def test_another_tenant_polling_a_result_is_answered_as_for_an_unknown_request_id(
    capability: CapabilityServer, tmp_path: Path, state_url: str | None
) -> None:
    async with tenants_stub(capability, tmp_path, state_url) as stub:
        poll = pb.GetResultRequest(request_id="r-1")
        unknown = await refusal(stub.GetResult(poll, metadata=ZENITH))
        async with device_occupied(capability.pool.workers[0]):
            first = await stub.Classify(
                pb.ClassifyRequest(text=STRIKER, request_id="r-1"), metadata=ACME
            )
            assert first.status == pb.RESULT_STATUS_PROCESSING
            while_running = await refusal(stub.GetResult(poll, metadata=ZENITH))
        done = await poll_until_done(stub, "r-1", ACME)
        once_done = await refusal(stub.GetResult(poll, metadata=ZENITH))
    assert (done.labels[0].name, done.trace_id) == ("sports", first.trace_id)
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason(unknown) == "RESULT_NOT_FOUND"
    for other_tenant in (while_running, once_done):
        assert other_tenant.code() == unknown.code()
        assert other_tenant.details() == unknown.details()
        assert without_call_ids(other_tenant) == without_call_ids(unknown)


async def test_a_tenant_reusing_another_tenants_request_id_leaves_its_result_alone(
    capability: CapabilityServer, tmp_path: Path, state_url: str | None
) -> None:
    """One after the other, so that the second call's hold would replace the first's
    finished result if the two shared a slot."""
    poll = pb.GetResultRequest(request_id="same-1")
    async with tenants_stub(capability, tmp_path, state_url) as stub:
        async with device_occupied(capability.pool.workers[0]):
            acme = await stub.Classify(
                pb.ClassifyRequest(text=STRIKER, request_id="same-1"), metadata=ACME
            )
        acme_done = await poll_until_done(stub, "same-1", ACME)
        async with device_occupied(capability.pool.workers[0]):
            zenith = await stub.Classify(
                pb.ClassifyRequest(text=SHARES, request_id="same-1"), metadata=ZENITH
            )
            acme_while_zenith_runs = await stub.GetResult(poll, metadata=ACME)
        zenith_done = await poll_until_done(stub, "same-1", ZENITH)
        acme_afterwards = await stub.GetResult(poll, metadata=ACME)
    assert (acme.status, zenith.status) == (pb.RESULT_STATUS_PROCESSING,) * 2
    assert (acme_done.labels[0].name, acme_done.trace_id) == ("sports", acme.trace_id)
    assert acme_while_zenith_runs == acme_done
    assert acme_afterwards == acme_done
    assert (zenith_done.labels[0].name, zenith_done.trace_id) == ("business", zenith.trace_id)


async def test_a_tenants_burst_past_the_capacity_pushes_out_its_own_results_only(
    capability: CapabilityServer, tmp_path: Path, state_url: str | None
) -> None:
    """Capacity 4: acme holds one result, then zenith six; three must go, and acme's,
    the oldest of all, is within its share."""
    zenith_ids = [f"z-{n}" for n in range(6)]
    burst = pb.ClassifyBatchRequest(
        items=[pb.ClassifyRequest(text=SHARES, request_id=rid) for rid in zenith_ids]
    )
    async with acme_and_zenith_front_door(
        tmp_path,
        "topic-minilm",
        capability.port,
        "    budget: 200ms\n",
        state_url=state_url,
        results_capacity=4,
    ) as stub:
        async with device_occupied(capability.pool.workers[0]):
            acme = await stub.Classify(
                pb.ClassifyRequest(text=STRIKER, request_id="a-1"), metadata=ACME
            )
            zenith = await stub.ClassifyBatch(burst, metadata=ZENITH)
        acme_done = await poll_until_done(stub, "a-1", ACME)
        # Which three of zenith's go depends on the order its items were held in.
        kept, pushed_out = [], []
        for rid in zenith_ids:
            poll = stub.GetResult(pb.GetResultRequest(request_id=rid), metadata=ZENITH)
            try:
                await poll
            except grpc.aio.AioRpcError as error:
                pushed_out.append(error.code())
                continue
            kept.append(await poll_until_done(stub, rid, ZENITH))
    assert acme.status == pb.RESULT_STATUS_PROCESSING
    assert [item.response.status for item in zenith.results] == [pb.RESULT_STATUS_PROCESSING] * 6
    assert (acme_done.labels[0].name, acme_done.trace_id) == ("sports", acme.trace_id)
    assert [answer.labels[0].name for answer in kept] == ["business"] * 3
    assert pushed_out == [grpc.StatusCode.NOT_FOUND] * 3


async def test_a_batch_item_repeating_an_earlier_request_id_is_refused_and_the_first_kept(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    items = [
        pb.ClassifyRequest(text=STRIKER, request_id="dup-1"),
        pb.ClassifyRequest(text=SHARES, request_id="dup-1"),
        pb.ClassifyRequest(text="   ", request_id="dup-1"),
        pb.ClassifyRequest(text=SHARES, request_id="other-1"),
    ]
    async with tenants_stub(capability, tmp_path, None) as stub:
        async with device_occupied(capability.pool.workers[0]):
            answer = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), metadata=ACME)
        first_done = await poll_until_done(stub, "dup-1", ACME)
        other_done = await poll_until_done(stub, "other-1", ACME)
    first, repeat, broken_repeat, other = answer.results
    assert first.response.status == pb.RESULT_STATUS_PROCESSING
    assert other.response.status == pb.RESULT_STATUS_PROCESSING
    assert (first_done.labels[0].name, first_done.trace_id) == ("sports", first.response.trace_id)
    assert other_done.labels[0].name == "business"
    assert item_violations(repeat.error) == [("items[1].request_id", "request_id.unique")]
    assert item_violations(broken_repeat.error) == [
        ("items[2].text", "text.not_blank"),
        ("items[2].request_id", "request_id.unique"),
    ]
    for refused in (repeat, broken_repeat):
        assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        (info,) = unpack(refused.error, error_details_pb2.ErrorInfo)
        assert (info.reason, info.metadata["x-request-id"]) == ("INVALID_REQUEST", "dup-1")


async def test_an_item_whose_request_id_was_first_on_an_invalid_item_is_served(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """The first item with the ID was refused at intake, so it names no result: the
    later one was refused as its repeat all the same, and nothing was served."""
    items = [
        pb.ClassifyRequest(text="   ", request_id="dup-2"),
        pb.ClassifyRequest(text=STRIKER, request_id="dup-2"),
    ]
    async with tenants_stub(capability, tmp_path, None) as stub:
        answer = await stub.ClassifyBatch(pb.ClassifyBatchRequest(items=items), metadata=ACME)
    invalid, served = answer.results
    assert item_violations(invalid.error) == [("items[0].text", "text.not_blank")]
    assert (served.response.request_id, served.response.labels[0].name) == ("dup-2", "sports")


def test_a_repeat_over_the_rate_limit_is_refused_for_its_request_id() -> None:
    over_limit = RateLimited("tenant 'acme' is over its rate limit", retry_after_seconds=1.0)
    items = [pb.ClassifyRequest(text=STRIKER, request_id="x")] * 2
    refused = refuse_repeated_request_ids(items, {1: over_limit})
    assert set(refused) == {1}
    assert isinstance(refused[1], InvalidRequest)
    assert [(v.field, v.rule) for v in refused[1].violations] == [
        ("items[1].request_id", UNIQUE_REQUEST_ID_RULE)
    ]


def test_items_without_a_request_id_never_repeat_one() -> None:
    intake: dict[int, InvalidRequest] = {}
    items = [pb.ClassifyRequest(text=STRIKER), pb.ClassifyRequest(text=STRIKER)]
    assert refuse_repeated_request_ids(items, intake) is intake

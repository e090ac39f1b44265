"""Health needs no credentials, so its long-lived Watch streams are bounded."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from classify_common.serving import BoundedHealthServicer, peer_host
from tests.conftest import StartCapability, wait_until
from tests.status_details import refusal


async def test_a_watch_past_the_bound_is_refused_and_a_closed_one_frees_its_place() -> None:
    """Each open Watch holds memory for as long as its caller keeps it (3,000 took an
    orchestrator from 78 to 146 MB) and nothing bounded them."""
    servicer = BoundedHealthServicer(max_watches=2)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            # grpcio-health-checking ships no type hints for its stub.
            stub: Any = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest()
            watches = [stub.Watch(request), stub.Watch(request)]
            for watch in watches:
                first = await watch.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
            refused = await refusal(stub.Watch(request).read())
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await stub.Check(request)).status == health_pb2.HealthCheckResponse.SERVING
            watches[0].cancel()
            await wait_until(lambda: servicer.open_watches == 1, "the cancelled watch closed")
            again = stub.Watch(request)
            assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
            again.cancel()
            watches[1].cancel()
    finally:
        await server.stop(grace=0)


async def test_one_host_may_hold_only_its_share_of_the_watches() -> None:
    """One caller able to reach a capability's port held every Watch, and the
    orchestrators' channels, which health-check over one, were refused theirs and
    took the replica out of rotation. Another host (here IPv6's loopback) still gets
    one while the first is at its share."""
    servicer = BoundedHealthServicer(max_watches=10, max_per_host=2)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert server.add_insecure_port(f"[::1]:{port}") == port
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    request = health_pb2.HealthCheckRequest()
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as one_host,
            grpc.aio.insecure_channel(f"[::1]:{port}") as another_host,
        ):
            stub: Any = health_pb2_grpc.HealthStub(one_host)
            watches = [stub.Watch(request), stub.Watch(request)]
            for watch in watches:
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            refused = await refusal(stub.Watch(request).read())
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.details() == "2 health watches are open from ipv4:127.0.0.1; use Check"
            other: Any = health_pb2_grpc.HealthStub(another_host)
            elsewhere = other.Watch(request)
            assert (await elsewhere.read()).status == health_pb2.HealthCheckResponse.SERVING
            for watch in (*watches, elsewhere):
                watch.cancel()
            await wait_until(lambda: servicer.open_watches == 0, "every watch closed")
    finally:
        await server.stop(grace=0)


def test_a_peer_is_counted_by_its_address_without_the_port() -> None:
    assert peer_host("ipv4:10.0.0.7:5123") == "ipv4:10.0.0.7"
    assert peer_host("ipv6:[::1]:5123") == "ipv6:[::1]"
    assert peer_host("unix:/run/classify.sock") == "unix:/run/classify.sock"


@pytest.mark.parametrize(("per_address", "second_refused"), [(1, True), (0, False)])
async def test_a_servers_share_per_address_is_its_setting_and_0_turns_it_off(
    start_capability: StartCapability, per_address: int, second_refused: bool
) -> None:
    """Callers that all come from one address (a service mesh's sidecar, NAT) would
    share one address's part: the operator sets it, or turns it off."""
    server = await start_capability(
        models=("topic-static",), health_watches_per_address=per_address
    )
    request = health_pb2.HealthCheckRequest()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)
        first = stub.Watch(request)
        assert (await first.read()).status == health_pb2.HealthCheckResponse.SERVING
        second = stub.Watch(request)
        if second_refused:
            refused = await refusal(second.read())
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            assert (await second.read()).status == health_pb2.HealthCheckResponse.SERVING
        first.cancel()
        second.cancel()

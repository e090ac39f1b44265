"""Every address behind a target is a replica: names looked up and followed as pods come
and go, a pod that reports NOT_SERVING passed by without a failed call, and TLS to a
pod's address checked against the name it was found under."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.errors import ModelUnavailable
from classify_common.tls import ClientTls
from orchestrator.metrics import OUTLIER_EJECTIONS_TOTAL
from orchestrator.policy import OutlierSettings
from orchestrator.routing import Backend
from orchestrator.server import OrchestratorServer
from orchestrator.upstream.addresses import Address, HostName, TargetAddresses, parse_target
from orchestrator.upstream.pool import BackendPool, open_channel
from tests.conftest import STRIKER, metric_sum, orchestrator_settings, wait_until
from tests.flaky_pod import CLASSIFY_SERVICE, FlakyPod
from tests.status_details import refusal


@pytest.mark.parametrize(
    ("target", "parsed"),
    [
        ("10.0.0.5:50051", (Address("10.0.0.5:50051"),)),
        ("[fd00::5]:50051", (Address("[fd00::5]:50051"),)),
        ("dns:///10.0.0.5:50051", (Address("10.0.0.5:50051"),)),
        (
            "ipv4:10.0.0.5:50051,10.0.0.6:50052",
            (Address("10.0.0.5:50051"), Address("10.0.0.6:50052")),
        ),
        ("ipv6:[fd00::5]:50051", (Address("[fd00::5]:50051"),)),
        ("capability:50051", HostName("capability", 50051)),
        (
            "dns:///capability.classify.svc.cluster.local:50052",
            HostName("capability.classify.svc.cluster.local", 50052),
        ),
    ],
)
def test_a_target_gives_its_addresses_or_the_name_to_look_up(
    target: str, parsed: tuple[Address, ...] | HostName
) -> None:
    assert parse_target(target) == parsed


async def test_a_name_is_looked_up_and_its_addresses_keep_the_name_as_authority() -> None:
    changes: list[tuple[Address, ...]] = []
    addresses = TargetAddresses(["dns:///localhost:5555"], changes.append)
    assert addresses.addresses == (Address("dns:///localhost:5555"),)  # until the look-up
    await addresses.look_up()
    assert Address("127.0.0.1:5555", "localhost:5555") in addresses.addresses
    assert {address.authority for address in addresses.addresses} == {"localhost:5555"}
    assert changes == [addresses.addresses]


async def test_a_failed_look_up_keeps_the_addresses_found_before() -> None:
    answers: list[Sequence[str] | OSError] = [
        ["10.0.0.6", "10.0.0.5"],
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        [],
    ]

    async def lookup(host: str, port: int) -> Sequence[str]:
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    changes: list[tuple[Address, ...]] = []
    addresses = TargetAddresses(["pods:80", "10.0.0.9:80"], changes.append, lookup=lookup)
    for _ in range(3):
        await addresses.look_up()
    expected = tuple(Address(f"10.0.0.{n}:80", "pods:80" if n != 9 else None) for n in (5, 6, 9))
    assert changes == [expected]


async def test_pods_that_come_and_go_behind_a_name_are_followed(
    capability: CapabilityServer,
) -> None:
    """A name whose pods change: each new address gets calls, a gone one gets none and
    its channel is closed."""
    first = FlakyPod(capability.port, "127.0.0.1", failing=False)
    await first.start()
    second = FlakyPod(capability.port, "127.0.0.2", failing=False)
    await second.start(port=first.port)  # a name's addresses share its port
    answer = ["127.0.0.1"]

    async def lookup(host: str, port: int) -> Sequence[str]:
        assert (host, port) == ("pods.test", first.port)
        return answer

    backend = Backend("minilm", "topic-minilm", (f"dns:///pods.test:{first.port}",), 5.0)
    pool = BackendPool(backend, OutlierSettings(), lookup=lookup, resolve_interval_seconds=0.02)
    request = pb.ClassifyRequest(text=STRIKER, model="topic-minilm")

    async def classify(calls: int) -> None:
        for _ in range(calls):
            await pool.classify(request, target=pool.pick(), client_remaining=None)

    try:
        await wait_until(lambda: pool.replicas == (first.address,))
        await classify(2)
        assert (first.answered, second.answered) == (2, 0)

        answer = ["127.0.0.2", "127.0.0.1"]  # a pod joins
        await wait_until(lambda: pool.replicas == (first.address, second.address))
        await classify(4)
        assert (first.answered, second.answered) == (4, 2)

        answer = ["127.0.0.2"]  # the first pod leaves
        await wait_until(lambda: pool.replicas == (second.address,))
        await classify(2)
        assert (first.answered, second.answered) == (4, 4)
        assert set(pool.coalescers) == {second.address}
    finally:
        await pool.close()
        await first.stop()
        await second.stop()


async def test_a_draining_pod_behind_one_target_costs_no_call(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A pod that reports NOT_SERVING (draining on SIGTERM) is passed by while the name
    still lists it: no call fails (the route has no retries) and no pod is ejected."""
    pod = FlakyPod(capability.port, failing=False)
    await pod.start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"""version: 1
backends:
  minilm:
    model: topic-minilm
    targets: ["ipv4:127.0.0.1:{capability.port},{pod.address}"]
routes:
  - name: default
    backend: minilm
    retry: {{max_attempts: 1}}
"""
    )
    orchestrator = OrchestratorServer(
        orchestrator_settings(port=0, metrics_port=-1, routes_file=routes),
        registry=CollectorRegistry(),
    )
    await orchestrator.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)

            async def call() -> None:
                await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)

            for _ in range(4):
                await call()
            assert pod.answered == 2  # round robin: both addresses were used

            await pod.set_serving(False)
            # The health watch reports it: turns go to the other replica only.
            (pool,) = orchestrator.dispatcher.state.upstream.pools()
            await wait_until(lambda: len({pool.pick() for _ in range(4)}) == 1, "pod passed by")
            for _ in range(6):
                await call()
            assert pod.calls == 2
    finally:
        await orchestrator.stop(grace_seconds=0)
        await pod.stop()
    assert metric_sum(orchestrator.registry, OUTLIER_EJECTIONS_TOTAL) == 0


def make_pod_certificate(directory: Path, dns_name: str) -> None:
    """A test CA, and a server certificate it signed for `dns_name` only (no IP), as a
    pod's certificate names its Service."""
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=ca")
    openssl("req", *curve, "-keyout", "pod.key", "-out", "pod.csr", "-subj", "/CN=pod")
    (directory / "san.ext").write_text(f"subjectAltName=DNS:{dns_name}\n")
    openssl(
        "x509", "-req", "-in", "pod.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "pod.pem", "-days", "1", "-extfile", "san.ext",
    )  # fmt: skip


async def test_an_address_found_under_a_name_is_checked_against_that_name(
    tmp_path: Path,
) -> None:
    """TLS to a pod dialled by its IP: its certificate carries the Service's name, which
    the channel presents as its authority."""
    make_pod_certificate(tmp_path, "pods.test")
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set(CLASSIFY_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    key_and_chain = ((tmp_path / "pod.key").read_bytes(), (tmp_path / "pod.pem").read_bytes())
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([key_and_chain]))
    await server.start()
    tls = ClientTls(tmp_path / "ca.pem")
    address = f"127.0.0.1:{port}"
    check = health_pb2.HealthCheckRequest()
    try:
        async with open_channel(address, tls, authority=f"pods.test:{port}") as channel:
            stub: Any = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(check, timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        async with open_channel(address, tls) as channel:  # checked against 127.0.0.1
            stub = health_pb2_grpc.HealthStub(channel)
            error = await refusal(stub.Check(check, timeout=5))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "Hostname Verification" in (error.details() or "")
    finally:
        await server.stop(grace=None)


async def test_calls_waiting_for_a_pod_that_leaves_are_answered_unavailable_at_once(
    capability: CapabilityServer,
) -> None:
    """Items gathered behind a call in flight to a pod the name stops listing: its
    coalescer's close waited for the call in flight alone; as that came back, the
    items left in a new call, which the channel closed next cancelled locally. They
    were never answered (a caller without a deadline waited for ever) and the pool's
    calls in flight never came down. UNAVAILABLE is what a route retries elsewhere."""
    leaving = FlakyPod(capability.port, "127.0.0.1", failing=False)
    await leaving.start()
    staying = FlakyPod(capability.port, "127.0.0.2", failing=False)
    await staying.start(port=leaving.port)
    leaving.delay_seconds = 0.5  # the call in flight that the others gather behind
    leaving.load_report = pb.LoadReport(max_batch_size=8, queue_capacity=256).SerializeToString()
    answer = ["127.0.0.1"]

    async def lookup(host: str, port: int) -> Sequence[str]:
        return answer

    backend = Backend("minilm", "topic-minilm", (f"dns:///pods.test:{leaving.port}",), 5.0)
    pool = BackendPool(backend, OutlierSettings(), lookup=lookup, resolve_interval_seconds=0.02)

    async def classify(text: str) -> pb.ClassifyResponse:
        request = pb.ClassifyRequest(text=text, model="topic-minilm")
        return await pool.classify(request, target=pool.pick(), client_remaining=None)

    try:
        await wait_until(lambda: pool.replicas == (leaving.address,))
        in_flight = asyncio.ensure_future(classify(STRIKER))
        await wait_until(lambda: leaving.calls == 1, "the first call at the pod")
        gathered = [asyncio.ensure_future(classify(f"{STRIKER} {n}")) for n in range(3)]
        coalescer = pool.coalescers[leaving.address]
        await wait_until(lambda: coalescer.waiting == 3, "three items gathered behind it")
        answer = ["127.0.0.2"]  # the pod leaves
        outcomes = await asyncio.wait_for(
            asyncio.gather(*gathered, return_exceptions=True), timeout=10
        )
        assert [type(outcome) for outcome in outcomes] == [ModelUnavailable] * 3
        assert (await in_flight).labels[0].name == "sports"  # the call in flight answered
        # Its load report, which came back after the pod left, is not kept for it.
        assert leaving.address not in pool.loads
        await wait_until(lambda: pool.in_flight == 0, "no call left counted in flight")
        assert leaving.calls == 1
    finally:
        await pool.close()
        await leaving.stop()
        await staying.stop()

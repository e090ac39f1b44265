"""Scale-out on loopback: one orchestrator in front of several capability servers.

The topology of the headless Service in Kubernetes: one backend whose targets are
several capability replicas. Load spreads across them, and an edit of routes.yaml
under load takes one replica out of rotation and puts a new one in, with no
failed call. Every share is measured with each capability server's own counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.metrics import MODEL_TEXTS_TOTAL, RPC_ITEMS
from capability.server import CapabilityServer
from classify_common.metrics import RPC_REQUESTS_TOTAL
from orchestrator.metrics import ROUTES_RELOADS_TOTAL, UPSTREAM_RETRIES_TOTAL
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, StartCapability, metric_sum, orchestrator_settings, wait_until

CLASSIFY = "/ai.classify.v1.ClassifyService/Classify"
CLIENTS = 6
# Calls counted per measuring window; with round robin each replica gets about a third.
WINDOW_CALLS = 120
MIN_SHARE = 0.15
CALL_TIMEOUT_SECONDS = 20.0
# Under load on a shared 2-core machine, each step may take this long.
STEP_LIMIT_SECONDS = 60.0


def target(server: CapabilityServer) -> str:
    return f"127.0.0.1:{server.port}"


def routes_for(servers: Sequence[CapabilityServer]) -> str:
    targets = ", ".join(f'"{target(server)}"' for server in servers)
    return f"""version: 1
backends:
  static: {{model: topic-static, targets: [{targets}], timeout: 10s}}
routes:
  - name: default
    backend: static
"""


def replace_file(path: Path, text: str) -> None:
    """Write beside, then rename over: the watcher reads the old file or the new one, whole."""
    staging = path.with_name(path.name + ".new")
    staging.write_text(text)
    staging.replace(path)


def classify_calls(server: CapabilityServer, code: str | None = None) -> float:
    """Requests the capability server itself received (any outcome), or, with code OK,
    the ones its model answered. Counted per text: concurrent requests reach it
    coalesced into ClassifyBatch calls."""
    if code is None:
        return metric_sum(server.registry, RPC_ITEMS + "_sum")
    assert code == "OK"
    return metric_sum(server.registry, MODEL_TEXTS_TOTAL)


async def measure_window(servers: Sequence[CapabilityServer]) -> list[float]:
    """Classify calls each server answered OK while WINDOW_CALLS calls went to them all."""
    before = [classify_calls(server, "OK") for server in servers]

    def deltas() -> list[float]:
        return [classify_calls(s, "OK") - b for s, b in zip(servers, before, strict=True)]

    await wait_until(
        lambda: sum(deltas()) >= WINDOW_CALLS, f"{WINDOW_CALLS} calls answered", STEP_LIMIT_SECONDS
    )
    return deltas()


def assert_spread(counts: Sequence[float]) -> None:
    total = sum(counts)
    shares = [count / total for count in counts]
    assert all(share >= MIN_SHARE for share in shares), f"uneven spread: {counts}"


class Load:
    """CLIENTS callers, each calling the orchestrator again as soon as it is answered."""

    def __init__(self, port: int) -> None:
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self._stub = classify_service_pb2_grpc.ClassifyServiceStub(self._channel)
        self._stop = asyncio.Event()
        # Calls each client has seen answered OK, and every call that was not.
        self.answered = [0] * CLIENTS
        self.failures: list[str] = []
        self._clients = [asyncio.ensure_future(self._client(n)) for n in range(CLIENTS)]

    async def _client(self, n: int) -> None:
        while not self._stop.is_set():
            call = self._stub.Classify(
                pb.ClassifyRequest(text=STRIKER, top_k=1), timeout=CALL_TIMEOUT_SECONDS
            )
            try:
                response = await call
            except grpc.aio.AioRpcError as error:
                self.failures.append(f"{error.code().name}: {error.details()}")
                continue
            code = await call.code()
            if code != grpc.StatusCode.OK or response.status != pb.RESULT_STATUS_DONE:
                self.failures.append(f"{code.name}, status {response.status}")
                continue
            if response.model.name != "topic-static" or response.labels[0].name != "sports":
                self.failures.append(f"unexpected answer: {response}")
                continue
            self.answered[n] += 1

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._clients)
        await self._channel.close()


async def test_load_spreads_over_three_replicas_and_an_edit_swaps_one_out_under_load(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    replicas = [await start_capability(models=("topic-static",)) for _ in range(3)]
    kept, removed = replicas[:2], replicas[2]
    assert len({server.port for server in replicas}) == 3

    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_for(replicas))
    orchestrator = OrchestratorServer(
        orchestrator_settings(routes_file=routes, routes_poll_seconds=0.05),
        registry=CollectorRegistry(),
    )
    await orchestrator.start()
    load = Load(orchestrator.port)
    try:
        # 1. Every replica serves, and each gets a fair share of the steady load.
        await wait_until(
            lambda: all(classify_calls(server, "OK") > 0 for server in replicas),
            "every replica answered",
            STEP_LIMIT_SECONDS,
        )
        assert_spread(await measure_window(replicas))

        # 2. A fourth replica comes up on a new port, still under load, and gets no calls
        #    while routes.yaml does not name it.
        added = await start_capability(models=("topic-static",))
        assert added.port not in {server.port for server in replicas}
        assert classify_calls(added) == 0

        # 3. The edit: the third replica out, the fourth in.
        replace_file(routes, routes_for([*kept, added]))
        await wait_until(
            lambda: metric_sum(orchestrator.registry, ROUTES_RELOADS_TOTAL, outcome="ok") == 1,
            "the edit applied",
            STEP_LIMIT_SECONDS,
        )
        removed_at_reload = classify_calls(removed)
        # Calls that started on the old table may still finish on the removed replica;
        # a call a client starts after the reload counts cannot. Two more answers per
        # client: the second of them started after the reload.
        seen = list(load.answered)
        await wait_until(
            lambda: all(now >= then + 2 for now, then in zip(load.answered, seen, strict=True)),
            "every client answered twice after the reload",
            STEP_LIMIT_SECONDS,
        )
        removed_after_switch = classify_calls(removed)
        # Only calls in flight at the switch finish there: at most one per client.
        assert removed_after_switch - removed_at_reload <= CLIENTS

        # 4. From now on the removed replica gets nothing; the new set shares the load.
        spread = await measure_window([*kept, added])
        assert classify_calls(removed) == removed_after_switch, "the removed replica got calls"
        assert_spread(spread)

        # 5. The removed replica shuts down (its pod goes away): callers notice nothing.
        await removed.stop(grace_seconds=5)
        assert_spread(await measure_window([*kept, added]))
        assert classify_calls(removed) == removed_after_switch
    finally:
        await load.stop()
        await orchestrator.stop(grace_seconds=0)

    assert load.failures == []
    answered = sum(load.answered)
    assert answered >= 3 * WINDOW_CALLS
    # One upstream call per answer: no call failed on a replica and was retried elsewhere.
    assert metric_sum(orchestrator.registry, UPSTREAM_RETRIES_TOTAL) == 0
    assert sum(classify_calls(server) for server in [*replicas, added]) == answered
    assert sum(classify_calls(server, "OK") for server in [*replicas, added]) == answered
    assert metric_sum(orchestrator.registry, ROUTES_RELOADS_TOTAL, outcome="failed") == 0
    assert (
        metric_sum(orchestrator.registry, RPC_REQUESTS_TOTAL, method=CLASSIFY, code="OK")
        == answered
    )

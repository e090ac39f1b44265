"""Live edits of routes.yaml through a real orchestrator under continuous load."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from classify_common.serving import stop_watcher
from orchestrator.metrics import (
    BACKEND_IN_FLIGHT,
    ROUTES_FILE_REFUSED,
    ROUTES_RELOADS_TOTAL,
    UPSTREAM_RETRIES_TOTAL,
)
from orchestrator.routing import RouteTable
from orchestrator.routing.watcher import RoutesWatcher
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, closed_port, metric_sum, orchestrator_settings, wait_until
from tests.flaky_pod import FlakyPod
from tests.hostile_files import nested_aliases
from tests.status_details import refusal


def routes_to(default_backend: str, capability_port: int) -> str:
    return f"""version: 1
backends:
  minilm: {{model: topic-minilm, targets: ["127.0.0.1:{capability_port}"]}}
  static: {{model: topic-static, targets: ["127.0.0.1:{capability_port}"]}}
routes:
  - name: default
    backend: {default_backend}
"""


def replace_file(path: Path, text: str) -> None:
    """Write beside, then rename over: readers see the old file or the new one, whole."""
    staging = path.with_name(path.name + ".new")
    staging.write_text(text)
    staging.replace(path)


async def watching_orchestrator(routes: Path) -> OrchestratorServer:
    """An orchestrator started on `routes`, looking for edits every 50 ms."""
    server = OrchestratorServer(
        orchestrator_settings(
            port=0, metrics_port=-1, routes_file=routes, routes_poll_seconds=0.05
        ),
        registry=CollectorRegistry(),
    )
    await server.start()
    return server


def applied_reloads(server: OrchestratorServer) -> float:
    return metric_sum(server.registry, ROUTES_RELOADS_TOTAL, outcome="ok")


class LoadedOrchestrator:
    """An orchestrator on a routes file, and clients calling it without pause."""

    def __init__(self, routes_file: Path) -> None:
        self.server = OrchestratorServer(
            orchestrator_settings(
                port=0, metrics_port=-1, routes_file=routes_file, routes_poll_seconds=0.05
            ),
            registry=CollectorRegistry(),
        )
        self.models: list[str] = []
        self.answered_at: list[float] = []  # loop time of each answer, in order
        self.failures: list[grpc.aio.AioRpcError] = []
        self._stop = asyncio.Event()
        self._clients: list[asyncio.Future[None]] = []
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> LoadedOrchestrator:
        await self.server.start()
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.server.port}")
        stub = classify_service_pb2_grpc.ClassifyServiceStub(self._channel)
        self._clients = [asyncio.ensure_future(self._client(stub)) for _ in range(4)]
        await wait_until(lambda: len(self.models) >= 8)
        return self

    async def _client(self, stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub) -> None:
        while not self._stop.is_set():
            try:
                response = await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=10)
                self.models.append(response.model.name)
                self.answered_at.append(asyncio.get_running_loop().time())
            except grpc.aio.AioRpcError as error:
                self.failures.append(error)

    def longest_wait_for_an_answer(self, since: float) -> float:
        """The longest time from `since` (loop time) to now with no answer."""
        times = [since, *(t for t in self.answered_at if t > since)]
        times.append(asyncio.get_running_loop().time())
        return max(later - earlier for earlier, later in itertools.pairwise(times))

    def reloads(self, outcome: str) -> float:
        return metric_sum(self.server.registry, ROUTES_RELOADS_TOTAL, outcome=outcome)

    async def __aexit__(self, *exc_info: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._clients)
        assert self._channel is not None
        await self._channel.close()
        await self.server.stop(grace_seconds=0)


async def test_edit_moving_the_default_route_applies_under_load_and_a_broken_edit_changes_nothing(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", capability.port))
    async with LoadedOrchestrator(routes) as loaded:
        assert set(loaded.models) == {"topic-minilm"}

        replace_file(routes, routes_to("static", capability.port))
        await wait_until(lambda: loaded.models[-8:] == ["topic-static"] * 8)
        assert loaded.reloads("ok") == 1

        assert metric_sum(loaded.server.registry, ROUTES_FILE_REFUSED) == 0
        replace_file(routes, routes_to("no-such-backend", capability.port))
        await wait_until(lambda: loaded.reloads("failed") == 1)
        served_before = len(loaded.models)
        await wait_until(lambda: len(loaded.models) >= served_before + 8)
        assert set(loaded.models[served_before:]) == {"topic-static"}
        # Counted once, and said for as long as the refused file stays.
        assert metric_sum(loaded.server.registry, ROUTES_FILE_REFUSED) == 1

        replace_file(routes, routes_to("minilm", capability.port))
        await wait_until(lambda: loaded.reloads("ok") == 2)
        assert metric_sum(loaded.server.registry, ROUTES_FILE_REFUSED) == 0
    assert loaded.failures == []


async def test_kubernetes_configmap_symlink_swap_is_applied(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    # A ConfigMap volume: routes.yaml -> ..data/routes.yaml, ..data -> a timestamped folder;
    # an update writes a new folder and swaps the ..data link.
    first = tmp_path / "..2026_11_30_01"
    first.mkdir()
    (first / "routes.yaml").write_text(routes_to("minilm", capability.port))
    (tmp_path / "..data").symlink_to(first.name)
    (tmp_path / "routes.yaml").symlink_to("..data/routes.yaml")

    async with LoadedOrchestrator(tmp_path / "routes.yaml") as loaded:
        second = tmp_path / "..2026_11_30_02"
        second.mkdir()
        (second / "routes.yaml").write_text(routes_to("static", capability.port))
        (tmp_path / "..data_tmp").symlink_to(second.name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")

        await wait_until(lambda: loaded.models[-8:] == ["topic-static"] * 8)
    assert loaded.failures == []


async def test_routes_file_of_nested_aliases_is_refused_while_calls_keep_flowing(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", capability.port))
    loop = asyncio.get_running_loop()
    async with LoadedOrchestrator(routes) as loaded:
        edited = loop.time()
        # A valid edit to the static model, with 9 ** 8 strings' worth of aliases under
        # an unknown key: refused whole, so the minilm routes stay.
        replace_file(routes, routes_to("static", capability.port) + nested_aliases(levels=8))
        await wait_until(lambda: loaded.reloads("failed") == 1)
        refused_after = loop.time() - edited
        served_before = len(loaded.models)
        await wait_until(lambda: len(loaded.models) >= served_before + 8)
        assert set(loaded.models[served_before:]) == {"topic-minilm"}
        assert loaded.longest_wait_for_an_answer(since=edited) < 0.5
    assert refused_after < 1.0  # poll interval (0.05 s) included
    assert loaded.failures == []


async def test_routes_file_is_read_off_the_event_loop(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A version whose parse takes a second or more (a long flow list, within the size
    cap, refused at its end for an unknown key) does not stop the serving loop: read
    on the event loop, it would stop every call for that long. Calls still wait a
    little now and then (the parse holds the GIL, and in this process the garbage
    collector walks the whole suite's heap as the parse fills it), so the longest
    wait is measured against the parse's own time."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", capability.port))
    slow = routes_to("static", capability.port) + "x: [" + ",".join(["0"] * 120_000) + "]\n"
    loop = asyncio.get_running_loop()
    async with LoadedOrchestrator(routes) as loaded:
        replace_file(routes, slow)
        swapped = loop.time()
        await wait_until(lambda: loaded.reloads("failed") >= 1)
        took = loop.time() - swapped
        assert took >= 0.5  # the parse did take its time
        assert loaded.longest_wait_for_an_answer(since=swapped) < took / 2
        assert loaded.models[-1] == "topic-minilm"
    assert loaded.failures == []


async def test_a_routes_file_swapped_for_a_fifo_is_refused_at_once_and_later_edits_apply(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """Opened as a file, a FIFO with no writer held the watcher's thread: no later edit
    was ever applied, and the process could not exit (its executor waited for the
    thread)."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", capability.port))
    pipe = tmp_path / "routes.pipe"
    os.mkfifo(pipe)
    try:
        async with LoadedOrchestrator(routes) as loaded:
            os.link(pipe, tmp_path / "routes.staged")
            os.replace(tmp_path / "routes.staged", routes)
            await wait_until(lambda: loaded.reloads("failed") >= 1, "the FIFO refused")
            replace_file(routes, routes_to("static", capability.port))
            await wait_until(lambda: loaded.reloads("ok") >= 1, "the next edit applied")
            await wait_until(lambda: loaded.models[-1] == "topic-static", "calls on the edit")
    finally:
        release_pipe_readers(pipe)  # so that a failure here ends the test, not the run
    assert loaded.failures == []


def release_pipe_readers(pipe: Path) -> None:
    """Give an end of file to each reader still waiting to open `pipe`, so that no
    worker thread is left blocked after the test."""
    while True:
        try:
            writer = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: nobody is waiting to read
            return
        os.close(writer)


def routes_on(targets: list[str], spare: str | None = None) -> str:
    """One backend, `minilm`, on `targets`, where a replica is ejected on its first
    failure for a minute; `spare` adds a backend on it that no route uses (an edit
    that leaves `minilm` as it was). Calls the tests hold at a pod may wait 30 s
    (the default 5 s ran out once while a loaded machine took its time to reload)."""
    spare_line = f"  spare: {{model: topic-static, targets: ['{spare}']}}\n" if spare else ""
    return (
        "version: 1\n"
        "outlier_ejection: {consecutive_failures: 1, base_ejection: 60s, max_ejection: 60s}\n"
        "backends:\n"
        f"  minilm: {{model: topic-minilm, targets: {targets}, timeout: 30s}}\n"
        f"{spare_line}"
        "routes:\n"
        "  - name: default\n"
        "    backend: minilm\n"
        "    retry: {max_attempts: 3, initial_backoff: 1ms, max_backoff: 5ms}\n"
    )


async def test_an_edit_keeps_the_pools_of_backends_it_leaves_as_they_were(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """An edit made during an incident must not readmit an ejected pod: a backend the edit
    leaves as it was keeps its pool (ejections, adaptive limit, connections); a backend
    the edit changes gets a fresh one."""
    pod = FlakyPod(capability.port)  # fails every call
    await pod.start()
    routes = tmp_path / "routes.yaml"
    replica = f"127.0.0.1:{capability.port}"
    routes.write_text(routes_on([pod.address, replica]))
    try:
        async with LoadedOrchestrator(routes) as loaded:
            await wait_until(lambda: pod.calls >= 1, "the pod tried")
            kept = loaded.server.dispatcher.state.upstream.pool(
                loaded.server.routes.backends["minilm"]
            )
            calls_before_edit = pod.calls

            replace_file(routes, routes_on([pod.address, replica], spare=replica))
            await wait_until(lambda: loaded.reloads("ok") == 1)
            served = len(loaded.models)
            await wait_until(lambda: len(loaded.models) >= served + 20)
            assert pod.calls == calls_before_edit, "the edit readmitted the ejected pod"
            upstream = loaded.server.dispatcher.state.upstream
            assert upstream.pool(loaded.server.routes.backends["minilm"]) is kept

            replace_file(routes, routes_on([replica, pod.address], spare=replica))
            await wait_until(lambda: loaded.reloads("ok") == 2)
            # minilm's targets changed: a fresh pool, which tries the pod again.
            await wait_until(
                lambda: pod.calls > calls_before_edit, "the changed backend's new pool"
            )
            assert (
                loaded.server.dispatcher.state.upstream.pool(
                    loaded.server.routes.backends["minilm"]
                )
                is not kept
            )
    finally:
        await pod.stop()
    assert loaded.failures == []


async def test_a_call_outlives_two_edits_of_the_backend_it_is_on(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A pool shared by the routes before an edit and after it stays open for as long as
    either has calls on it. A call begun before two edits (the first leaves its backend
    as it was, the second changes it) fails on the pod it went to, and its retry, sent
    after both edits, still goes out on the pool of the routes it began under."""
    pod = FlakyPod(capability.port)  # fails every call, once let go
    await pod.start()
    pod.answering.clear()
    replica = f"127.0.0.1:{capability.port}"
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_on([pod.address, replica]))
    server = await watching_orchestrator(routes)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            held = stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
            await wait_until(lambda: pod.calls == 1, "the call reached the pod")
            replace_file(routes, routes_on([pod.address, replica], spare=replica))
            await wait_until(lambda: applied_reloads(server) == 1)
            replace_file(routes, routes_on([replica], spare=replica))
            await wait_until(lambda: applied_reloads(server) == 2)
            pod.answering.set()  # UNAVAILABLE; the retry goes to the other replica
            response = await held
    finally:
        await server.stop(grace_seconds=0)
        await pod.stop()
    assert response.model.name == "topic-minilm"


async def test_an_edit_naming_a_backend_by_a_list_is_refused_and_later_edits_still_apply(
    capability: CapabilityServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`backend: [static]` once raised TypeError in the loader, which ended the watcher
    unseen: nothing logged or counted, and every later edit ignored."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", capability.port))
    async with LoadedOrchestrator(routes) as loaded:
        replace_file(routes, routes_to("[static]", capability.port))
        await wait_until(lambda: loaded.reloads("failed") == 1)
        [refused] = [r for r in caplog.records if r.getMessage().startswith("routes file refused")]
        assert getattr(refused, "error", None) == (
            f"{routes}:7: routes[0].backend: expected a backend name, got list"
        )
        served_before = len(loaded.models)
        await wait_until(lambda: len(loaded.models) >= served_before + 8)
        assert set(loaded.models[served_before:]) == {"topic-minilm"}

        replace_file(routes, routes_to("static", capability.port))
        await wait_until(lambda: loaded.models[-8:] == ["topic-static"] * 8)
        assert (loaded.reloads("ok"), loaded.reloads("failed")) == (1, 1)
    assert loaded.failures == []


async def test_stop_after_a_refused_edit_drains_the_call_in_flight(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """SIGTERM after the wrongly typed edit above once re-raised the watcher's TypeError
    from stop(), before the drain: the calls in flight were cancelled."""
    pod = FlakyPod(capability.port, failing=False)
    await pod.start()
    pod.answering.clear()  # calls wait at the pod: in flight until it answers
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_on([pod.address]))
    server = await watching_orchestrator(routes)
    stopping: asyncio.Future[None] | None = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            held = asyncio.ensure_future(
                classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(
                    pb.ClassifyRequest(text=STRIKER), timeout=30
                )
            )
            await wait_until(lambda: pod.calls == 1, "the call reached the pod")
            replace_file(
                routes, routes_on([pod.address]).replace("backend: minilm", "backend: [minilm]")
            )
            await wait_until(
                lambda: metric_sum(server.registry, ROUTES_RELOADS_TOTAL, outcome="failed") == 1
            )

            stopping = asyncio.ensure_future(server.stop(grace_seconds=30))
            health: Any = health_pb2_grpc.HealthStub(channel)

            async def draining() -> bool:
                if stopping is not None and stopping.done():
                    return True
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                except grpc.aio.AioRpcError:
                    return True
                return bool(reply.status != health_pb2.HealthCheckResponse.SERVING)

            await wait_until(draining, "the server draining")
            assert not stopping.done()  # waiting for the call in flight
            pod.answering.set()
            response = await held
            await stopping
    finally:
        if stopping is None:
            await server.stop(grace_seconds=0)
        await pod.stop()
    assert response.model.name == "topic-minilm"


async def test_the_watcher_outlives_an_unexpected_error_and_counts_it(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", 50052))
    applied: list[RouteTable] = []
    failures: list[Exception] = []

    def apply_after_the_first(table: RouteTable) -> None:
        applied.append(table)
        if len(applied) == 1:
            raise RuntimeError("a bug while applying the first edit")

    watcher = asyncio.ensure_future(
        RoutesWatcher(routes, apply_after_the_first, failures.append, poll_seconds=0.05).run()
    )
    try:
        replace_file(routes, routes_to("static", 50052))
        await wait_until(lambda: len(failures) == 1)
        assert isinstance(failures[0], RuntimeError)
        replace_file(routes, routes_to("minilm", 50052))
        await wait_until(lambda: len(applied) == 2)
        assert applied[1].default_route.backend.name == "minilm"
        assert not watcher.done()
    finally:
        await stop_watcher(watcher, "routes watcher")


async def test_stopping_a_watcher_that_died_of_an_error_logs_it_instead_of_raising(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both servers' stop() go on to drain after this returns; raising here, as
    awaiting the dead task did, skipped the drain."""

    async def fails_at_once() -> None:
        raise TypeError("unhashable type: 'list'")

    watcher = asyncio.ensure_future(fails_at_once())
    await asyncio.wait({watcher})
    with caplog.at_level(logging.ERROR):
        await stop_watcher(watcher, "routes watcher")
    [record] = [r for r in caplog.records if r.exc_info]
    assert record.getMessage() == "the routes watcher had stopped on an error; draining anyway"
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], TypeError)


async def test_a_file_written_in_pieces_is_read_once_it_holds_still(tmp_path: Path) -> None:
    """Truncated and written in two pieces, as some editors save: the first piece
    parses on its own (the default route without its fallback), and is not applied;
    the whole file is, one poll after it stopped changing."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", 50052))
    applied: list[RouteTable] = []
    failures: list[Exception] = []
    watcher = RoutesWatcher(routes, applied.append, failures.append)
    whole = routes_to("minilm", 50052) + "    fallback: [static]\n"
    with routes.open("w") as editor:
        editor.write(routes_to("minilm", 50052))
        editor.flush()
        os.utime(routes, ns=(1, 1))  # a new identity even where mtime is coarse
        assert not await watcher.poll()  # changed: looked at again next poll
        editor.write("    fallback: [static]\n")
    assert routes.read_text() == whole
    assert not await watcher.poll()  # changed again since
    assert await watcher.poll()  # held still: read
    assert not await watcher.poll()  # and only once
    assert failures == []
    (table,) = applied
    assert [backend.name for backend in table.default_route.fallback] == ["static"]


async def test_an_edit_in_place_at_the_same_size_with_its_mtime_put_back_is_read(
    tmp_path: Path,
) -> None:
    """Inode, size and mtime all as before (`rsync --inplace`, a tar extraction, `touch
    -r`): only the ctime tells the edit apart; without it the edit was never applied."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", 50052))
    before = os.stat(routes)
    applied: list[RouteTable] = []
    failures: list[Exception] = []
    watcher = RoutesWatcher(routes, applied.append, failures.append)
    with routes.open("r+") as editor:  # the same inode
        editor.write(routes_to("minilm", 50053))  # the same length
    os.utime(routes, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(routes)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert not await watcher.poll()  # changed: looked at again next poll
    assert await watcher.poll()  # held still: read
    assert failures == []
    (table,) = applied
    assert {target for backend in table.backends.values() for target in backend.targets} == {
        "127.0.0.1:50053"
    }


async def test_an_edit_made_while_the_server_starts_is_applied(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """Read when the server was built, edited before it started (a ConfigMap update
    during a pod's start, a worker process among many): the edit is applied, not taken
    for the file the routes in force came from."""
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(routes_to("minilm", capability.port))
    server = OrchestratorServer(
        orchestrator_settings(port=0, routes_file=routes_file, routes_poll_seconds=0.05),
        registry=CollectorRegistry(),
    )
    replace_file(routes_file, routes_to("static", capability.port))
    await server.start()
    try:
        await wait_until(
            lambda: metric_sum(server.registry, ROUTES_RELOADS_TOTAL, outcome="ok") == 1,
            "the edit applied",
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            answer = await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
    finally:
        await server.stop(grace_seconds=0)
    assert answer.model.name == "topic-static"


def reload_series(registry: CollectorRegistry) -> dict[str, float]:
    """The routes-reload series the registry exports now, by outcome (absent: not there)."""
    return {
        sample.labels["outcome"]: sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == ROUTES_RELOADS_TOTAL
    }


async def test_the_first_refused_edit_moves_an_exported_zero_to_one(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """A series made at its first event appears at 1, and the increase() of the
    ClassifyRoutesReloadFailed alert sees no increase in it: the first (most often the
    only) refused edit never fired it. Both outcomes are exported at 0 from the start."""
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(routes_to("minilm", capability.port))
    server = OrchestratorServer(
        orchestrator_settings(port=0, routes_file=routes_file, routes_poll_seconds=0.05),
        registry=CollectorRegistry(),
    )
    await server.start()
    try:
        assert reload_series(server.registry) == {"ok": 0, "failed": 0}
        replace_file(routes_file, routes_to("no-such-backend", capability.port))
        await wait_until(lambda: reload_series(server.registry)["failed"] == 1, "the edit refused")
        assert reload_series(server.registry) == {"ok": 0, "failed": 1}
    finally:
        await server.stop(grace_seconds=0)


def routes_on_dead_replicas(targets: list[str], retry_budget: str) -> str:
    """One route to two replicas that refuse every connection, retried up to twice
    (so each call wants one retry from `retry_budget` per failed attempt)."""
    return (
        "version: 1\n"
        f"retry_budget: {retry_budget}\n"
        "backends:\n"
        f"  dead: {{model: topic-minilm, targets: {targets}}}\n"
        "routes:\n"
        "  - name: default\n"
        "    backend: dead\n"
        "    retry: {max_attempts: 3, initial_backoff: 1ms, max_backoff: 2ms}\n"
    )


async def test_an_edit_keeps_the_retry_budget_spent_unless_it_changes_the_budget(
    tmp_path: Path,
) -> None:
    """Every edit, a comment included, once made a fresh retry budget: an edit during a
    retry storm gave the failing fleet a new window of retries."""
    dead = [f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"]
    # No share of traffic, and a floor of 1.2 retries a minute: one retry, then none.
    one_retry_a_minute = "{ratio: 0, min_retries_per_second: 0.02, window: 60s}"
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_on_dead_replicas(dead, one_retry_a_minute))
    server = await watching_orchestrator(routes)

    async def retries_of_one_call(
        stub: classify_service_pb2_grpc.ClassifyServiceAsyncStub,
    ) -> float:
        before = metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL)
        error = await refusal(stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        return metric_sum(server.registry, UPSTREAM_RETRIES_TOTAL) - before

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            assert await retries_of_one_call(stub) == 1
            assert await retries_of_one_call(stub) == 0, "the budget is spent"

            replace_file(routes, routes.read_text() + "# a comment, and nothing else\n")
            await wait_until(lambda: applied_reloads(server) == 1, "the comment edit applied")
            assert await retries_of_one_call(stub) == 0, "the edit gave the budget back"

            # A new budget starts empty: its floor allows a retry at once.
            replace_file(
                routes,
                routes_on_dead_replicas(
                    dead, "{ratio: 0, min_retries_per_second: 0.03, window: 60s}"
                ),
            )
            await wait_until(lambda: applied_reloads(server) == 2, "the budget edit applied")
            assert await retries_of_one_call(stub) == 1
    finally:
        await server.stop(grace_seconds=0)


async def test_a_backend_an_edit_removes_leaves_no_series_behind(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """Its in-flight gauge read the closed pool, at 0, for the rest of the process."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", capability.port))
    server = await watching_orchestrator(routes)
    try:

        def in_flight(backend: str) -> float | None:
            return server.registry.get_sample_value(BACKEND_IN_FLIGHT, {"backend": backend})

        assert (in_flight("minilm"), in_flight("static")) == (0, 0)
        only_static = routes_to("static", capability.port).replace(
            f'  minilm: {{model: topic-minilm, targets: ["127.0.0.1:{capability.port}"]}}\n', ""
        )
        replace_file(routes, only_static)
        await wait_until(lambda: in_flight("minilm") is None, "minilm's series gone")
        # The backend the edit kept still reads its pool.
        assert in_flight("static") == 0
    finally:
        await server.stop(grace_seconds=0)


async def test_an_edit_naming_a_model_no_replica_serves_is_applied_and_logged(
    capability: CapabilityServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Applied (a file cannot know what replicas serve, and a replica may be added
    later), but said at once, with the backend and its replicas, instead of only by
    each call that then failed or fell back."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", capability.port))
    caplog.set_level(logging.WARNING, logger="orchestrator.fleet")
    server = await watching_orchestrator(routes)
    try:
        replace_file(
            routes, routes_to("minilm", capability.port).replace("topic-minilm", "topic-minlm")
        )
        await wait_until(
            lambda: any(
                r.getMessage() == "backend names a model its replicas do not serve"
                for r in caplog.records
            ),
            "the misspelt model logged",
        )
        (line,) = [r for r in caplog.records if r.name == "orchestrator.fleet"]
        assert (line.backend, line.model, line.targets) == (  # type: ignore[attr-defined]
            "minilm",
            "topic-minlm",
            [f"127.0.0.1:{capability.port}"],
        )
    finally:
        await server.stop(grace_seconds=0)


async def test_the_model_check_follows_a_name_target_to_its_addresses(
    capability: CapabilityServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A name's first look-up replaced its channel while the check asked it (the
    Kubernetes routes name a Service): the call was cancelled, and the whole check
    ended without a word."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(routes_to("minilm", capability.port))
    caplog.set_level(logging.WARNING, logger="orchestrator.fleet")
    server = await watching_orchestrator(routes)
    try:
        misspelt = routes_to("minilm", capability.port).replace("topic-minilm", "topic-minlm")
        replace_file(routes, misspelt.replace("127.0.0.1:", "localhost:"))
        await wait_until(
            lambda: any(r.name == "orchestrator.fleet" for r in caplog.records),
            "the misspelt model logged",
            20,
        )
        (line,) = [r for r in caplog.records if r.name == "orchestrator.fleet"]
        assert line.backend == "minilm"  # type: ignore[attr-defined]
        assert f"127.0.0.1:{capability.port}" in line.targets  # type: ignore[attr-defined]
    finally:
        await server.stop(grace_seconds=0)

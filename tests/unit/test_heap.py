"""A stopped server leaves nothing behind in its process: what freeze_heap froze at
its start is handed back to the collector at its stop (classify_common.serving)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from capability.server import CapabilityServer
from orchestrator.server import OrchestratorServer
from tests.conftest import capability_settings, orchestrator_settings, wait_until, write_routes


async def wait_collected(served: Callable[[], object | None], what: str) -> None:
    def collected() -> bool:
        # gRPC's server tasks let go of the servicers a few turns of the loop after stop.
        gc.collect()
        return served() is None

    await wait_until(collected, what, limit_seconds=5)


async def test_a_stopped_capability_servers_models_are_collected(model_root: Path) -> None:
    """The pool, built before the heap was frozen, and the models it loaded after
    refer to each other: while the pool stayed frozen, every stopped server's models
    stayed allocated. The test suite, which starts one after another in one process,
    grew by 160 MB a server, to 18 GB."""
    server = CapabilityServer(
        capability_settings(
            model_root, models=("topic-static",), default_model="topic-static", gc_freeze="on"
        ),
        registry=CollectorRegistry(),
    )
    await server.start()
    await server.warm_up()
    served = weakref.ref(server.pool.workers[0].replicas["topic-static"].bundle.classifier)
    await server.stop(grace_seconds=0)
    del server
    await wait_collected(served, "the stopped capability server's model collected")


async def test_a_stopped_orchestrators_routing_is_collected(tmp_path: Path) -> None:
    """Frozen when it went SERVING, all of an orchestrator stayed after its stop."""
    routes = write_routes(tmp_path / "routes.yaml", ["127.0.0.1:1"])
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, gc_freeze="on"), registry=CollectorRegistry()
    )
    await server.start()
    assert gc.get_freeze_count() > 0  # it froze the heap
    served = weakref.ref(server.dispatcher)
    await server.stop(grace_seconds=0)
    del server
    await wait_collected(served, "the stopped orchestrator's dispatcher collected")


async def test_an_orchestrator_freezes_its_heap_before_its_port_opens(tmp_path: Path) -> None:
    """The freeze's full collection holds the event loop for 30-140 ms; made once the
    port was open, the first calls taken in waited for it."""
    routes = write_routes(tmp_path / "routes.yaml", ["127.0.0.1:1"])
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, gc_freeze="on"), registry=CollectorRegistry()
    )
    ports_at_full_collections: list[int] = []

    def note_port(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            ports_at_full_collections.append(server.serving.port)

    gc.callbacks.append(note_port)
    try:
        await server.start()
    finally:
        gc.callbacks.remove(note_port)
    try:
        assert server.serving.port != 0
        # The freeze's collection, the first full one, ran with no port bound yet.
        assert ports_at_full_collections[:1] == [0]
    finally:
        await server.stop(grace_seconds=0)


async def test_an_orchestrator_told_gc_freeze_off_leaves_the_heap_unfrozen(
    tmp_path: Path,
) -> None:
    routes = write_routes(tmp_path / "routes.yaml", ["127.0.0.1:1"])
    frozen_before = gc.get_freeze_count()
    server = OrchestratorServer(
        orchestrator_settings(routes_file=routes, gc_freeze="off"), registry=CollectorRegistry()
    )
    await server.start()
    try:
        # Frozen, everything built since the last freeze would have joined (thousands);
        # a frozen object freed meanwhile leaves it (so not ==).
        assert gc.get_freeze_count() <= frozen_before
    finally:
        await server.stop(grace_seconds=0)

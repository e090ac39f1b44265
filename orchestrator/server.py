"""The orchestrator server: wiring, health and graceful shutdown."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
import urllib.parse
from collections.abc import Sequence
from multiprocessing.connection import Connection

from prometheus_client import CollectorRegistry, Gauge

from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from classify_common.file_watch import FileWatcher, file_identity
from classify_common.metrics import MetricsEndpoint, RequestOutcomes
from classify_common.serving import (
    GrpcServing,
    freeze_heap,
    run_server,
    serve_until_signal,
    stop_watcher,
    thaw_heap,
)
from classify_common.settings import SettingsError, read_token, setting_file
from orchestrator.calls import RoutingState
from orchestrator.config import OrchestratorSettings
from orchestrator.dispatch import Dispatcher
from orchestrator.fleet import FleetModels, check_backend_models
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.policy.backlog import FrontDoorBacklog
from orchestrator.routing import Backend, RoutesFileError, RouteTable, load_routes
from orchestrator.routing.watcher import RoutesWatcher
from orchestrator.security import ApiKeys, CallerGate, KeysFileError, load_api_keys
from orchestrator.service import ClassifyServicer, ModelServicer
from orchestrator.shadow import ShadowTraffic
from orchestrator.state import StateMetrics, open_shared_state
from orchestrator.upstream import BackendPool, UpstreamPools
from orchestrator.workers import (
    LOOP_HEARTBEAT,
    LOOP_HEARTBEAT_SECONDS,
    WorkerStartFailed,
    supervise,
)

log = logging.getLogger(__name__)


class OrchestratorServer:
    """Loads the route table, opens upstream channels, serves ClassifyService, and
    applies valid edits of the routes file while serving."""

    def __init__(
        self,
        settings: OrchestratorSettings,
        registry: CollectorRegistry | None = None,
        *,
        shares_port: bool = False,
    ):
        """`shares_port`: one of the worker processes of orchestrator.workers, which all
        listen on one port."""
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = OrchestratorMetrics(self.registry)
        self.request_outcomes = RequestOutcomes(self.registry)
        # Bad keys or routes files stop start-up here, with the bad value named.
        keys = self._load_api_keys_at_start(settings) if settings.auth == "required" else None
        if keys is None:
            log.warning("authentication is disabled: every caller is anonymous (development only)")
        self._internal_token = read_token(settings, "internal_token_file")
        # Read once, as the token is: read again at each routes edit, a CA file being
        # rotated (or a client certificate expired) refused every edit, a comment's
        # included, as a bad routes file, which `check` then passed.
        self._upstream_tls = settings.upstream_tls()
        self.state = open_shared_state(
            settings, keys.tenant_limits if keys else {}, StateMetrics(self.registry)
        )
        self.dispatcher = Dispatcher(
            self._routing_state(self._load_routes_at_start(settings)),
            self.metrics,
            self.state.results,
            outcomes=self.request_outcomes,
            on_internal_error=lambda: self.serving.rpc_metrics.internal_errors.inc(),
            shadow=ShadowTraffic(self.metrics.shadow, settings.shadow_max_in_flight),
        )
        self.backlog = FrontDoorBacklog(settings.backlog())
        self.metrics.late_arrivals.set_function(lambda: self.backlog.worst_late_share)
        self.gate = CallerGate(keys, self.metrics, self.state.limits, self.backlog)
        self.serving = GrpcServing.contract_server(
            settings,
            self.registry,
            gate=self.gate,
            edge=True,
            shares_port=shares_port,
            outcomes=self.request_outcomes,
        )
        self.serving.add_service(
            classify_service_pb2_grpc.add_ClassifyServiceServicer_to_server,
            ClassifyServicer(self.dispatcher),
        )
        self.serving.add_service(
            model_service_pb2_grpc.add_ModelServiceServicer_to_server,
            ModelServicer(FleetModels(self.dispatcher)),
        )
        self._watcher: asyncio.Task[None] | None = None
        self._keys_watcher: asyncio.Task[None] | None = None
        # Background checks of the backends' models, held until they end.
        self._model_checks: set[asyncio.Task[None]] = set()

    @property
    def routes(self) -> RouteTable:
        return self.dispatcher.state.table

    def _routing_state(
        self, table: RouteTable, carried_from: RoutingState | None = None
    ) -> RoutingState:
        """The state serving `table`; replacing `carried_from`, it keeps what the edit
        left as it was (backends' pools, the retry budget)."""

        def count_ejection(backend: Backend, target: str, seconds: float) -> None:
            self.metrics.outlier_ejections.labels(backend.name, target).inc()
            log.warning(
                "replica ejected",
                extra={"backend": backend.name, "target": target, "seconds": seconds},
            )

        upstream = UpstreamPools(
            table.backends,
            table.outlier_ejection,
            on_ejected=count_ejection,
            internal_token=self._internal_token,
            tls=self._upstream_tls,
            coalescing=self.settings.coalescing(),
            metrics=self.metrics.upstream,
            concurrency=self.settings.concurrency(),
            carried_from=carried_from.upstream if carried_from is not None else None,
        )
        return RoutingState(table, upstream, carried_from=carried_from)

    def _load_routes_at_start(self, settings: OrchestratorSettings) -> RouteTable:
        """The routes file's table; a file it cannot use is a SettingsError naming the
        flag and variable, then the file, line and path of the bad value."""
        path = setting_file(settings, "routes_file")
        assert path is not None  # the setting has a default, never None
        # The file as it was before this read: an edit that lands while the server is
        # still starting (a ConfigMap update, a worker process of many) is seen as one.
        self._routes_loaded = file_identity(path)
        try:
            return load_routes(path)
        except RoutesFileError as exc:
            raise SettingsError(f"{settings.names('routes_file')}: {exc}") from exc

    def _load_api_keys_at_start(self, settings: OrchestratorSettings) -> ApiKeys:
        """The keys file's keys; a file it cannot use is a SettingsError naming the flag
        and variable, then the file, line and path of the bad value."""
        path = setting_file(settings, "api_keys_file")
        assert path is not None  # required with --auth required (OrchestratorSettings)
        self._keys_loaded = file_identity(path)  # as for the routes file, above
        try:
            return load_api_keys(path)
        except KeysFileError as exc:
            raise SettingsError(f"{settings.names('api_keys_file')}: {exc}") from exc

    def _apply_keys(self, keys: ApiKeys) -> None:
        self.gate.replace_keys(keys)
        self.metrics.api_keys_reloads.labels("ok").inc()
        self.metrics.api_keys_file_refused.set(0)
        # Counts only: the file holds hashes, but nothing of it belongs in a log.
        log.info(
            "API keys reloaded",
            extra={"keys": len(keys.callers_by_hash), "tenant_limits": len(keys.tenant_limits)},
        )

    def _refuse_keys(self, error: Exception) -> None:
        # The watcher has logged it (a refusal with the file, line and path).
        self.metrics.api_keys_reloads.labels("failed").inc()
        self.metrics.api_keys_file_refused.set(1)

    def _apply_routes(self, table: RouteTable) -> None:
        previous = self.dispatcher.state
        self.dispatcher.replace(self._routing_state(table, previous))
        self.metrics.routes_reloads.labels("ok").inc()
        self.metrics.routes_file_refused.set(0)
        kept = previous.upstream.carried_over
        self._check_models(
            [
                pool
                for pool in self.dispatcher.state.upstream.pools()
                if pool.backend.name not in kept
            ]
        )
        log.info(
            "routes reloaded",
            extra={
                "routes": [route.name for route in table.routes],
                # Backends the edit left as they were keep their pools (UpstreamPools).
                "backends_kept": sorted(previous.upstream.carried_over),
            },
        )

    def _refuse_routes(self, error: Exception) -> None:
        # The watcher has logged it (a refusal with the file, line and path).
        self.metrics.routes_reloads.labels("failed").inc()
        self.metrics.routes_file_refused.set(1)

    @property
    def _state_host(self) -> str:
        """--state-url without its secrets, for logs: its scheme, host, port and
        database. Not the user and password before the host, nor the query, where
        redis-py also reads a `password=` (it was logged whole)."""
        parts = urllib.parse.urlsplit(self.settings.state_url or "")
        host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
        port = f":{parts.port}" if parts.port is not None else ""
        return f"{parts.scheme}://{host or ''}{port}{parts.path}"

    @property
    def port(self) -> int:
        return self.serving.port

    async def start(self) -> None:
        if self.state.redis is not None:
            # A refusal (wrong password, database number) stops start-up: SettingsError.
            if not await self.state.redis.check_at_start():
                # Serving anyway: calls are answered without it (docs/deploy.md#shared-state-redis).
                log.warning(
                    "shared state store did not answer at start", extra={"url": self._state_host}
                )
            self.state.redis.start_probe()
        if self.settings.freezes_heap:
            # Before the port opens: the freeze's full collection holds the event loop
            # for 30-140 ms, and the first calls, taken in, waited for it.
            freeze_heap()
        await self.serving.start()
        await self.serving.set_serving(True, freeze=False)
        if self.settings.routes_poll_seconds > 0:
            watcher = RoutesWatcher(
                self.settings.routes_file,
                self._apply_routes,
                self._refuse_routes,
                self.settings.routes_poll_seconds,
                loaded=self._routes_loaded,
            )
            self._watcher = asyncio.create_task(watcher.run(), name="routes-watcher")
        if self.settings.auth == "required" and self.settings.keys_poll_seconds > 0:
            assert self.settings.api_keys_file is not None  # checked at start
            keys_watcher = FileWatcher(
                self.settings.api_keys_file,
                load_api_keys,
                KeysFileError,
                self._apply_keys,
                self._refuse_keys,
                self.settings.keys_poll_seconds,
                what="API keys file",
                kept="the keys in force stay",
                loaded=self._keys_loaded,
            )
            self._keys_watcher = asyncio.create_task(keys_watcher.run(), name="keys-watcher")

    def _check_models(self, pools: list[BackendPool]) -> None:
        """Check, in the background, that the replicas of `pools` serve their backends'
        models (fleet.check_backend_models: a misspelt model name is logged)."""
        if not pools:
            return
        check = asyncio.create_task(check_backend_models(pools), name="backend-model-check")
        self._model_checks.add(check)
        check.add_done_callback(self._model_checks.discard)

    async def stop(self, grace_seconds: float | None = None) -> None:
        grace = self.settings.grace_seconds if grace_seconds is None else grace_seconds
        for check in list(self._model_checks):
            check.cancel()
        if self._watcher is not None:
            await stop_watcher(self._watcher, "routes watcher")
            self._watcher = None
        if self._keys_watcher is not None:
            await stop_watcher(self._keys_watcher, "API keys watcher")
            self._keys_watcher = None
        try:
            await self.serving.stop(grace)
            await self.dispatcher.close()
            await self.state.close()
        finally:
            if self.settings.freezes_heap:
                thaw_heap()  # frozen at its start, before the port opened


async def serve(settings: OrchestratorSettings) -> None:
    server = OrchestratorServer(settings)

    async def start() -> dict[str, object]:
        await server.start()
        return {
            "port": server.port,
            # null with --metrics-port -1: 0 would read as "any free port".
            "metrics_port": server.serving.metrics_port or None,
            "routes_file": str(settings.routes_file),
            "routes": [route.name for route in server.routes.routes],
        }

    await serve_until_signal(server, start, log)


async def serve_worker(settings: OrchestratorSettings, index: int, ready: Connection) -> None:
    """One of several processes on the port (orchestrator.workers): its /metrics on a
    loopback port of its own, which it sends the supervisor once serving."""
    server = OrchestratorServer(settings, shares_port=True)
    heartbeat = Gauge(
        LOOP_HEARTBEAT,
        "Unix time of this worker's event loop's last beat (every second): the supervisor "
        "stops a worker whose loop has not beaten for a while (orchestrator.workers).",
        registry=server.registry,
    )

    # Held here: the loop keeps only a weak reference to a task. It runs until the
    # process's loop ends (asyncio.run cancels it).
    beating: list[asyncio.Task[None]] = []

    async def beat() -> None:
        while True:
            heartbeat.set(time.time())
            await asyncio.sleep(LOOP_HEARTBEAT_SECONDS)

    async def start() -> dict[str, object]:
        await server.start()
        beating.append(asyncio.create_task(beat(), name="loop-heartbeat"))
        metrics = MetricsEndpoint(server.registry, "127.0.0.1", 0)
        ready.send({"pid": os.getpid(), "metrics_port": metrics.port})
        ready.close()
        return {
            "worker": index,
            "pid": os.getpid(),
            "port": server.port,
            "metrics_port": metrics.port,
        }

    await serve_until_signal(server, start, log, event="worker serving")


START_ERRORS = (RoutesFileError, KeysFileError, SettingsError, WorkerStartFailed, OSError)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        settings = OrchestratorSettings.from_args(argv)
    except SettingsError as exc:  # one line naming flag and variable, not a traceback
        print(f"{OrchestratorSettings.PROG}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if settings.processes > 1:
        run = functools.partial(supervise, settings)
    else:
        run = functools.partial(serve, settings)
    run_server("orchestrator", settings, run, start_errors=START_ERRORS, log=log)


def main_worker(settings: OrchestratorSettings, index: int, ready: Connection) -> None:
    run = functools.partial(serve_worker, settings, index, ready)
    # Every line names its worker: the workers share the supervisor's stderr.
    run_server(
        "orchestrator",
        settings,
        run,
        start_errors=START_ERRORS,
        log=log,
        log_fields={"worker": index},
    )

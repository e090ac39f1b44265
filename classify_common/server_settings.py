"""The settings both servers take: where to listen, TLS, telemetry, shutdown, logs, loop.

Each layer subclasses ServerSettings, giving its ENV_PREFIX and its own default
ports (with `port_setting` and `metrics_port_setting`, so the help and bounds
stay declared here).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from classify_common.event_loop import EVENT_LOOPS, UVLOOP
from classify_common.settings import (
    Settings,
    SettingsError,
    otlp_endpoint_value,
    path_value,
    setting,
)
from classify_common.tls import ServerTls, server_tls

DEFAULT_HOST = "127.0.0.1"
DEFAULT_GRACE_SECONDS = 10.0
DEFAULT_LOG_LEVEL = "INFO"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_CORE_WAIT_LIMIT_SECONDS = 1
DEFAULT_INTAKE_LOOPS = 4
GC_FREEZE_ON = "on"
GC_FREEZE_CHOICES = (GC_FREEZE_ON, "off")
DEFAULT_HEALTH_WATCHES_PER_ADDRESS = 100


def port_setting(default: int) -> Any:
    """The gRPC port; each layer gives its own default."""
    return setting(
        default,
        "gRPC port (0: any free, logged in the serving line)",
        int,
        low=0,
        high=65535,
        noun="port ",
        note="0 picks a free port",
    )


def metrics_port_setting(default: int) -> Any:
    """The Prometheus /metrics port; each layer gives its own default."""
    return setting(
        default,
        "Prometheus /metrics port (0: any free, -1: off)",
        int,
        low=0,
        high=65535,
        off=-1,
        noun="port ",
        note="0 picks a free port",
    )


def bind_host(text: str) -> str:
    """--host: a name or an address, an IPv6 one with or without its brackets (`::1`,
    `[::1]`), kept bare. gRPC is given it bracketed and the /metrics endpoint bare
    (classify_common.serving.listen_address); one spelling failed one or the other."""
    host = text.strip()
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in bare or bare != host:
        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            raise ValueError(
                "not a host name or address (an IPv6 address is written ::1 or [::1]; "
                "the port is --port)"
            ) from None
    if not bare:
        raise ValueError("an empty host names no interface")
    return bare


@dataclass(frozen=True)
class ServerSettings(Settings):
    """What both servers take: where to listen, TLS, telemetry, shutdown, logs."""

    # Interface to bind. 127.0.0.1 keeps the server off the network; containers
    # set 0.0.0.0.
    host: str = setting(DEFAULT_HOST, "interface to bind (IPv6: ::1 or [::1])", bind_host)
    # Each layer declares its own default ports with port_setting()/metrics_port_setting().
    port: int = port_setting(0)
    metrics_port: int = metrics_port_setting(-1)
    # TLS: PEM certificate and key to serve with; with a client CA, callers must
    # present a certificate it signed (mTLS). None of them: plaintext.
    tls_cert_file: Path | None = setting(None, "PEM certificate to serve with (TLS)", path_value)
    tls_key_file: Path | None = setting(
        None, "PEM private key of that certificate (TLS)", path_value
    )
    tls_client_ca_file: Path | None = setting(
        None, "CA that client certificates must be signed by (mTLS)", path_value
    )
    # OTLP gRPC receiver for spans, host:port (Jaeger: 4317); None: the SDK's
    # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, and without it no export.
    otlp_endpoint: str | None = setting(
        None,
        "OTLP gRPC host:port for spans (none: OTEL_EXPORTER_OTLP_ENDPOINT, else no export)",
        otlp_endpoint_value,
    )
    # Share of traces started here that are kept (parent-based: a caller's decision
    # wins); None: the SDK's OTEL_TRACES_SAMPLER and _ARG, else 1 (keep all).
    trace_sample_ratio: float | None = setting(
        None, "share of new traces kept (none: OTEL_TRACES_SAMPLER, else 1)", float, low=0, high=1
    )
    # Seconds admitted or in-flight work gets to finish on SIGTERM.
    grace_seconds: float = setting(
        DEFAULT_GRACE_SECONDS, "drain time on SIGTERM", float, low=0, high=300, unit="s"
    )
    log_level: str = setting(DEFAULT_LOG_LEVEL, "log level", str.upper, choices=LOG_LEVELS)
    # uvloop: the loop's own work in C (classify_common/event_loop.py); asyncio: the
    # standard library's loop, for comparing or ruling uvloop out.
    event_loop: str = setting(UVLOOP, "event loop the server runs on", choices=EVENT_LOOPS)
    # Calls that arrive faster than the event loop takes them in wait in gRPC core,
    # in arrival order; one that has waited longer than this when the loop asks for
    # it is dropped (its caller sees CANCELLED), so that a loop that fell behind
    # serves calls whose callers are still there (classify_common.serving). Whole
    # seconds: core takes no less.
    core_wait_limit_seconds: int = setting(
        DEFAULT_CORE_WAIT_LIMIT_SECONDS,
        "longest a call waits in gRPC core for the event loop before it is dropped",
        int,
        low=1,
        high=3600,
        unit="s",
    )
    # Requests kept open in gRPC core for the next call of each hot method, beside
    # grpc.aio's own one (classify_common/intake_loops.py): calls are taken in without
    # waiting for the loop to ask again after each. 0: grpc's own only.
    intake_loops: int = setting(
        DEFAULT_INTAKE_LOOPS,
        "extra requests for the next call of Classify and ClassifyBatch kept open in "
        "gRPC core (0: grpc's own only)",
        int,
        low=0,
        high=64,
    )
    # on: what start-up built is frozen out of the collector's sight when the server
    # goes SERVING (classify_common.serving.freeze_heap), so full collections under
    # load walk the requests' objects only. off: for a process that embeds the
    # server and keeps its heap to itself, and for the test suite, whose process
    # starts hundreds of servers: each start's full collection walks the suite's
    # whole heap (about a quarter of the orchestrator tests' time).
    gc_freeze: str = setting(
        GC_FREEZE_ON,
        "freeze the start-up heap out of the garbage collector's sight",
        choices=GC_FREEZE_CHOICES,
    )
    # Health needs no credentials: one address may hold at most this many of the
    # server's 1,000 Watch streams (classify_common.serving). 0: no share per address,
    # for callers that all come from one address (a service mesh's sidecar, NAT).
    health_watches_per_address: int = setting(
        DEFAULT_HEALTH_WATCHES_PER_ADDRESS,
        "health Watch streams one caller address may hold open",
        int,
        low=1,
        high=1000,
        off=0,
    )

    @property
    def freezes_heap(self) -> bool:
        return self.gc_freeze == GC_FREEZE_ON

    def check_together(self) -> None:
        super().check_together()
        object.__setattr__(self, "host", self._bare_host())
        self.server_tls()  # refuses an incomplete set of TLS files now, not at bind time

    def _bare_host(self) -> str:
        """The host as bind_host keeps it, for settings built in code (`[::1]`)."""
        try:
            return bind_host(self.host)
        except ValueError as exc:
            raise SettingsError(f"{self.names('host')}: {self.host!r} is not valid: {exc}") from exc

    def server_tls(self) -> ServerTls | None:
        return server_tls(
            self.tls_cert_file,
            self.tls_key_file,
            self.tls_client_ca_file,
            self.names_of("tls_cert_file", "tls_key_file", "tls_client_ca_file"),
        )

"""Exit 0 when a server answers SERVING to the standard gRPC health check, else 1.

The container images' HEALTHCHECK runs it, since no grpc_health_probe binary
can be fetched at build time here; it needs only grpcio and
grpcio-health-checking, which both images have.

    python grpc_health_check.py [--port-env CAPABILITY_PORT] [--port 50052] [--host 127.0.0.1]

The port is taken from the environment variable named by --port-env when it
is set (the same variable the server reads), so a container started with
another port is still probed on the right one. Plaintext only: a server with
TLS needs its own check.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TIMEOUT_SECONDS = 2.0


def target_from(host: str, port: int, port_env: str, environ: Mapping[str, str]) -> str:
    """host:port, the port taken from `environ[port_env]` when that is set and not empty;
    an IPv6 host in brackets (gRPC reads `::1:50052` as a name). ValueError for a port
    that is not one."""
    value = environ.get(port_env, "") if port_env else ""
    number = int(value) if value else port
    if not 1 <= number <= 65535:
        raise ValueError(f"port {number} is outside 1..65535")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{number}"


def check(target: str, service: str, timeout_seconds: float) -> str:
    """The health status name the server reports (SERVING, NOT_SERVING, ...)."""
    with grpc.insecure_channel(target) as channel:
        # typeshed's HealthStub declares no methods; Check is generated at runtime.
        health: Any = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_seconds
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="port when --port-env is unset")
    parser.add_argument("--port-env", default="", help="environment variable holding the port")
    parser.add_argument("--service", default="", help='health service name ("": whole server)')
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help="seconds")
    args = parser.parse_args(argv)
    try:
        target = target_from(args.host, args.port, args.port_env, environ)
    except ValueError as error:
        where = f" ({args.port_env})" if args.port_env and environ.get(args.port_env) else ""
        print(f"health check: bad port{where}: {error}", file=sys.stderr)
        return 1
    try:
        status = check(target, args.service, args.timeout)
    except grpc.RpcError as error:
        print(f"{target}: health check failed: {error.code().name}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"{target}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make run`: start a capability server and the orchestrator in the foreground.

The capability server starts first; the orchestrator starts once the model
reports SERVING through gRPC health. Ctrl-C (or SIGTERM) stops both: each
drains its in-flight calls, and this script waits for them to exit.
A closed terminal (SIGHUP) stops both the same way, unless this runs under nohup.
Ports and paths come from the same environment variables the servers read
(CAPABILITY_PORT, ORCHESTRATOR_PORT, ORCHESTRATOR_ROUTES_FILE, ...). With
CAPABILITY_PORT set and no routes file named, the orchestrator reads a copy of
routes.yaml whose targets name that port (.run/routes-PORT.yaml); the commands
printed once ready name ORCHESTRATOR_PORT.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from classify_common.early_stop import LAUNCHER_PID_VARIABLE  # noqa: E402
from orchestrator.security import hash_key, new_key  # noqa: E402
from tools.make_credentials import write_private  # noqa: E402

RUN_DIR = Path(".run")
DEFAULT_CAPABILITY_PORT = "50052"
DEFAULT_ORCHESTRATOR_PORT = "50051"
READY_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 20.0
EXAMPLE_TEXT = "The striker scored twice in the final minutes of the cup match"


def wait_until_serving(name: str, process: subprocess.Popen[bytes], target: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    with grpc.insecure_channel(target) as channel:
        # typeshed's HealthStub declares no methods; Check is generated at runtime.
        health: Any = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"{name} exited with code {process.returncode} before serving")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"{name} did not report SERVING within {READY_TIMEOUT_SECONDS:.0f}s")


def start_server(
    arguments: Sequence[str], environment: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """`python ARGUMENTS...` (a server: `-m capability`) in a session of its own, out of
    reach of the terminal's Ctrl-C (this script stops it), asked to stop when this
    script dies without stopping it (classify_common.early_stop.stop_with_launcher):
    killed (SIGKILL, the OOM killer), it left both servers serving their ports, and the
    next `make run` found them taken."""
    return subprocess.Popen(
        [sys.executable, *arguments],
        env={**environment, LAUNCHER_PID_VARIABLE: str(os.getpid())},
        start_new_session=True,
    )


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()


def local_keys_file_text(key: str) -> str:
    """`make run`'s keys file: `key` for tenant `local`, without a rate limit."""
    return (
        "# Made by `make run`. Add keys with `python -m orchestrator.security new-key`\n"
        "# and append its entry: `keys` stays the last section of this file.\n"
        "# Tenant `local` has no rate limit. To give it one (calls per second, and\n"
        "# calls at once after a quiet spell), uncomment the two lines below; the\n"
        "# running orchestrator applies the edit within a second or two.\n"
        "# tenants:\n"
        "#   local: {rate_per_second: 200, burst: 400}\n"
        "keys:\n"
        f"  - id: make-run\n    sha256: {hash_key(key)}\n    tenant: local\n    role: user\n"
    )


def ensure_local_credentials() -> dict[str, str]:
    """Create, once, a local API key (user role) and the internal token, under .run/.

    The key's tenant has no rate limit, so that a first load test against `make
    run` measures the service rather than the limiter; the keys file says how to
    set one. Returns the environment that points both servers at them.
    """
    RUN_DIR.mkdir(exist_ok=True)
    key_file, keys_file, token_file = (
        RUN_DIR / "api-key",
        RUN_DIR / "api-keys.yaml",
        RUN_DIR / "internal-token",
    )
    if not (key_file.is_file() and keys_file.is_file()):
        key = new_key()
        write_private(key_file, key + "\n", replace=True)
        write_private(keys_file, local_keys_file_text(key), replace=True)
        print(f"created a local API key in {key_file} (the client reads it from there)")
    if not token_file.is_file():
        write_private(token_file, secrets.token_urlsafe(32) + "\n", replace=True)
    for path in (key_file, keys_file, token_file):
        path.chmod(0o600)  # made by a version that wrote them readable
    signers = RUN_DIR / "bundle-signers"  # made by `make bundles`, which signs with its key
    trust = {"CAPABILITY_TRUSTED_SIGNERS": str(signers)} if signers.is_file() else {}
    return {
        **trust,
        "ORCHESTRATOR_API_KEYS_FILE": str(keys_file),
        "ORCHESTRATOR_INTERNAL_TOKEN_FILE": str(token_file),
        "CAPABILITY_INTERNAL_TOKEN_FILE": str(token_file),
    }


def stop_signals() -> list[signal.Signals]:
    """SIGINT, SIGTERM, and SIGHUP unless this was started to ignore it (nohup): the
    servers run in sessions of their own, so a closed terminal's hangup reaches this
    script alone, whose default action for it left both servers running unstopped."""
    hangup = [] if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGINT, signal.SIGTERM, *hangup]


def interrupt_once(signum: int, frame: object) -> None:
    """Stop on the first stop signal and ignore the rest: Ctrl-C reaches make too, and
    make passes on what it gets, so a second one would cut the stop short."""
    for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_signal, signal.SIG_IGN)
    raise KeyboardInterrupt


def routes_for(capability_port: str) -> dict[str, str]:
    """The routes file setting for a capability on `capability_port`: none (routes.yaml,
    whose targets name the default port) unless that port is another and no routes
    file is named, and then a copy of routes.yaml with the port replaced, one per port:
    a running orchestrator follows its routes file, and a second stack started on other
    ports would otherwise point the first one's routes at its own capability."""
    if (
        capability_port == DEFAULT_CAPABILITY_PORT
        or os.environ.get("ORCHESTRATOR_ROUTES_FILE", "").strip()
    ):
        return {}
    text = Path("routes.yaml").read_text(encoding="utf-8")
    copy = RUN_DIR / f"routes-{capability_port}.yaml"
    RUN_DIR.mkdir(exist_ok=True)
    copy.write_text(
        text.replace(f"127.0.0.1:{DEFAULT_CAPABILITY_PORT}", f"127.0.0.1:{capability_port}"),
        encoding="utf-8",
    )
    return {"ORCHESTRATOR_ROUTES_FILE": str(copy)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/run_stack.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(argv)
    # An empty variable is an unset one, as the servers read it (classify_common.settings).
    capability_port = os.environ.get("CAPABILITY_PORT", "").strip() or DEFAULT_CAPABILITY_PORT
    orchestrator_port = os.environ.get("ORCHESTRATOR_PORT", "").strip() or DEFAULT_ORCHESTRATOR_PORT
    target = (
        f" --target 127.0.0.1:{orchestrator_port}"
        if orchestrator_port != DEFAULT_ORCHESTRATOR_PORT
        else ""
    )
    environment = {**os.environ, **ensure_local_credentials(), **routes_for(capability_port)}
    processes: list[subprocess.Popen[bytes]] = []
    # This script turns Ctrl-C, SIGTERM or a hangup into one orderly SIGTERM each.
    for stop_signal in stop_signals():
        signal.signal(stop_signal, interrupt_once)
    try:
        print(f"starting capability server on :{capability_port} (loading the model)...")
        capability = start_server(["-m", "capability"], environment)
        processes.append(capability)
        wait_until_serving("capability", capability, f"127.0.0.1:{capability_port}")
        orchestrator = start_server(["-m", "orchestrator"], environment)
        processes.append(orchestrator)
        wait_until_serving("orchestrator", orchestrator, f"127.0.0.1:{orchestrator_port}")
        print(
            "\nReady. In another terminal:\n"
            f'  .venv/bin/python -m classify_client{target} "{EXAMPLE_TEXT}"\n'
            "  .venv/bin/buf curl --protocol grpc --http2-prior-knowledge \\\n"
            '    -H "authorization: Bearer $(cat .run/api-key)" \\\n'
            f'    -d \'{{"text": "{EXAMPLE_TEXT}"}}\' \\\n'
            f"    http://127.0.0.1:{orchestrator_port}/ai.classify.v1.ClassifyService/Classify\n"
            "Ctrl-C stops both servers.\n",
            flush=True,
        )
        while all(process.poll() is None for process in processes):
            time.sleep(0.5)
        failed = next(process for process in processes if process.poll() is not None)
        print(f"a server exited with code {failed.returncode}; stopping the other", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # After a hangup the terminal is gone, and writing to it fails: stop all the same.
        with contextlib.suppress(OSError):
            print("\nstopping...", flush=True)
        return 0
    finally:
        stop(processes)


if __name__ == "__main__":
    sys.exit(main())

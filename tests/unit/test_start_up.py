"""Both servers' starts, as the real commands make them: where they listen, and how they
refuse a setting they cannot use. A refusal is one line naming the flag and its
variable, exit status 2, no traceback: printed by the command before its logs start
(`python -m orchestrator: error: ...`), or as the `cannot start` log line after."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from capability.config import CapabilitySettings
from orchestrator.config import OrchestratorSettings
from tests.conftest import REPO_ROOT, ProcessStarter, RedisServer, closed_port, write_routes

PORT_IN_USE = "the port is in use, or the host is not an address of this machine"
# Longest a refused start may take: the capability server imports torch first. A start
# that hangs (a named pipe given as a file) runs into it.
REFUSAL_TIMEOUT_SECONDS = 60


def refused_start(module: str, *flags: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `python -m module flags...` to its end: (exit status, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", module, *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=REFUSAL_TIMEOUT_SECONDS,
        env={**os.environ, **(env or {})},
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stderr


def settings_refusal(module: str, *flags: str, env: dict[str, str] | None = None) -> str:
    """The one line a command refused its settings with, before any log line."""
    status, stderr = refused_start(module, *flags, env=env)
    assert status == 2, stderr
    prefix = f"python -m {module}: error: "
    assert stderr.startswith(prefix), stderr
    assert stderr.count("\n") == 1, stderr
    return stderr.removeprefix(prefix).removesuffix("\n")


def start_refusal(module: str, *flags: str) -> str:
    """The error of the `cannot start` line a server logged before exiting with 2."""
    status, stderr = refused_start(module, *flags)
    assert status == 2, stderr
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    (refusal,) = [line for line in lines if line["event"] == "cannot start"]
    return str(refusal["error"])


@pytest.fixture
def routes(tmp_path: Path) -> Path:
    return write_routes(tmp_path / "routes.yaml", [f"127.0.0.1:{closed_port()}"])


def orchestrator_flags(routes: Path, *more: str) -> list[str]:
    return ["--auth", "disabled", "--routes-file", str(routes), "--port", "0", *more]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port something listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.fixture
def named_pipe(tmp_path: Path) -> Path:
    pipe = tmp_path / "settings.pipe"
    os.mkfifo(pipe)
    return pipe


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
@pytest.mark.parametrize("server", ["orchestrator", "capability"])
def test_both_servers_serve_grpc_and_metrics_on_an_ipv6_host_written_either_way(
    server: str, host: str, start_process: ProcessStarter, routes: Path, model_root: Path
) -> None:
    """gRPC took `[::1]` and read `::1:port` as a name; the /metrics endpoint took `::1`
    and looked `[::1]` up as a name: either spelling failed the start."""
    flags = ["--host", host, "--port", "0", "--metrics-port", "0"]
    if server == "orchestrator":
        flags += ["--auth", "disabled", "--routes-file", str(routes)]
    else:
        flags += ["--model-root", str(model_root), "--device", "cpu"]
        flags += ["--models", "topic-static", "--default-model", "topic-static"]
    started = start_process(server, *flags)
    with grpc.insecure_channel(f"[::1]:{started.port}") as channel:
        # typeshed's HealthStub declares no methods; Check is generated at runtime.
        health: Any = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    metrics_url = f"http://[::1]:{started.ready['metrics_port']}/metrics"
    with urllib.request.urlopen(metrics_url, timeout=10) as scraped:
        assert scraped.status == 200
        assert b"process_cpu_seconds_total" in scraped.read()


def test_a_metrics_port_in_use_is_refused_naming_its_flag(routes: Path, held_port: int) -> None:
    """It said only "[Errno 98] Address already in use"."""
    refusal = start_refusal(
        "orchestrator", *orchestrator_flags(routes, "--metrics-port", str(held_port))
    )
    assert refusal == (
        "--metrics-port / ORCHESTRATOR_METRICS_PORT: cannot listen on "
        f"127.0.0.1:{held_port}: {PORT_IN_USE}"
    )


def test_a_grpc_port_in_use_is_refused_naming_its_flag(routes: Path, held_port: int) -> None:
    flags = orchestrator_flags(routes, "--metrics-port", "-1")
    refusal = start_refusal("orchestrator", *flags, "--port", str(held_port))
    assert refusal == (
        f"--port / ORCHESTRATOR_PORT: cannot listen on 127.0.0.1:{held_port}: {PORT_IN_USE}"
    )


def test_a_model_root_without_bundles_is_refused_naming_its_flag(tmp_path: Path) -> None:
    flags = ("--model-root", str(tmp_path), "--port", "0", "--metrics-port", "-1")
    assert start_refusal("capability", *flags) == (
        f"--model-root / CAPABILITY_MODEL_ROOT: no model bundles under {tmp_path}; "
        "run `make bundles`"
    )


def test_missing_routes_and_keys_files_are_refused_naming_their_flags(
    tmp_path: Path, routes: Path
) -> None:
    missing = tmp_path / "absent.yaml"
    assert start_refusal("orchestrator", *orchestrator_flags(missing, "--metrics-port", "-1")) == (
        f"--routes-file / ORCHESTRATOR_ROUTES_FILE: cannot read {missing}: "
        "No such file or directory"
    )
    keys = ["--routes-file", str(routes), "--api-keys-file", str(missing), "--metrics-port", "-1"]
    assert start_refusal("orchestrator", *keys, "--port", "0") == (
        f"--api-keys-file / ORCHESTRATOR_API_KEYS_FILE: cannot read {missing}: "
        "No such file or directory"
    )


def test_a_routes_file_it_refuses_is_named_by_flag_then_file_and_line(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\nbackends:\n  static: {model: topic-static, targets: ['127.0.0.1:0']}\n"
        "routes:\n  - {name: default, backend: static}\n"
    )
    assert start_refusal("orchestrator", *orchestrator_flags(routes, "--metrics-port", "-1")) == (
        f"--routes-file / ORCHESTRATOR_ROUTES_FILE: {routes}:3: backends.static.targets[0]: "
        "'127.0.0.1:0' has a port outside 1..65535"
    )


def test_an_empty_path_is_refused_naming_its_flag_not_read_as_the_current_folder() -> None:
    """`--routes-file ""` was Path(""), the current folder: "`.`: cannot read: Is a
    directory", naming neither the flag nor the variable."""
    status, stderr = refused_start("orchestrator", "--auth", "disabled", "--routes-file", "")
    assert status == 2
    assert stderr.splitlines()[-1] == (
        "python -m orchestrator: error: argument --routes-file: '' is not valid: an empty "
        "path names no file (also settable as ORCHESTRATOR_ROUTES_FILE)"
    )


def test_an_empty_variable_is_an_unset_one() -> None:
    """A compose file or chart passing `${ROUTES:-}` through sets the variable empty when
    the operator set nothing: the default applies, as for OpenTelemetry's variables."""
    empty = {"ORCHESTRATOR_ROUTES_FILE": "", "ORCHESTRATOR_PORT": " ", "ORCHESTRATOR_STATE_URL": ""}
    settings = OrchestratorSettings.from_args(["--auth", "disabled"], empty)
    assert (settings.routes_file, settings.port, settings.state_url) == (
        Path("routes.yaml"),
        50051,
        None,
    )
    models = CapabilitySettings.from_args([], {"CAPABILITY_MODEL_CONFIG": ""})
    assert models.model_config is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--results-capacity", "0"],
            "--results-capacity / ORCHESTRATOR_RESULTS_CAPACITY: 0 is outside 1..1000000",
        ),
        (
            ["--routes-poll-seconds", "0.01"],
            "--routes-poll-seconds / ORCHESTRATOR_ROUTES_POLL_SECONDS: 0.01 is outside "
            "0.05..60, or 0 for off",
        ),
        (
            ["--health-watches-per-address", "5000"],
            "--health-watches-per-address / ORCHESTRATOR_HEALTH_WATCHES_PER_ADDRESS: 5000 is "
            "outside 1..1000, or 0 for off",
        ),
        (
            ["--metrics-port", "70000"],
            "--metrics-port / ORCHESTRATOR_METRICS_PORT: port 70000 is outside 0..65535, or -1 "
            "for off (0 picks a free port)",
        ),
    ],
    ids=["million", "poll-off", "watches-off", "metrics-off"],
)
def test_a_range_refusal_reads_as_written_with_its_off_value(
    flags: list[str], message: str
) -> None:
    """It left out the value that switches a feature off, and printed 1..1e+06."""
    assert settings_refusal("orchestrator", "--auth", "disabled", *flags) == message


def test_a_state_ca_file_is_checked_at_start_as_the_other_tls_files_are(
    tmp_path: Path,
) -> None:
    """A missing one was taken, and only a rediss:// connection failed, later."""
    missing = tmp_path / "absent.pem"
    state = ["--auth", "disabled", "--state-url", "rediss://127.0.0.1:6379/0"]
    assert settings_refusal("orchestrator", *state, "--state-ca-file", str(missing)) == (
        f"--state-ca-file / ORCHESTRATOR_STATE_CA_FILE: cannot read {missing}: "
        "No such file or directory"
    )
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    assert settings_refusal("orchestrator", *state, "--state-ca-file", str(garbage)).startswith(
        f"--state-ca-file / ORCHESTRATOR_STATE_CA_FILE: {garbage} holds no PEM CA certificate"
    )


def test_a_state_url_query_key_the_orchestrator_cannot_take_stops_the_start_with_one_line(
    redis_server: RedisServer,
) -> None:
    """redis-py hands an unknown key to its connection: a misspelt one was a TypeError
    traceback from the first command at start, exit status 1."""
    misspelt = f"{redis_server.url}?sokcet_timeout=1"
    refusal = settings_refusal("orchestrator", "--auth", "disabled", "--state-url", misspelt)
    assert refusal.startswith(
        "--state-url / ORCHESTRATOR_STATE_URL: its query key 'sokcet_timeout' is not one "
        "the orchestrator takes (client_name, db, "
    )


def test_an_exponent_yaml_reads_as_a_string_stops_the_start_saying_what_to_write(
    tmp_path: Path, routes: Path
) -> None:
    """`rate_per_second: 1e3` in the keys file stopped the start with "'1e3' is not a
    number", of a value that reads as one."""
    keys = tmp_path / "api-keys.yaml"
    keys.write_text("keys: []\ntenants:\n  acme: {rate_per_second: 1e3, burst: 10}\n")
    refusal = start_refusal(
        "orchestrator",
        *("--routes-file", str(routes), "--port", "0", "--api-keys-file", str(keys)),
    )
    assert refusal.endswith(
        "tenants.acme.rate_per_second: '1e3' is not a number: YAML reads it as a string "
        "(YAML 1.1 takes an exponent only after a dot and with a sign), so write 1000 or 1.0e+3"
    ), refusal


@pytest.mark.parametrize(
    ("server", "flag", "names", "before_logs"),
    [
        ("orchestrator", "--routes-file", "--routes-file / ORCHESTRATOR_ROUTES_FILE", False),
        ("orchestrator", "--api-keys-file", "--api-keys-file / ORCHESTRATOR_API_KEYS_FILE", False),
        (
            "orchestrator",
            "--internal-token-file",
            "--internal-token-file / ORCHESTRATOR_INTERNAL_TOKEN_FILE",
            False,
        ),
        (
            "orchestrator",
            "--upstream-ca-file",
            "--upstream-ca-file / ORCHESTRATOR_UPSTREAM_CA_FILE, "
            "--upstream-cert-file / ORCHESTRATOR_UPSTREAM_CERT_FILE, "
            "--upstream-key-file / ORCHESTRATOR_UPSTREAM_KEY_FILE",
            True,
        ),
        ("capability", "--model-config", "--model-config / CAPABILITY_MODEL_CONFIG", True),
    ],
    ids=["routes", "api-keys", "internal-token", "upstream-ca", "model-config"],
)
def test_a_named_pipe_given_as_a_settings_file_is_refused_not_waited_on(
    server: str,
    flag: str,
    names: str,
    before_logs: bool,
    named_pipe: Path,
    routes: Path,
    model_root: Path,
) -> None:
    """Opening it waited for a writer, and the start hung there for good."""
    if server == "orchestrator":
        flags = ["--routes-file", str(routes), "--port", "0", "--metrics-port", "-1"]
        flags += [] if flag == "--api-keys-file" else ["--auth", "disabled"]
    else:
        flags = ["--model-root", str(model_root), "--device", "cpu", "--port", "0"]
    flags += [flag, str(named_pipe)]
    message = f"{names}: {named_pipe} is a FIFO, not a regular file"
    if before_logs:
        assert settings_refusal(server, *flags) == message
    else:
        assert start_refusal(server, *flags) == message


def test_a_flag_wins_over_a_variable_it_cannot_parse(
    start_process: ProcessStarter, routes: Path
) -> None:
    """The variable was parsed first, and refused, though the flag overrode it."""
    unparsable = {"ORCHESTRATOR_METRICS_PORT": "abc"}
    started = start_process(
        "orchestrator", *orchestrator_flags(routes, "--metrics-port", "-1"), env=unparsable
    )
    assert started.ready["metrics_port"] is None
    # Used, it is refused as before.
    refusal = settings_refusal("orchestrator", *orchestrator_flags(routes), env=unparsable)
    assert refusal == (
        "--metrics-port / ORCHESTRATOR_METRICS_PORT: 'abc' is not valid: invalid literal for "
        "int() with base 10: 'abc'"
    )

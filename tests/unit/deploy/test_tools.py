"""The helper scripts the images and deployments rely on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.server import CapabilityServer
from orchestrator.metrics import RATE_LIMITED_TOTAL
from orchestrator.security.keys import load_api_keys
from orchestrator.server import OrchestratorServer
from tests.conftest import (
    REPO_ROOT,
    STRIKER,
    closed_port,
    metric_sum,
    orchestrator_settings,
    wait_until,
)
from tests.status_details import unpack
from tests.unit.deploy.manifests import DOCKER_DIR, dockerfile_instructions
from tests.unit.test_start_up import ipv6_loopback
from tools import build_images, grpc_health_check, make_credentials, run_stack

WEIGHTS_SHA = "3f1c0a9be2d4" + "0" * 52


@contextlib.contextmanager
def serving_health(host: str) -> Iterator[tuple[int, health.HealthServicer]]:
    """A gRPC server on `host` that answers the health service only."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(grace=None)


@pytest.fixture
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    with serving_health("127.0.0.1") as serving:
        yield serving


def test_health_check_passes_only_while_serving(
    health_server: tuple[int, health.HealthServicer],
) -> None:
    port, servicer = health_server
    argv = ["--port", str(port)]

    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert grpc_health_check.main(argv, environ={}) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert grpc_health_check.main(argv, environ={}) == 1


def test_health_check_reads_the_port_from_the_servers_variable(
    health_server: tuple[int, health.HealthServicer],
) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    argv = ["--port-env", "CAPABILITY_PORT", "--port", str(closed_port())]

    assert grpc_health_check.main(argv, environ={"CAPABILITY_PORT": str(port)}) == 0
    assert grpc_health_check.main(argv, environ={}) == 1


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_health_check_probes_an_ipv6_host() -> None:
    with serving_health("[::1]") as (port, servicer):
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        for host in ("::1", "[::1]"):
            assert grpc_health_check.main(["--host", host, "--port", str(port)], environ={}) == 0


@pytest.mark.parametrize("value", ["abc", "99999", "0"])
def test_health_check_fails_on_a_port_variable_that_is_no_port(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--port-env", "CAPABILITY_PORT", "--port", "50052"]

    assert grpc_health_check.main(argv, environ={"CAPABILITY_PORT": value}) == 1
    assert capsys.readouterr().err.startswith("health check: bad port (CAPABILITY_PORT): ")


def test_health_check_fails_when_nothing_listens(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--port", str(closed_port()), "--timeout", "0.5"]

    assert grpc_health_check.main(argv, environ={}) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_credentials_give_a_key_the_orchestrator_accepts(tmp_path: Path) -> None:
    created = make_credentials.make_credentials(tmp_path, "acme", 50, 100)

    key = (tmp_path / make_credentials.API_KEY_FILE).read_text().strip()
    keys = load_api_keys(tmp_path / make_credentials.API_KEYS_FILE)
    caller = keys.identify(key)
    assert caller is not None
    assert (caller.tenant, caller.role) == ("acme", "user")
    assert keys.tenant_limits["acme"].burst == 100
    assert (tmp_path / make_credentials.INTERNAL_TOKEN_FILE).read_text().strip()
    assert len(created) == 3
    assert all((tmp_path / name).stat().st_mode & 0o777 == 0o600 for name in created)


def test_credentials_are_made_once_and_kept(tmp_path: Path) -> None:
    make_credentials.make_credentials(tmp_path, "local", 200, 400)
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}

    assert make_credentials.make_credentials(tmp_path, "local", 200, 400) == []
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before


def test_the_token_copy_follows_the_credentials_token(tmp_path: Path) -> None:
    made, token_only = tmp_path / "credentials", tmp_path / "token"
    token_file = make_credentials.INTERNAL_TOKEN_FILE
    make_credentials.make_credentials(made, "local", 200, 400)
    assert make_credentials.copy_token(made, token_only, owner=None)
    assert not make_credentials.copy_token(made, token_only, owner=None)  # already equal
    (made / token_file).unlink()  # a new token: the copy is replaced
    make_credentials.make_credentials(made, "local", 200, 400)
    assert make_credentials.copy_token(made, token_only, owner=None)
    assert (token_only / token_file).read_text() == (made / token_file).read_text()
    assert (token_only / token_file).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("tenant", ["acme", "00123", "on"])
def test_credentials_name_the_tenant_as_given(tmp_path: Path, tenant: str) -> None:
    """Unquoted in the file, `00123` was the int 83 to YAML: another tenant."""
    make_credentials.make_credentials(tmp_path, tenant, 50, 100)
    key = (tmp_path / make_credentials.API_KEY_FILE).read_text().strip()
    keys = load_api_keys(tmp_path / make_credentials.API_KEYS_FILE)
    caller = keys.identify(key)
    assert caller is not None
    assert caller.tenant == tenant
    assert list(keys.tenant_limits) == [tenant]


def make_credentials_command(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "make_credentials.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("in_the_way", ["folder", "api-key"])
def test_credentials_over_a_file_in_the_way_are_refused_in_one_line(
    tmp_path: Path, in_the_way: str
) -> None:
    """A file where the folder goes, or a folder where a file goes: a traceback."""
    if in_the_way == "folder":
        blocked = tmp_path / "credentials"
        blocked.write_text("")
        expected = f"error: {blocked}: Not a directory\n"
    else:
        blocked = tmp_path / make_credentials.API_KEY_FILE
        blocked.mkdir()
        expected = f"error: {blocked}: Is a directory\n"
    made = make_credentials_command(str(blocked if in_the_way == "folder" else tmp_path))
    assert made.returncode == 1
    assert made.stderr == expected


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--rate", "-5"], "rate_per_second -5.0 must be a finite number above 0"),
        (["--rate", "nan"], "rate_per_second nan must be a finite number above 0"),
        (["--burst", "0"], "burst 0 must be an integer, at least 1"),
    ],
    ids=["negative-rate", "nan-rate", "no-burst"],
)
def test_credentials_with_a_limit_the_orchestrator_refuses_are_never_written(
    tmp_path: Path, flags: list[str], problem: str
) -> None:
    """`--rate -5` wrote a keys file the orchestrator then refused at its start."""
    made = make_credentials_command(str(tmp_path / "credentials"), *flags)
    assert made.returncode == 2
    assert (
        made.stderr.splitlines()[-1] == f"make_credentials.py: error: --rate / --burst: {problem}"
    )
    assert not (tmp_path / "credentials").exists()


@pytest.mark.parametrize("rate", [0.0000001, 1234567.0, 0.25])
def test_credentials_keep_the_rate_as_given(tmp_path: Path, rate: float) -> None:
    """Written with :g, 1e-07 was a string to YAML (the orchestrator refused the file) and
    1234567 became 1.23457e+06."""
    assert make_credentials_command(str(tmp_path), "--rate", repr(rate)).returncode == 0
    limit = load_api_keys(tmp_path / make_credentials.API_KEYS_FILE).tenant_limits["local"]
    assert limit.rate_per_second == rate


def test_make_run_secrets_are_never_readable_by_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written and then chmod-ed, they were readable by all in between (for good when
    stopped there); an existing file is narrowed as it is replaced."""
    monkeypatch.chdir(tmp_path)
    previous = os.umask(0)
    try:
        make_credentials.write_private(tmp_path / "new", "secret\n", replace=True)
        (tmp_path / "old").write_text("before\n")
        (tmp_path / "old").chmod(0o644)
        make_credentials.write_private(tmp_path / "old", "after\n", replace=True)
    finally:
        os.umask(previous)
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "old").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "old").read_text() == "after\n"


def test_make_run_key_has_no_rate_limit_and_its_file_shows_how_to_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # make run writes under .run/ in the working directory
    keys_file = Path(run_stack.ensure_local_credentials()["ORCHESTRATOR_API_KEYS_FILE"])

    keys = load_api_keys(keys_file)
    caller = keys.identify((tmp_path / ".run" / "api-key").read_text().strip())
    assert caller is not None
    assert caller.tenant == "local"
    assert keys.tenant_limits == {}

    # The commented example, uncommented where it stands (as the file says), is a limit
    # the orchestrator accepts.
    lines = keys_file.read_text().splitlines()
    start = lines.index("# tenants:")
    lines[start : start + 2] = [line.removeprefix("# ") for line in lines[start : start + 2]]
    keys_file.write_text("\n".join(lines) + "\n")
    limit = load_api_keys(keys_file).tenant_limits["local"]
    assert (limit.rate_per_second, limit.burst) == (200, 400)


async def test_make_run_key_is_not_refused_a_burst_by_a_real_orchestrator(
    capability: CapabilityServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    environment = run_stack.ensure_local_credentials()
    key = (tmp_path / ".run" / "api-key").read_text().strip()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "version: 1\n"
        "backends:\n"
        f"  static: {{model: topic-static, targets: ['127.0.0.1:{capability.port}']}}\n"
        "routes:\n"
        "  - {name: default, backend: static}\n"
    )
    orchestrator = OrchestratorServer(
        orchestrator_settings(
            routes_file=routes,
            auth="required",
            api_keys_file=Path(environment["ORCHESTRATOR_API_KEYS_FILE"]),
        ),
        registry=CollectorRegistry(),
    )
    await orchestrator.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
            # A batch item takes one token, so 1,024 items at once is a burst well past
            # any limit a key made for a laptop would have had (400 before).
            response = await stub.ClassifyBatch(
                pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=STRIKER)] * 1024),
                metadata=(("authorization", f"Bearer {key}"),),
                timeout=60,
            )
    finally:
        await orchestrator.stop(grace_seconds=0)
    # Other admission steps (a backend's concurrency limit) may refuse some items;
    # none may be refused by the tenant's rate limit.
    refusals = [
        info.reason
        for result in response.results
        if result.WhichOneof("outcome") == "error"
        for info in unpack(result.error, error_details_pb2.ErrorInfo)
    ]
    assert "RATE_LIMITED" not in refusals
    assert len(response.results) - len(refusals) >= 64
    assert metric_sum(orchestrator.registry, RATE_LIMITED_TOTAL) == 0


def test_capability_tag_names_model_weights_code_and_cuda_line() -> None:
    """The bundles build byte for byte the same from any commit: a tag of the weights
    alone named every commit's image the same, so a code fix never rolled out."""
    revision = "a358aa892985" + "0" * 28
    tag = build_images.capability_tag("topic-minilm", WEIGHTS_SHA, revision, "12.8.1")
    dirty = build_images.capability_tag("topic-minilm", WEIGHTS_SHA, revision + "-dirty", "12.8.1")

    assert tag == "topic-minilm:3f1c0a9be2d4-a358aa892985-cuda12.8"
    assert dirty == "topic-minilm:3f1c0a9be2d4-a358aa892985-dirty-cuda12.8"
    for made in (tag, dirty):
        assert re.fullmatch(r"[\w][\w.-]{0,127}", made.split(":")[1])  # a valid Docker tag
    assert build_images.orchestrator_tag(revision + "-dirty") == (
        "classify-orchestrator:a358aa892985-dirty"
    )


def test_a_working_tree_with_changes_is_built_as_dirty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build context carries the tree as it is: tagged and labelled as its commit,
    an image with uncommitted changes looked like that commit's."""

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "server.py").write_text("print('v1')\n")
    git("add", "server.py")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "v1")
    monkeypatch.setattr(build_images, "REPO_ROOT", tmp_path)

    clean = build_images.git_revision()
    (tmp_path / "server.py").write_text("print('v2')\n")
    changed = build_images.git_revision()
    git("checkout", "-q", "server.py")
    (tmp_path / "new.py").write_text("")
    added = build_images.git_revision()

    assert re.fullmatch(r"[0-9a-f]{40}", clean)
    assert changed == added == clean + "-dirty"


def test_build_script_defaults_match_the_dockerfile() -> None:
    # The first declaration with a value is the default; later ones inherit it.
    args: dict[str, str] = {}
    for keyword, rest in dockerfile_instructions(DOCKER_DIR / "capability.Dockerfile"):
        name, has_default, default = rest.partition("=")
        if keyword == "ARG" and has_default:
            args.setdefault(name, default)

    assert args["CUDA_VERSION"] == build_images.DEFAULT_CUDA_VERSION
    assert args["TORCH_INDEX_URL"] == build_images.torch_index_for(args["CUDA_VERSION"])
    assert args["MODEL"] == build_images.DEFAULT_MODEL


def test_build_script_dry_run_builds_bundles_then_the_labelled_image(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert build_images.main(["capability", "--dry-run"]) == 0

    first, second = capsys.readouterr().out.splitlines()
    assert "--target bundle-export" in first
    assert "WEIGHTS_SHA=" in second
    revision = build_images.short_revision(build_images.git_revision())
    assert f"-t 'topic-minilm:<its first 12>-{revision}-cuda12.8'" in second


async def test_a_server_make_run_started_is_stopped_when_the_script_is_killed(
    tmp_path: Path,
) -> None:
    """tools/run_stack.py SIGKILLed (the OOM killer, `kill -9`) left both servers
    serving, and the next `make run` found their ports taken: each server now gets
    SIGTERM, on which it drains and exits. Here the 'server' does what both servers'
    __main__ do first, and writes a file on SIGTERM."""
    for main in ("capability", "orchestrator"):
        assert "\nstop_with_launcher()\n" in (REPO_ROOT / main / "__main__.py").read_text()
    stopped = tmp_path / "stopped"
    server = (
        "from classify_common.early_stop import stop_with_launcher\n"
        "stop_with_launcher()\n"
        "import signal, sys, time\n"
        "def stop(signum, frame):\n"
        f"    open({str(stopped)!r}, 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('serving', flush=True)\n"
        "time.sleep(60)\n"
    )
    launcher = (
        "import os, sys, time\n"
        "from tools import run_stack\n"
        f"run_stack.start_server(['-c', {server!r}], os.environ)\n"
        "time.sleep(60)\n"
    )
    script = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        launcher,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert script.stdout is not None
        assert await asyncio.wait_for(script.stdout.readline(), timeout=30) == b"serving\n"
    finally:
        script.kill()
        await script.wait()
    await wait_until(stopped.exists, "the server told to stop", limit_seconds=10)

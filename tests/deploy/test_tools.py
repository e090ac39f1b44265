"""The helper scripts the images and deployments rely on."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from orchestrator.security.keys import load_api_keys
from tests.conftest import closed_port
from tests.deploy.manifests import DOCKER_DIR, dockerfile_instructions
from tools import build_images, grpc_health_check, make_credentials

WEIGHTS_SHA = "3f1c0a9be2d4" + "0" * 52


@pytest.fixture
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(grace=None)


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


def test_capability_tag_names_model_weights_and_cuda_line() -> None:
    tag = build_images.capability_tag("topic-minilm", WEIGHTS_SHA, "12.8.1")

    assert tag == "topic-minilm:3f1c0a9be2d4-cuda12.8"
    assert re.fullmatch(r"[\w][\w.-]{0,127}", tag.split(":")[1])  # a valid Docker tag


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
    assert "-t 'topic-minilm:<its first 12>-cuda12.8'" in second

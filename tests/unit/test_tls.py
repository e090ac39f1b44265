"""TLS at the front door and mutual TLS between the layers, with certificates made here."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from classify_common.settings import SettingsError
from classify_common.tls import client_tls, server_tls
from orchestrator.metrics import ROUTES_FILE_REFUSED
from orchestrator.server import OrchestratorServer
from tests.conftest import (
    STRIKER,
    StartCapability,
    metric_sum,
    orchestrator_settings,
    static_routes,
    wait_until,
)
from tests.status_details import refusal
from tests.unit.orchestrator.test_reload import applied_reloads, replace_file
from tests.unit.test_start_up import settings_refusal


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> None:
    """A test CA, and a server and a client certificate it signed (valid for 127.0.0.1)."""
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(
        "req",
        "-x509",
        *curve,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=classify-test-ca",
        cwd=directory,
    )
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl(
            "req",
            *curve,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=directory,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            "san.ext",
            cwd=directory,
        )


# What `openssl ca` needs to sign with make_certificates' CA at dates of the test's
# choosing: `openssl req -x509` and `x509 -req` take only a number of days from now
# (OpenSSL 3.0 has no -not_before).
CA_CONFIG = """\
[ca]
default_ca = test
[test]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = any
unique_subject = no
[any]
commonName = supplied
"""


def make_certificate_valid_between(directory: Path, name: str, start: str, end: str) -> Path:
    """`name`.pem (returned) and `name`.key in `directory`, where make_certificates has
    made its CA: a certificate it signed, valid from `start` to `end` (YYYYMMDDHHMMSSZ)."""
    (directory / "ca.cnf").write_text(CA_CONFIG)
    (directory / "index.txt").touch()
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory,
    )  # fmt: skip
    openssl(
        "ca", "-batch", "-config", "ca.cnf", "-create_serial", "-notext",
        "-cert", "ca.pem", "-keyfile", "ca.key", "-in", f"{name}.csr", "-out", f"{name}.pem",
        "-startdate", start, "-enddate", end, cwd=directory,
    )  # fmt: skip
    return directory / f"{name}.pem"


@contextlib.asynccontextmanager
async def tls_front_door(
    directory: Path, capability_port: int, **settings: Any
) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator serving TLS with make_certificates' server certificate, one
    route to topic-static at `capability_port`; `settings`: more of its settings."""
    routes = directory / "routes.yaml"
    routes.write_text(static_routes(f"127.0.0.1:{capability_port}"))
    orchestrator = OrchestratorServer(
        orchestrator_settings(
            routes_file=routes,
            tls_cert_file=directory / "server.pem",
            tls_key_file=directory / "server.key",
            **settings,
        ),
        registry=CollectorRegistry(),
    )
    await orchestrator.start()
    try:
        yield orchestrator
    finally:
        await orchestrator.stop(grace_seconds=0)


async def test_tls_front_door_and_mutual_tls_to_the_capability_server(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    make_certificates(tmp_path)
    capability = await start_capability(
        models=("topic-static",),
        tls_cert_file=tmp_path / "server.pem",
        tls_key_file=tmp_path / "server.key",
        tls_client_ca_file=tmp_path / "ca.pem",
    )
    trust = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
    request = pb.ClassifyRequest(text=STRIKER)
    async with tls_front_door(
        tmp_path,
        capability.port,
        upstream_ca_file=tmp_path / "ca.pem",
        upstream_cert_file=tmp_path / "client.pem",
        upstream_key_file=tmp_path / "client.key",
    ) as orchestrator:
        async with grpc.aio.secure_channel(f"127.0.0.1:{orchestrator.port}", trust) as channel:
            response = await classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(
                request
            )
        assert response.labels[0].name == "sports"

        # No client certificate: the capability server does not complete the handshake.
        async with grpc.aio.secure_channel(f"127.0.0.1:{capability.port}", trust) as channel:
            no_cert = await refusal(
                classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(request, timeout=5)
            )
        assert no_cert.code() == grpc.StatusCode.UNAVAILABLE

        # Plaintext to a TLS front door fails as well.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
            plaintext = await refusal(
                classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(request, timeout=5)
            )
        assert plaintext.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_routes_edit_is_applied_while_the_upstream_ca_file_is_being_rotated(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    """The upstream TLS files were read again at each routes edit: while the CA file
    was being replaced (or the client certificate had expired), every edit, a comment
    included, was refused as a bad routes file (and alerted on), which `check` passed."""
    make_certificates(tmp_path)
    capability = await start_capability(
        models=("topic-static",),
        tls_cert_file=tmp_path / "server.pem",
        tls_key_file=tmp_path / "server.key",
        tls_client_ca_file=tmp_path / "ca.pem",
    )
    upstream_ca = tmp_path / "upstream-ca.pem"
    upstream_ca.write_bytes((tmp_path / "ca.pem").read_bytes())
    trust = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
    async with tls_front_door(
        tmp_path,
        capability.port,
        routes_poll_seconds=0.05,
        upstream_ca_file=upstream_ca,
        upstream_cert_file=tmp_path / "client.pem",
        upstream_key_file=tmp_path / "client.key",
    ) as orchestrator:
        upstream_ca.write_text("being rotated\n")
        routes = tmp_path / "routes.yaml"
        replace_file(routes, routes.read_text() + "# a comment\n")
        await wait_until(lambda: applied_reloads(orchestrator) == 1, "the edit applied")
        async with grpc.aio.secure_channel(f"127.0.0.1:{orchestrator.port}", trust) as channel:
            response = await classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(
                pb.ClassifyRequest(text=STRIKER), timeout=30
            )
        assert response.labels[0].name == "sports"
        assert metric_sum(orchestrator.registry, ROUTES_FILE_REFUSED) == 0


async def test_the_command_line_client_speaks_tls_with_the_default_roots_when_told(
    start_capability: StartCapability, tmp_path: Path
) -> None:
    """`--tls` verifies with gRPC's default roots, which GRPC_DEFAULT_SSL_ROOTS_FILE_PATH
    points at the test CA here; without it (or --ca-file) the client speaks plaintext."""
    make_certificates(tmp_path)
    capability = await start_capability(models=("topic-static",))
    environment = {
        **os.environ,
        "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(tmp_path / "ca.pem"),
    }
    for name in ("CLASSIFY_API_KEY", "CLASSIFY_CA_FILE", "CLASSIFY_TLS"):
        environment.pop(name, None)

    async def classify(*flags: str) -> tuple[int, str]:
        command = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "classify_client",
            *flags,
            STRIKER,
            cwd=tmp_path,
            env=environment,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await command.communicate()
        assert command.returncode is not None
        return command.returncode, output.decode()

    async with tls_front_door(tmp_path, capability.port) as orchestrator:
        environment["CLASSIFY_TARGET"] = f"127.0.0.1:{orchestrator.port}"
        told = await classify("--tls", "--timeout", "10")
        plaintext = await classify("--timeout", "2")
    assert told[0] == 0, told[1]
    assert told[1].split()[0] == "sports"
    assert plaintext[0] == 1
    assert "UNAVAILABLE" in plaintext[1]


def test_tls_files_that_cannot_work_are_refused_with_the_settings(tmp_path: Path) -> None:
    """gRPC said only "Invalid cert chain file" on its own stderr, and the start was
    refused as a port in use; a CA file of garbage was taken, and every call to the
    backends failed its handshake."""
    make_certificates(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    server, client = tmp_path / "server.pem", tmp_path / "client.key"
    cases = {
        "garbage certificate": (garbage, tmp_path / "server.key"),
        "another's key": (server, client),
    }
    for case, (cert, key) in cases.items():
        with pytest.raises(SettingsError, match=r"are not a PEM certificate and its key") as no:
            server_tls(cert, key, None, "--tls-cert-file, --tls-key-file")
        assert str(no.value).startswith(f"--tls-cert-file, --tls-key-file: {cert} and {key}"), case
    with pytest.raises(SettingsError, match=r"garbage\.pem holds no PEM CA certificate"):
        client_tls(garbage, None, None, "--upstream-ca-file")
    with pytest.raises(SettingsError, match=r"garbage\.pem holds no PEM CA certificate"):
        server_tls(server, tmp_path / "server.key", garbage, "--tls-client-ca-file")
    # The real set passes.
    assert server_tls(server, tmp_path / "server.key", tmp_path / "ca.pem", "flags") is not None
    assert client_tls(tmp_path / "ca.pem", tmp_path / "client.pem", client, "flags") is not None


def test_a_weak_certificate_grpc_serves_is_taken_and_an_encrypted_key_is_refused(
    tmp_path: Path,
) -> None:
    """The check followed this OpenSSL's default policy, which refused RSA-1024 (gRPC
    serves it), and an encrypted key (gRPC cannot use one) was prompted for on the
    terminal, holding the start."""
    openssl(
        "req", "-x509", "-newkey", "rsa:1024", "-nodes", "-keyout", "weak.key",
        "-out", "weak.pem", "-days", "1", "-subj", "/CN=weak", cwd=tmp_path,
    )  # fmt: skip
    assert server_tls(tmp_path / "weak.pem", tmp_path / "weak.key", None, "flags") is not None
    openssl(
        "pkey", "-in", "weak.key", "-aes256", "-passout", "pass:secret",
        "-out", "locked.key", cwd=tmp_path,
    )  # fmt: skip
    with pytest.raises(SettingsError, match=r"are not a PEM certificate and its key"):
        server_tls(tmp_path / "weak.pem", tmp_path / "locked.key", None, "flags")


def test_a_certificate_outside_its_validity_period_is_refused_naming_its_dates(
    tmp_path: Path,
) -> None:
    """OpenSSL loads a certificate whatever its dates and gRPC serves it: the server
    started, said SERVING, and every handshake failed (UNAVAILABLE). Its own and the
    upstream client certificate are both refused, the file and its dates named."""
    make_certificates(tmp_path)
    expired = make_certificate_valid_between(
        tmp_path, "expired", "20200101000000Z", "20210101000000Z"
    )
    early = make_certificate_valid_between(tmp_path, "early", "20990101000000Z", "20991231235959Z")
    with pytest.raises(SettingsError) as refused:
        server_tls(expired, tmp_path / "expired.key", None, "flags")
    assert str(refused.value) == (
        f"flags: {expired} has expired: it was valid from 2020-01-01 00:00:00 UTC to "
        "2021-01-01 00:00:00 UTC"
    )
    with pytest.raises(SettingsError) as refused:
        client_tls(tmp_path / "ca.pem", early, tmp_path / "early.key", "flags")
    assert str(refused.value) == (
        f"flags: {early} is not valid yet: it is valid from 2099-01-01 00:00:00 UTC to "
        "2099-12-31 23:59:59 UTC"
    )


def test_a_server_given_an_expired_certificate_stops_at_start_with_exit_status_2(
    tmp_path: Path,
) -> None:
    """The real command, as an operator runs it: one line naming the flags and variables,
    the file and its dates, exit status 2, no traceback, as other bad settings."""
    make_certificates(tmp_path)
    expired = make_certificate_valid_between(
        tmp_path, "expired", "20200101000000Z", "20210101000000Z"
    )
    refusal = settings_refusal(
        "orchestrator",
        *("--auth", "disabled", "--port", "0", "--metrics-port", "-1"),
        *("--tls-cert-file", str(expired), "--tls-key-file", str(tmp_path / "expired.key")),
    )
    assert refusal == (
        "--tls-cert-file / ORCHESTRATOR_TLS_CERT_FILE, --tls-key-file / ORCHESTRATOR_TLS_KEY_FILE, "
        "--tls-client-ca-file / ORCHESTRATOR_TLS_CLIENT_CA_FILE: "
        f"{expired} has expired: it was valid from 2020-01-01 00:00:00 UTC to "
        "2021-01-01 00:00:00 UTC"
    )

"""Signed bundles: with --trusted-signers set, only a manifest signed by a listed key loads.

Real keys, real `ssh-keygen`, real servers: each refusal is checked over gRPC, with
version 1 still answering afterwards.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc, model_service_pb2_grpc
from ai.classify.v1 import model_service_pb2 as model_pb
from capability.bundle import (
    BundleSignatureInvalid,
    BundleSignerUntrusted,
    check_manifest_signature,
    sign_manifest,
)
from capability.bundle.__main__ import main as bundle_command
from capability.bundle.signing import SIGNATURE_FILE
from capability.config import CapabilitySettings
from capability.metrics import RELOAD_RETRIES_TOTAL, RELOADS_TOTAL
from capability.server import CapabilityServer
from classify_common.settings import SettingsError
from tests.conftest import REPO_ROOT, STRIKER, StartCapability, metric_sum, wait_until

pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen")

MODEL = "topic-static"


@dataclass(frozen=True)
class Keys:
    trusted: Path  # private key listed in `signers`
    stranger: Path  # private key listed nowhere
    signers: Path  # allowed-signers file naming only `trusted`


def make_key(path: Path) -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
    )
    return path


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    folder = tmp_path_factory.mktemp("keys")
    trusted = make_key(folder / "release")
    stranger = make_key(folder / "stranger")
    key_type, key = (folder / "release.pub").read_text().split()[:2]
    signers = folder / "allowed-signers"
    signers.write_text(f"release@example.test {key_type} {key}\n")
    return Keys(trusted, stranger, signers)


def copy_version(model_root: Path, root: Path, version: str, key: Path | None) -> Path:
    destination = root / MODEL / version
    shutil.copytree(model_root / MODEL / "1", destination)
    if key is not None:
        sign_manifest(destination, key)
    return destination


async def start_trusting(
    model_root: Path, tmp_path: Path, keys: Keys, start_capability: StartCapability
) -> tuple[CapabilityServer, Path]:
    root = tmp_path / "models"
    copy_version(model_root, root, "1", keys.trusted)
    server = await start_capability(model_root=root, models=(MODEL,), trusted_signers=keys.signers)
    return server, root


async def reload(server: CapabilityServer, version: str) -> tuple[str, str]:
    """(version now serving, refusal details or "") after asking for `version`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        code, details = grpc.StatusCode.OK, ""
        try:
            await models.ReloadModel(model_pb.ReloadModelRequest(name=MODEL, version=version))
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or ""
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION)
        response = await classify_service_pb2_grpc.ClassifyServiceStub(channel).Classify(
            pb.ClassifyRequest(text=STRIKER, model=MODEL)
        )
    assert response.labels[0].name == "sports"
    return response.model.version, details


async def test_bundle_signed_by_a_trusted_key_loads(
    model_root: Path, tmp_path: Path, keys: Keys, start_capability: StartCapability
) -> None:
    server, root = await start_trusting(model_root, tmp_path, keys, start_capability)
    copy_version(model_root, root, "2", keys.trusted)

    assert await reload(server, "2") == ("2", "")


async def test_unsigned_bundle_is_refused_naming_the_signature_and_old_version_keeps_serving(
    model_root: Path, tmp_path: Path, keys: Keys, start_capability: StartCapability
) -> None:
    server, root = await start_trusting(model_root, tmp_path, keys, start_capability)
    copy_version(model_root, root, "2", key=None)

    serving, details = await reload(server, "2")

    assert serving == "1"
    assert f"{SIGNATURE_FILE}: not found" in details
    assert "version 1 keeps serving" in details


async def test_manifest_changed_after_signing_is_refused_and_old_version_keeps_serving(
    model_root: Path, tmp_path: Path, keys: Keys, start_capability: StartCapability
) -> None:
    server, root = await start_trusting(model_root, tmp_path, keys, start_capability)
    bundle = copy_version(model_root, root, "2", keys.trusted)
    manifest = bundle / "manifest.json"
    manifest.write_bytes(manifest.read_bytes() + b"\n")  # still valid JSON, other bytes

    serving, details = await reload(server, "2")

    assert serving == "1"
    assert f"{SIGNATURE_FILE}: does not match manifest.json's bytes" in details


async def test_bundle_signed_by_an_untrusted_key_is_refused_and_old_version_keeps_serving(
    model_root: Path, tmp_path: Path, keys: Keys, start_capability: StartCapability
) -> None:
    server, root = await start_trusting(model_root, tmp_path, keys, start_capability)
    copy_version(model_root, root, "2", keys.stranger)

    serving, details = await reload(server, "2")

    assert serving == "1"
    assert f"{SIGNATURE_FILE}: signed by a key not in the trusted signers" in details


def test_signature_check_returns_the_signers_principal(tmp_path: Path, keys: Keys) -> None:
    (tmp_path / "manifest.json").write_text('{"files": {}, "format_version": 1}\n')
    sign_manifest(tmp_path, keys.trusted)
    raw = (tmp_path / "manifest.json").read_bytes()

    assert check_manifest_signature(tmp_path, raw, keys.signers) == "release@example.test"


def test_a_key_listed_for_git_first_and_for_bundles_after_verifies_as_the_bundle_signer(
    tmp_path: Path, keys: Keys
) -> None:
    """An allowed-signers file shared with git lists the key twice, once a namespace.
    find-principals names only the first line, and verify as that principal refused a
    good signature ("not permitted for use in signature namespace")."""
    key_type, key = keys.trusted.with_suffix(".pub").read_text().split()[:2]
    shared = tmp_path / "allowed-signers"
    shared.write_text(
        f'dev@example.test namespaces="git" {key_type} {key}\n'
        f'release@example.test,ci@example.test namespaces="classify-bundle" {key_type} {key}\n'
    )
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text('{"files": {}, "format_version": 1}\n')
    sign_manifest(bundle, keys.trusted)
    raw = (bundle / "manifest.json").read_bytes()

    assert check_manifest_signature(bundle, raw, shared) == "release@example.test"

    # No line lets the key sign bundles: refused, naming what each principal was told.
    shared.write_text(
        f'dev@example.test namespaces="git" {key_type} {key}\n'
        f'ops@example.test namespaces="file" {key_type} {key}\n'
    )
    with pytest.raises(BundleSignatureInvalid) as refused:
        check_manifest_signature(bundle, raw, shared)
    assert "'dev@example.test': " in str(refused.value)
    assert "'ops@example.test': " in str(refused.value)


def test_signing_writes_past_a_link_planted_at_its_partial_file(tmp_path: Path, keys: Keys) -> None:
    """The signature was written through whatever link stood at `.manifest.json.sig.partial`:
    signing a folder someone else can write to overwrote a file of the operator's."""
    bundle, elsewhere = tmp_path / "bundle", tmp_path / "operators-file"
    bundle.mkdir()
    (bundle / "manifest.json").write_text('{"files": {}, "format_version": 1}\n')
    elsewhere.write_text("the operator's")
    (bundle / f".{SIGNATURE_FILE}.partial").symlink_to(elsewhere)
    sign_manifest(bundle, keys.trusted)
    raw = (bundle / "manifest.json").read_bytes()

    assert elsewhere.read_text() == "the operator's"
    assert sorted(path.name for path in bundle.iterdir()) == ["manifest.json", SIGNATURE_FILE]
    assert check_manifest_signature(bundle, raw, keys.signers) == "release@example.test"


def test_signature_by_a_stranger_is_refused_as_untrusted(tmp_path: Path, keys: Keys) -> None:
    (tmp_path / "manifest.json").write_text('{"files": {}, "format_version": 1}\n')
    sign_manifest(tmp_path, keys.stranger)
    raw = (tmp_path / "manifest.json").read_bytes()

    with pytest.raises(BundleSignerUntrusted, match=f"^{re.escape(SIGNATURE_FILE)}: "):
        check_manifest_signature(tmp_path, raw, keys.signers)


def test_trusted_signers_that_is_not_a_file_stops_start_up(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"^--trusted-signers / CAPABILITY_TRUSTED_SIGNERS: "):
        CapabilitySettings(trusted_signers=tmp_path / "absent")


async def test_unsigned_version_found_by_the_watcher_is_refused_and_old_version_keeps_serving(
    model_root: Path, tmp_path: Path, keys: Keys, start_capability: StartCapability
) -> None:
    root = tmp_path / "models"
    copy_version(model_root, root, "1", keys.trusted)
    server = await start_capability(
        model_root=root, models=(MODEL,), trusted_signers=keys.signers, watch_seconds=0.1
    )
    staging = copy_version(model_root, tmp_path / "staging", "2", key=None)
    staging.rename(root / MODEL / "2")

    await wait_until(
        lambda: metric_sum(server.registry, RELOADS_TOTAL, model=MODEL, outcome="refused") == 1
    )

    assert server.pool.serving(MODEL).version == "1"


async def test_a_version_refused_for_its_signer_loads_once_the_signer_is_trusted(
    model_root: Path, tmp_path: Path, keys: Keys, start_capability: StartCapability
) -> None:
    """Trusting the key (a line added to the trusted-signers file) changes no file of the
    version: the watcher never tried it again, and it waited for a ReloadModel."""
    signers = tmp_path / "allowed-signers"
    shutil.copy(keys.signers, signers)
    root = tmp_path / "models"
    copy_version(model_root, root, "1", keys.trusted)
    server = await start_capability(
        model_root=root, models=(MODEL,), trusted_signers=signers, watch_seconds=0.1
    )
    staging = copy_version(model_root, tmp_path / "staging", "2", keys.stranger)
    staging.rename(root / MODEL / "2")
    await wait_until(
        lambda: metric_sum(server.registry, RELOADS_TOTAL, model=MODEL, outcome="refused") == 1,
        "version 2 refused",
    )

    key_type, key = keys.stranger.with_suffix(".pub").read_text().split()[:2]
    with signers.open("a") as trusted:
        trusted.write(f"stranger@example.test {key_type} {key}\n")
    await wait_until(lambda: server.pool.serving(MODEL).version == "2", "version 2 serving")
    assert metric_sum(server.registry, RELOAD_RETRIES_TOTAL, model=MODEL) == 1


def test_verify_command_refuses_an_unsigned_bundle_given_trusted_signers(
    model_root: Path, tmp_path: Path, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = copy_version(model_root, tmp_path, "2", key=None)
    assert bundle_command(["verify", "--quiet", str(bundle)]) == 0

    status = bundle_command(
        ["verify", "--quiet", "--trusted-signers", str(keys.signers), str(bundle)]
    )

    assert status == 1
    assert f"error: {SIGNATURE_FILE}: not found" in capsys.readouterr().err


@pytest.mark.parametrize("made", [False, True], ids=["missing-folder", "no-manifest"])
def test_sign_command_refuses_a_folder_without_a_manifest_in_one_line(
    tmp_path: Path, keys: Keys, made: bool
) -> None:
    """It read manifest.json by its path unguarded: a traceback, FileNotFoundError."""
    folder = tmp_path / "topic-static" / "2"
    if made:
        folder.mkdir(parents=True)
    signed = subprocess.run(
        [
            sys.executable,
            "-m",
            "capability.bundle",
            "sign",
            str(folder),
            "--key",
            str(keys.trusted),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert signed.returncode == 1
    assert signed.stderr == f"error: manifest.json: not found in {folder}\n"
    assert not (folder / SIGNATURE_FILE).exists()


def test_a_build_whose_signature_fails_publishes_nothing(
    tmp_path: Path, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """`build --sign-key` signed after the rename that published the version: a key it
    could not sign with exited 1 and left the version served unsigned, and a rebuild
    found it "already exists". The signature is made before the version appears."""
    out = tmp_path / "models" / MODEL / "2"
    build = ["build", "--model", MODEL, "--out", str(out), "--quiet", "--sign-key"]

    assert bundle_command([*build, str(tmp_path / "no-such-key")]) == 1
    assert capsys.readouterr().err.startswith("error: manifest.json: cannot be signed with ")
    assert list(out.parent.iterdir()) == []  # neither the version nor its staging folder

    assert bundle_command([*build, str(keys.trusted)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    assert (out / SIGNATURE_FILE).stat().st_mode & 0o777 == 0o644
    assert (
        bundle_command(["verify", "--quiet", "--trusted-signers", str(keys.signers), str(out)]) == 0
    )

"""manifest.json.sig: who vouches for a bundle, checked with OpenSSH signatures.

The manifest already pins every other file's SHA-256, so signing manifest.json's bytes
signs the whole bundle. Signatures are SSH signatures as git uses them
(`ssh-keygen -Y sign` / `-Y verify`, namespace `classify-bundle`), and the trusted keys
are an OpenSSH allowed-signers file, one `<principal> <key-type> <base64-key>` a line.

A signature is checked in three steps, so each refusal says what is wrong:

    check-novalidate   the signature is well formed and matches the manifest's bytes
    find-principals    its key is in the trusted-signers file
    verify             and, as a principal of a line listing it, passes every
                       allowed-signers option (each such line's principal is tried)

The bytes checked are the very bytes the loader then parses, passed on stdin, so a
manifest swapped between the check and the parse cannot slip through. Likewise the
signature is read once, through the bundle's opened folder (files.py: never through a
link), and all three steps check that one copy.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
from pathlib import Path

from capability.bundle.errors import (
    BundleError,
    BundleFileMissing,
    BundleSignatureInvalid,
    BundleSignerUntrusted,
    BundleUnsigned,
)
from capability.bundle.files import BundleFolder, replace_file
from capability.bundle.format import MANIFEST_FILE
from classify_common.documents import MAX_DOCUMENT_BYTES

SIGNATURE_FILE = f"{MANIFEST_FILE}.sig"
# Bytes a manifest.json.sig may hold; an SSH signature by any key type is under 2 KiB.
MAX_SIGNATURE_BYTES = 64 * 1024
# The signature's purpose, bound into it: a key's git-commit signature is not a bundle's.
SIGNATURE_NAMESPACE = "classify-bundle"
# Seconds one ssh-keygen call may take; each is a few milliseconds of CPU.
SSH_KEYGEN_TIMEOUT_SECONDS = 30.0
SSH_KEYGEN = "ssh-keygen"
# Principals of lines listing the signing key a check tries at most (one ssh-keygen each).
MAX_PRINCIPALS_TRIED = 8


def sign_manifest(directory: Path, key: Path) -> Path:
    """Sign `directory/manifest.json` with the private key file `key`; returns the
    manifest.json.sig written beside it (replacing any older one)."""
    directory = Path(directory)
    # Read as the loader reads it (files.py: never through a link), and refused in its
    # words: a missing folder or manifest was a traceback.
    with BundleFolder(directory) as folder:
        try:
            raw = folder.read_bounded(MANIFEST_FILE, MAX_DOCUMENT_BYTES)
        except FileNotFoundError as exc:
            raise BundleFileMissing(f"{MANIFEST_FILE}: not found in {directory}") from exc
    # Signing stdin writes the signature to stdout, so an older .sig is never asked about.
    done = _ssh_keygen(["-Y", "sign", "-f", str(key), "-n", SIGNATURE_NAMESPACE], raw)
    if done.returncode != 0:
        raise BundleError(f"{MANIFEST_FILE}: cannot be signed with {key}: {_reason(done)}")
    try:
        replace_file(directory, SIGNATURE_FILE, done.stdout)
    except OSError as exc:
        raise BundleError(
            f"{SIGNATURE_FILE}: cannot be written in {directory}: {exc.strerror or exc}"
        ) from exc
    return directory / SIGNATURE_FILE


def check_manifest_signature(
    directory: Path | BundleFolder, raw: bytes, trusted_signers: Path
) -> str:
    """Check that `raw` (manifest.json's bytes) carries a good signature by a key in
    `trusted_signers`; returns the signer's principal (blocking: runs ssh-keygen).

    Raises BundleUnsigned, BundleSignatureInvalid or BundleSignerUntrusted, each
    naming manifest.json.sig."""
    if not isinstance(directory, BundleFolder):
        with BundleFolder(directory) as folder:
            return check_manifest_signature(folder, raw, trusted_signers)
    signature_bytes = _read_signature(directory, trusted_signers)
    with tempfile.TemporaryDirectory(prefix="bundle-signature-") as private:
        signature = Path(private) / SIGNATURE_FILE
        signature.write_bytes(signature_bytes)
        return _check_signature_file(signature, raw, trusted_signers)


def _read_signature(folder: BundleFolder, trusted_signers: Path) -> bytes:
    try:
        stream, _ = folder.open(SIGNATURE_FILE)
    except FileNotFoundError as exc:
        raise BundleUnsigned(
            f"{SIGNATURE_FILE}: not found in {folder.path}; trusted signers are required "
            f"({trusted_signers}), so an unsigned bundle is refused"
        ) from exc
    with stream:
        data = stream.read(MAX_SIGNATURE_BYTES + 1)
    if len(data) > MAX_SIGNATURE_BYTES:
        raise BundleSignatureInvalid(
            f"{SIGNATURE_FILE}: over {MAX_SIGNATURE_BYTES} bytes, which no SSH signature is"
        )
    return data


def _check_signature_file(signature: Path, raw: bytes, trusted_signers: Path) -> str:
    checked = _ssh_keygen(
        ["-Y", "check-novalidate", "-n", SIGNATURE_NAMESPACE, "-s", str(signature)], raw
    )
    if checked.returncode != 0:
        raise BundleSignatureInvalid(
            f"{SIGNATURE_FILE}: does not match {MANIFEST_FILE}'s bytes ({_reason(checked)})"
        )
    found = _ssh_keygen(
        ["-Y", "find-principals", "-f", str(trusted_signers), "-s", str(signature)], b""
    )
    principals = found.stdout.decode("utf-8", "replace").split()
    if found.returncode != 0 or not principals:
        raise BundleSignerUntrusted(
            f"{SIGNATURE_FILE}: signed by a key not in the trusted signers ({trusted_signers})"
        )
    # find-principals names the first line listing the key; the key may stand on other
    # lines too (an allowed-signers file shared with git: `dev@… namespaces="git"` first,
    # `release@… namespaces="classify-bundle"` after), and verify checks one principal's.
    first = principals[0].split(",")[0]
    candidates = [first, *_other_principals(signature, trusted_signers, first)]
    refusals: list[str] = []
    for principal in candidates[:MAX_PRINCIPALS_TRIED]:
        verified = _ssh_keygen(
            [
                "-Y",
                "verify",
                "-f",
                str(trusted_signers),
                "-I",
                principal,
                "-n",
                SIGNATURE_NAMESPACE,
                "-s",
                str(signature),
            ],
            raw,
        )
        if verified.returncode == 0:
            return principal
        refusals.append(f"{principal!r}: {_reason(verified)}")
    raise BundleSignatureInvalid(
        f"{SIGNATURE_FILE}: refused for every signer of {trusted_signers} listing its key "
        f"({'; '.join(refusals)})"
    )


def _other_principals(signature: Path, trusted_signers: Path, first: str) -> list[str]:
    """The principals, other than `first`, of the trusted-signers lines that list the
    signature's own key (a line for a certificate authority names the CA's key, and is
    left to find-principals). Lines are read as OpenSSH writes them: the principals
    first, the key's base64 a field of its own."""
    key = _signing_key(signature.read_bytes())
    if key is None:
        return []
    found: list[str] = []
    try:
        text = trusted_signers.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#") or key not in fields[1:]:
            continue
        for principal in fields[0].split(","):
            if principal != first and principal not in found:
                found.append(principal)
    return found


def _signing_key(armored: bytes) -> str | None:
    """The public key inside an SSH signature (PROTOCOL.sshsig: "SSHSIG", a version,
    then the key as a length-prefixed blob), base64 as allowed-signers lines hold it;
    None when it cannot be read."""
    body = b"".join(line for line in armored.splitlines() if line and not line.startswith(b"-----"))
    try:
        blob = base64.b64decode(body, validate=True)
    except ValueError:
        return None
    if len(blob) < 14 or blob[:6] != b"SSHSIG":
        return None
    length = int.from_bytes(blob[10:14], "big")
    key = blob[14 : 14 + length]
    if len(key) != length:
        return None
    return base64.b64encode(key).decode("ascii")


def _ssh_keygen(arguments: list[str], stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    program = shutil.which(SSH_KEYGEN)
    if program is None:
        raise BundleError(f"{SIGNATURE_FILE}: cannot be checked: {SSH_KEYGEN} is not on PATH")
    try:
        return subprocess.run(
            [program, *arguments],
            input=stdin,
            capture_output=True,
            timeout=SSH_KEYGEN_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BundleError(
            f"{SIGNATURE_FILE}: {SSH_KEYGEN} took over {SSH_KEYGEN_TIMEOUT_SECONDS} s"
        ) from exc


def _reason(done: subprocess.CompletedProcess[bytes]) -> str:
    lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else f"{SSH_KEYGEN} exit status {done.returncode}"

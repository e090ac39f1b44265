"""manifest.json: the size and SHA-256 of every file in a bundle, and checking them.

The manifest is the bundle's identity: its own SHA-256 is the digest a server reports,
so two bundles with the same digest hold byte-identical files. Checking a file against
it comes before the file is read as weights, so a truncated copy or a swapped-in file
is refused before any of its bytes reach a parser.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from capability.bundle.errors import (
    BundleConfigInvalid,
    BundleError,
    BundleFileMissing,
    BundleHashMismatch,
    UnexpectedBundleFile,
)
from capability.bundle.format import FORMAT_VERSION, MANIFEST_FILE, WEIGHT_LIKE_SUFFIXES
from capability.bundle.progress import Progress
from capability.bundle.signing import SIGNATURE_FILE, check_manifest_signature
from classify_common.documents import DocumentRefused, parse_json, read_document

_CHUNK_BYTES = 1 << 20
_HEX_DIGITS = 64


@dataclass(frozen=True)
class ManifestEntry:
    size: int  # bytes
    sha256: str  # lowercase hex


@dataclass(frozen=True)
class Manifest:
    files: Mapping[str, ManifestEntry]  # file name (no directories) -> expected content
    digest: str  # SHA-256 hex of manifest.json's bytes


def sha256_file(path: Path, on_chunk: Callable[[int], None] | None = None) -> str:
    """SHA-256 hex of a file, read in 1 MiB chunks; `on_chunk` hears each chunk's size."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            digest.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return digest.hexdigest()


def read_manifest(directory: Path, trusted_signers: Path | None = None) -> Manifest:
    """Parse `directory/manifest.json` within classify_common.documents' bounds;
    raises BundleError naming manifest.json (or manifest.json.sig).

    With `trusted_signers` (an allowed-signers file) the bytes are first checked against
    manifest.json.sig (signing.py); None accepts an unsigned bundle."""
    path = directory / MANIFEST_FILE
    try:
        raw = read_document(path, source=MANIFEST_FILE)
    except FileNotFoundError as exc:
        raise BundleFileMissing(f"{MANIFEST_FILE}: not found in {directory}") from exc
    except OSError as exc:
        raise BundleError(f"{MANIFEST_FILE}: cannot be read: {exc}") from exc
    except DocumentRefused as exc:  # oversized
        raise BundleConfigInvalid(str(exc)) from exc
    if trusted_signers is not None:
        # Before parsing: an untrusted manifest's bytes never reach the JSON parser.
        check_manifest_signature(directory, raw, trusted_signers)
    try:
        document: object = parse_json(raw, MANIFEST_FILE)
    except DocumentRefused as exc:  # too deep, duplicate keys, not JSON
        raise BundleConfigInvalid(str(exc)) from exc
    if not isinstance(document, dict) or set(document) != {"format_version", "files"}:
        keys = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise BundleConfigInvalid(
            f"{MANIFEST_FILE}: expected exactly the keys ['files', 'format_version'], got {keys}"
        )
    if document["format_version"] != FORMAT_VERSION:
        raise BundleConfigInvalid(
            f"{MANIFEST_FILE}: format_version {document['format_version']!r} is not supported; "
            f"expected {FORMAT_VERSION}"
        )
    files = document["files"]
    if not isinstance(files, dict):
        raise BundleConfigInvalid(f"{MANIFEST_FILE}: files must be an object of file entries")
    entries = {name: _parse_entry(name, entry) for name, entry in files.items()}
    return Manifest(files=entries, digest=hashlib.sha256(raw).hexdigest())


def _parse_entry(name: str, entry: object) -> ManifestEntry:
    # Flat names only: an entry like "../model.safetensors" would vouch for a file outside
    # the bundle, and the bundle would no longer be one self-contained directory.
    if not name or name in {".", "..", MANIFEST_FILE} or "/" in name or "\\" in name:
        raise BundleConfigInvalid(f"{MANIFEST_FILE}: {name!r} is not a file name in the bundle")
    if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
        raise BundleConfigInvalid(
            f"{MANIFEST_FILE}: entry {name!r} must have exactly the keys ['sha256', 'size']"
        )
    size, sha256 = entry["size"], entry["sha256"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BundleConfigInvalid(f"{MANIFEST_FILE}: {name!r} size must be a byte count")
    if (
        not isinstance(sha256, str)
        or len(sha256) != _HEX_DIGITS
        or any(c not in "0123456789abcdef" for c in sha256)
    ):
        raise BundleConfigInvalid(f"{MANIFEST_FILE}: {name!r} sha256 must be 64 lowercase hex")
    return ManifestEntry(size=size, sha256=sha256)


def check_file(
    directory: Path, name: str, entry: ManifestEntry, progress: Progress | None = None
) -> None:
    """Refuse `name` unless its size and SHA-256 are what the manifest says."""
    path = directory / name
    if not path.is_file():
        raise BundleFileMissing(f"{name}: listed in {MANIFEST_FILE} but not found in {directory}")
    size = path.stat().st_size
    if size != entry.size:
        # A size check first: it is free, and a truncated copy is the most common fault.
        raise BundleHashMismatch(
            f"{name}: {size} bytes, but {MANIFEST_FILE} records {entry.size}; "
            "the file is truncated or was replaced"
        )
    on_chunk = None if progress is None else lambda n: progress.advance(n, name)
    actual = sha256_file(path, on_chunk)
    if actual != entry.sha256:
        raise BundleHashMismatch(
            f"{name}: SHA-256 {actual[:16]}... does not match {MANIFEST_FILE} "
            f"({entry.sha256[:16]}...); the file was modified or corrupted"
        )


def check_no_unlisted_weights(directory: Path, manifest: Manifest) -> None:
    """Refuse weight-like files the manifest does not list (leftovers or planted files)."""
    unlisted = sorted(
        path.name
        for path in directory.iterdir()
        if path.suffix in WEIGHT_LIKE_SUFFIXES and path.name not in manifest.files
    )
    if unlisted:
        raise UnexpectedBundleFile(
            f"{unlisted[0]}: a weight file not listed in {MANIFEST_FILE}"
            + (f" (also unlisted: {unlisted[1:]})" if len(unlisted) > 1 else "")
        )


def verify_bundle(
    directory: Path, *, progress: bool = False, trusted_signers: Path | None = None
) -> str:
    """Check every file against manifest.json; return the digest (manifest's SHA-256).

    Raises BundleError naming the first file at fault: a listed file missing, a size or
    SHA-256 mismatch, or a weight file in the directory the manifest does not list; with
    `trusted_signers`, also a manifest not signed by one of its keys (signing.py).
    """
    directory = Path(directory)
    manifest = read_manifest(directory, trusted_signers)
    check_no_unlisted_weights(directory, manifest)
    total = sum(entry.size for entry in manifest.files.values())
    display = Progress(f"verify {directory}", total, unit="bytes", enabled=progress)
    for name, entry in sorted(manifest.files.items()):
        check_file(directory, name, entry, display)
    display.finish(f"{len(manifest.files)} files match {MANIFEST_FILE}, digest {manifest.digest}")
    return manifest.digest


def write_manifest(directory: Path) -> str:
    """List every file in `directory` (but manifest.json and its signature) in a new
    manifest.json.

    For builders, and for replacing one part of a bundle (a fine-tuned head.safetensors)
    in a fresh version directory. Returns the new digest.
    """
    directory = Path(directory)
    files = {
        path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name not in (MANIFEST_FILE, SIGNATURE_FILE)
    }
    raw = (
        json.dumps({"format_version": FORMAT_VERSION, "files": files}, indent=2, sort_keys=True)
        + "\n"
    ).encode("utf-8")
    # Written beside and renamed over, so a reader never sees half a manifest.
    partial = directory / f".{MANIFEST_FILE}.partial"
    partial.write_bytes(raw)
    os.replace(partial, directory / MANIFEST_FILE)
    return hashlib.sha256(raw).hexdigest()

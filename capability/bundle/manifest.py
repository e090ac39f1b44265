"""manifest.json: the size and SHA-256 of every file in a bundle, and checking them.

The manifest is the bundle's identity: its own SHA-256 is the digest a server reports,
so two bundles with the same digest hold byte-identical files, and nothing else: the
folder holds exactly the listed files, manifest.json and manifest.json.sig, each a
regular file (check_only_listed_files).

A file is read once (files.py) and checked against the manifest before its bytes reach
a parser (read_listed_file), and the parser gets those very bytes: a truncated copy or
a swapped-in file is refused, and one swapped in after the check is never read.
"""

from __future__ import annotations

import hashlib
import json
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from capability.bundle.errors import (
    BundleConfigInvalid,
    BundleError,
    BundleFileMissing,
    BundleHashMismatch,
    UnexpectedBundleFile,
)
from capability.bundle.files import BundleFolder, not_regular, replace_file
from capability.bundle.format import FORMAT_VERSION, MANIFEST_FILE, WEIGHT_LIKE_SUFFIXES
from capability.bundle.progress import Progress
from capability.bundle.signing import SIGNATURE_FILE, check_manifest_signature
from classify_common.documents import MAX_DOCUMENT_BYTES, DocumentRefused, parse_json

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


def read_manifest(directory: Path | BundleFolder, trusted_signers: Path | None = None) -> Manifest:
    """Parse `directory/manifest.json` within classify_common.documents' bounds;
    raises BundleError naming manifest.json (or manifest.json.sig).

    With `trusted_signers` (an allowed-signers file) the bytes are first checked against
    manifest.json.sig (signing.py); None accepts an unsigned bundle."""
    if not isinstance(directory, BundleFolder):
        with BundleFolder(directory) as folder:
            return read_manifest(folder, trusted_signers)
    folder = directory
    try:
        raw = folder.read_bounded(MANIFEST_FILE, MAX_DOCUMENT_BYTES)
    except FileNotFoundError as exc:
        raise BundleFileMissing(f"{MANIFEST_FILE}: not found in {folder.path}") from exc
    if trusted_signers is not None:
        # Before parsing: an untrusted manifest's bytes never reach the JSON parser.
        check_manifest_signature(folder, raw, trusted_signers)
    try:
        document: object = parse_json(raw, MANIFEST_FILE)
    except DocumentRefused as exc:  # too deep, duplicate keys, not JSON
        raise BundleConfigInvalid(str(exc)) from exc
    if not isinstance(document, dict) or set(document) != {"format_version", "files"}:
        keys = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise BundleConfigInvalid(
            f"{MANIFEST_FILE}: expected exactly the keys ['files', 'format_version'], got {keys}"
        )
    version = document["format_version"]
    # A bool is an int to Python (True == 1), but `"format_version": true` names no version.
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise BundleConfigInvalid(
            f"{MANIFEST_FILE}: format_version {version!r} is not supported; "
            f"expected {FORMAT_VERSION}"
        )
    files = document["files"]
    if not isinstance(files, dict):
        raise BundleConfigInvalid(f"{MANIFEST_FILE}: files must be an object of file entries")
    entries = {name: _parse_entry(name, entry) for name, entry in files.items()}
    return Manifest(files=entries, digest=hashlib.sha256(raw).hexdigest())


def _parse_entry(name: str, entry: object) -> ManifestEntry:
    # Flat names only: an entry like "../model.safetensors" would vouch for a file outside
    # the bundle, and the bundle would no longer be one self-contained directory. Printable
    # ones only: the OS takes no NUL in a name (open() raises ValueError, not a refusal),
    # and a control or direction character would hide the real name from whoever reads a
    # refusal.
    if (
        not name
        or name in {".", "..", MANIFEST_FILE}
        or "/" in name
        or "\\" in name
        or not name.isprintable()
    ):
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


def read_listed_file(
    folder: BundleFolder, name: str, entry: ManifestEntry, *, max_bytes: int | None = None
) -> bytes:
    """`name`'s bytes, read once and refused unless their size and SHA-256 are what the
    manifest says: the caller parses these very bytes and never opens the file again.

    `max_bytes` bounds a file that is parsed whole as a document (config.json): a larger
    one is refused (BundleConfigInvalid) before it is read."""
    with _open_listed(folder, name, entry, max_bytes) as stream:
        # One byte more than recorded, so a file that grew since it was opened is caught.
        data = stream.read(entry.size + 1)
    _check_content(name, entry, len(data), hashlib.sha256(data).hexdigest())
    return data


def check_file(
    folder: BundleFolder, name: str, entry: ManifestEntry, progress: Progress | None = None
) -> None:
    """Refuse `name` unless its size and SHA-256 are what the manifest says, reading it
    in 1 MiB chunks and keeping none: for a file that is checked but not parsed."""
    digest, length = hashlib.sha256(), 0
    with _open_listed(folder, name, entry, None) as stream:
        while chunk := stream.read(min(_CHUNK_BYTES, entry.size + 1 - length)):
            digest.update(chunk)
            length += len(chunk)
            if progress is not None:
                progress.advance(len(chunk), name)
    _check_content(name, entry, length, digest.hexdigest())


@contextmanager
def _open_listed(
    folder: BundleFolder, name: str, entry: ManifestEntry, max_bytes: int | None
) -> Iterator[BinaryIO]:
    try:
        stream, size = folder.open(name)
    except FileNotFoundError as exc:
        raise BundleFileMissing(
            f"{name}: listed in {MANIFEST_FILE} but not found in {folder.path}"
        ) from exc
    with stream:
        _check_size(name, entry, size)
        if max_bytes is not None and size > max_bytes:
            # Worded as classify_common.documents words it for every other config file.
            raise BundleConfigInvalid(
                f"{name}: {size} bytes, over the {max_bytes}-byte limit for a config file"
            )
        yield stream


def _check_size(name: str, entry: ManifestEntry, size: int) -> None:
    if size != entry.size:
        # A size check first: it is free, and a truncated copy is the most common fault.
        raise BundleHashMismatch(
            f"{name}: {size} bytes, but {MANIFEST_FILE} records {entry.size}; "
            "the file is truncated or was replaced"
        )


def _check_content(name: str, entry: ManifestEntry, length: int, actual: str) -> None:
    # The length read, checked again: the file may have changed size while it was read.
    _check_size(name, entry, length)
    if actual != entry.sha256:
        raise BundleHashMismatch(
            f"{name}: SHA-256 {actual[:16]}... does not match {MANIFEST_FILE} "
            f"({entry.sha256[:16]}...); the file was modified or corrupted"
        )


def check_only_listed_files(folder: BundleFolder, manifest: Manifest) -> None:
    """Refuse anything in the folder but the listed files, manifest.json and
    manifest.json.sig, and anything there that is not a regular file.

    The digest stands for the whole folder, so a file it does not list (a payload.py, a
    tokenizer_config.json some library would pick up, a weight file in another case), a
    subdirectory, or a link to a file elsewhere, is refused rather than ignored."""
    allowed = {*manifest.files, MANIFEST_FILE, SIGNATURE_FILE}
    refusals: list[str] = []
    for name, mode in folder.entries():
        if not stat.S_ISREG(mode):
            refusals.append(str(not_regular(name, mode)))
        elif name not in allowed:
            weight_like = Path(name).suffix.lower() in WEIGHT_LIKE_SUFFIXES
            kind = "a weight file" if weight_like else "a file"
            refusals.append(
                f"{name}: {kind} not listed in {MANIFEST_FILE}; a bundle holds only its "
                f"listed files, {MANIFEST_FILE} and {SIGNATURE_FILE}"
            )
    if refusals:
        others = f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else ""
        raise UnexpectedBundleFile(refusals[0] + others)


def verify_bundle(
    directory: Path, *, progress: bool = False, trusted_signers: Path | None = None
) -> str:
    """Check every file against manifest.json; return the digest (manifest's SHA-256).

    Raises BundleError naming the first file at fault: a listed file missing, a size or
    SHA-256 mismatch, a file in the directory the manifest does not list, or one that is
    not a regular file (a directory, a symbolic link); with
    `trusted_signers`, also a manifest not signed by one of its keys (signing.py).
    """
    directory = Path(directory)
    with BundleFolder(directory) as folder:
        manifest = read_manifest(folder, trusted_signers)
        check_only_listed_files(folder, manifest)
        total = sum(entry.size for entry in manifest.files.values())
        display = Progress(f"verify {directory}", total, unit="bytes", enabled=progress)
        for name, entry in sorted(manifest.files.items()):
            check_file(folder, name, entry, display)
    display.finish(f"{len(manifest.files)} files match {MANIFEST_FILE}, digest {manifest.digest}")
    return manifest.digest


def write_manifest(directory: Path) -> str:
    """List every file in `directory` (but manifest.json and its signature) in a new
    manifest.json.

    For builders, and for replacing one part of a bundle (a fine-tuned head.safetensors)
    in a fresh version directory. Returns the new digest. Raises UnexpectedBundleFile
    for an entry that is not a regular file, which no bundle may hold, and
    BundleError when the manifest cannot be written there.
    """
    directory = Path(directory)
    partial = directory / f".{MANIFEST_FILE}.partial"
    not_listed = {MANIFEST_FILE, SIGNATURE_FILE, partial.name, f".{SIGNATURE_FILE}.partial"}
    files: dict[str, dict[str, object]] = {}
    for path in sorted(directory.iterdir()):
        if path.name in not_listed:
            continue
        mode = path.lstat().st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path.name, mode)
        files[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    raw = (
        json.dumps({"format_version": FORMAT_VERSION, "files": files}, indent=2, sort_keys=True)
        + "\n"
    ).encode("utf-8")
    try:
        replace_file(directory, MANIFEST_FILE, raw)
    except OSError as exc:  # a read-only folder, say: one line, not a traceback
        raise BundleError(
            f"{MANIFEST_FILE}: cannot be written in {directory}: {exc.strerror or exc}"
        ) from exc
    return hashlib.sha256(raw).hexdigest()

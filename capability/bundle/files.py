"""Reading a bundle's files: each once, from one opened folder, never through a link.

A version folder is opened once, as a descriptor, and every file in it is opened
relative to that descriptor with O_NOFOLLOW, then checked to be a regular file
(fstat) before a byte of it is read. So:

- a symbolic link is refused wherever it points, and so is a directory, a FIFO or a
  device: what a bundle's manifest vouches for lies in the bundle's own folder;
- a folder renamed over the path halfway through a load does not mix two folders;
- a file is read into memory once, and the caller hashes and parses those same bytes.
  Nothing reopens a file by its path or maps it, so a file swapped or rewritten after
  its hash was checked changes nothing that is served.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from capability.bundle.errors import (
    BundleConfigInvalid,
    BundleError,
    BundleFileMissing,
    UnexpectedBundleFile,
)
from capability.bundle.format import MANIFEST_FILE
from classify_common.documents import describe_kind

# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever, before
# fstat could refuse it. A regular file's reads ignore the flag.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


# A file the tooling writes into a bundle folder: created new (never an entry that is
# there), never through a link.
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def replace_file(directory: Path, name: str, data: bytes) -> None:
    """Write `data` as `directory/name`, whole or not at all: into `.<name>.partial`
    beside it, then renamed over it, so a reader never sees half a file.

    Neither step follows a link. A link planted at the partial file's name was
    written through (a `manifest` or `sign` run by an operator overwrote whatever
    it pointed at); it is removed now, not its target, and the partial file is
    created afresh. A rename replaces a link at `name` itself."""
    partial = directory / f".{name}.partial"
    partial.unlink(missing_ok=True)  # a leftover of a run that died, or a planted link
    descriptor = os.open(partial, _WRITE_FLAGS, 0o644)
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
        os.replace(partial, directory / name)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def not_regular(name: str, mode: int) -> UnexpectedBundleFile:
    """The refusal of a bundle entry that is not a regular file."""
    return UnexpectedBundleFile(
        f"{name}: {describe_kind(mode)}; a bundle is one folder of regular files, so "
        "that what its manifest vouches for lies in the folder"
    )


class BundleFolder:
    """One version folder, held open; every file of the bundle is read through it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            # The version folder's own path may be a link (an operator's `current`, say);
            # nothing inside it may.
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError) as exc:
            # The shape the manifest read gave before the folder was opened first.
            raise BundleFileMissing(f"{MANIFEST_FILE}: not found in {self.path}") from exc
        except OSError as exc:
            raise BundleError(f"{self.path}: cannot be opened: {exc}") from exc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> BundleFolder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def entries(self) -> list[tuple[str, int]]:
        """Every name in the folder with its mode (lstat: a link is a link), by name."""
        found: list[tuple[str, int]] = []
        for name in sorted(os.listdir(self._fd)):
            try:
                info = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since it was listed: nothing left to refuse
            found.append((name, info.st_mode))
        return found

    def open(self, name: str) -> tuple[BinaryIO, int]:
        """`name` open for reading (the caller closes it), with its size in bytes.

        FileNotFoundError is the caller's to word; a link or any other non-regular file
        is refused (UnexpectedBundleFile), other errors are a BundleError naming it."""
        try:
            fd = os.open(name, _OPEN_FLAGS, dir_fd=self._fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
                raise not_regular(name, stat.S_IFLNK) from exc
            raise BundleError(f"{name}: cannot be read: {exc}") from exc
        stream = os.fdopen(fd, "rb")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            stream.close()
            raise not_regular(name, info.st_mode)
        return stream, info.st_size

    def read_bounded(self, name: str, max_bytes: int) -> bytes:
        """All of `name`, refused (BundleConfigInvalid) past `max_bytes`, of which no more
        than one byte over is ever read. FileNotFoundError is the caller's to word."""
        stream, size = self.open(name)
        with stream:
            data = stream.read(max_bytes + 1)
        if len(data) > max_bytes:
            held = f"{size} bytes" if size > max_bytes else f"more than {max_bytes} bytes"
            # Worded as classify_common.documents words it for every other config file.
            raise BundleConfigInvalid(
                f"{name}: {held}, over the {max_bytes}-byte limit for a config file"
            )
        return data

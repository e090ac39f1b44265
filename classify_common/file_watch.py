"""Watch one file a server reads at start, and hand every valid new version to a callback.

The orchestrator watches its routes file (orchestrator.routing.watcher) and its API
keys file with this; each says what a refused version leaves in force.

The file is polled rather than watched with inotify: polling sees a Kubernetes
ConfigMap or Secret update, which swaps a symlink (`..data`) instead of writing
the file, and needs no platform support. `os.stat` follows links, so the
identity checked (inode, size, mtime, ctime) is that of the file really read.
The ctime is in it for what the others miss: a file rewritten in place at the
same size whose mtime was put back (`rsync --inplace`, a tar extraction, `touch
-r`), or whose mode alone changed (a file refused as unreadable, then made
readable).
A changed file is read once it has held still for a poll: an editor that
truncates the file and writes it in pieces would otherwise have its first
piece applied (a routes file that parses, with a route's fallback missing,
for a second), or refused and counted as a failed reload.
A file that fails to load is logged and counted, and the version in force stays.
So is any other error while a version is read or applied (a bug): the watcher
logs it with its traceback and keeps polling, since a watcher that ended would
leave every later edit unapplied, with nothing logged.
Each version is read and parsed off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

FileIdentity = tuple[int, int, int, int]
Loaded = TypeVar("Loaded")


def file_identity(path: Path) -> FileIdentity | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


class FileWatcher(Generic[Loaded]):
    def __init__(
        self,
        path: Path,
        load: Callable[[Path], Loaded],
        refusal: type[Exception],
        on_change: Callable[[Loaded], None],
        on_failure: Callable[[Exception], None],
        poll_seconds: float,
        *,
        what: str,
        kept: str,
        loaded: FileIdentity | None = None,
    ) -> None:
        """`load` reads a version (on a worker thread, with its own bounds on size and
        depth) and raises `refusal`, naming the file and line, for one it refuses;
        `what` names the file and `kept` what a refusal leaves in force, for the log
        ("routes file", "the routes in force stay"). `loaded`: the file's identity
        (file_identity) when the version in force was read from it, taken before
        reading; None: as it is now. An edit made between that read and the watcher's
        start is then applied, not taken as seen."""
        self._path = path
        self._load = load
        self._refusal = refusal
        self._on_change = on_change
        self._on_failure = on_failure
        self._poll_seconds = poll_seconds
        self._what = what
        self._kept = kept
        self._seen = loaded if loaded is not None else file_identity(path)
        # A new identity seen at the last poll (in a 1-tuple: a deleted file's is None),
        # applied when the next poll sees it again.
        self._changing: tuple[FileIdentity | None] | None = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_seconds)
            await self.poll()

    async def poll(self) -> bool:
        """Look at the file once; whether a new version was read (applied or refused)."""
        identity = file_identity(self._path)
        if identity == self._seen:
            self._changing = None
            return False
        if (identity,) != self._changing:
            self._changing = (identity,)
            return False
        self._seen, self._changing = identity, None
        try:
            # Read and parsed on a worker thread: even a file built to be slow costs
            # the serving loop nothing.
            version = await asyncio.to_thread(self._load, self._path)
            self._on_change(version)
        except self._refusal as error:
            log.error(f"{self._what} refused; {self._kept}", extra={"error": str(error)})
            self._on_failure(error)
        except Exception as error:  # any other: a bug; see the module docstring
            log.exception(
                f"{self._what} not applied: unexpected error; {self._kept}",
                extra={"error": repr(error)},
            )
            self._on_failure(error)
        return True

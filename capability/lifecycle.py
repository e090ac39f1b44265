"""Which model versions exist, which serve, and how a new one takes over.

The model root holds one folder per model and one bundle folder per version:
`<root>/topic-minilm/1/`, `<root>/topic-minilm/2/`, ... A version's name is
letters, digits, '.', '_' and '-', starting with a letter or digit (so no
hidden folder, `.3.partial`, is ever one). Only numbered versions (`1`, `2`,
`10`: ASCII digits alone) are in the sequence the server follows by itself:
the highest is loaded at start, and the watcher reloads whenever a higher one
appears, so a deploy is "copy the bundle in". Any other name (`3.tmp`,
`3-copying`, `canary`) is never chosen by itself, so a folder copied in under a
temporary name and then renamed is loaded only once it has its number; such a
version loads only when ReloadModel names it. Every path is built from
validated names and checked to stay inside the root.

ReloadModel with a version pins the model to it: the watcher leaves a pinned
model alone, however new the folders that appear, so a rollback stays rolled
back. ReloadModel without a version (the newest) lets the watcher follow again.

At start each model serves its highest numbered version that loads: a newer one
refused (a damaged copy left in the root, refused while a running server kept
serving the version before it) is logged at ERROR and counted as a refused reload,
as the watcher counts one, and the version before it is tried. The start is refused
only when no version of a model loads: one model's bad folder does not take the
others down with it at the next restart.

A version folder is immutable once it serves: the watcher looks at the serving
version's manifest.json on every poll (one stat; the file is hashed only when the
stat changed) and, when the folder is gone or holds another bundle, logs a WARNING
and counts it. It does not reload the folder under the same version number (a
version name would then stand for two bundles); the loaded bundle serves on, and
the change is there for the next restart to load.

A version the watcher saw refused (say, caught half-copied) is not tried again
every poll, nor refused for good: it is remembered with a fingerprint of its
files (and of the model's warm_texts file, which its load reads too), and tried
once more when the fingerprint has changed and then held still for a poll (the
copy has finished). A numbered folder that is a link out of the model root is
such a refusal; one that links within the root (`2 -> .release-2`, `2 -> 1`) is
loaded from its target and serves under its own name, `2`.

The watcher outlives any error (a bug, a filesystem surprise): it is logged with
its traceback and counted as a refused reload, the serving version stays, and the
next poll looks again.

The model root is listed and a version's folder resolved off the event loop, as
every other file read here: a slow listing (a network volume; 50,000 stale numbered
folders took 0.9 s here) stalled, on the loop, every call the server was answering,
at every poll.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from capability.bundle import BundleError, LoadedBundle, MemoryBudgetExceeded, ModelLoadError
from capability.bundle.errors import BundleFileMissing
from capability.bundle.files import BundleFolder
from capability.config import CapabilitySettings, ModelServingSettings
from capability.metrics import CapabilityMetrics
from capability.result_cache import read_warm_texts
from capability.workers import WorkerPool
from classify_common.documents import MAX_DOCUMENT_BYTES
from classify_common.errors import ModelNotFound, ModelNotReady, ReloadRefused
from classify_common.model_names import MODEL_NAME_RULE, is_model_name

log = logging.getLogger(__name__)

# A version folder's name, as ModelService.ReloadModel's contract spells it.
VERSION_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A version the server picks by itself: ASCII digits alone. (str.isdigit would also
# take '²', which int() refuses.)
NUMBERED_VERSION = re.compile(r"^[0-9]+$")
MANIFEST = "manifest.json"
# The `change` of classify_model_folder_changes_total: the serving version's folder (or
# its manifest.json) is gone, or holds another bundle under the same version name.
FOLDER_REMOVED = "removed"
FOLDER_REPLACED = "replaced"

# (path, size in bytes, mtime in ns, ctime in ns, inode) of each file: the version
# folder's, sorted by their path relative to it, then those its load reads elsewhere.
Fingerprint = tuple[tuple[str, int, int, int, int], ...]


def is_numbered(version: str) -> bool:
    return NUMBERED_VERSION.fullmatch(version) is not None


def is_newer(candidate: str, serving: str) -> bool:
    """Whether the watcher moves from `serving` to the numbered `candidate`: when it is
    higher by value (2 < 10), or when a named version serves (one ReloadModel named,
    since released by a ReloadModel of the newest)."""
    return not is_numbered(serving) or int(candidate) > int(serving)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # not ours to look into: versions() says so when asked
        return False


class ModelRoot:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        # Folders this server may not read, each logged once (the watcher looks often).
        self._unreadable: set[Path] = set()

    def model_names(self) -> list[str]:
        """The model folders a server can serve: named by the model-name rule, with a
        numbered version holding a manifest."""
        return [path.name for path in self._folders() if self.skip_reason(path.name) is None]

    def skipped_folders(self) -> list[tuple[Path, str]]:
        """Every folder under the root that is not served, and why (skip_reason)."""
        return [
            (path, reason)
            for path in self._folders()
            if (reason := self.skip_reason(path.name)) is not None
        ]

    def skip_reason(self, name: str) -> str | None:
        """Why the folder `name` under the root cannot be served; None when it can."""
        if not is_model_name(name):
            return f"{name!r} is not a model name ({MODEL_NAME_RULE})"
        if not self.versions(name):
            if self._model_folder(name) in self._unreadable:
                return "this server may not read it (its owner or mode)"
            return (
                "no numbered version folder (1, 2, ...) holding manifest.json; "
                "named or hidden ones load only when ReloadModel names them"
            )
        return None

    def _folders(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(path for path in self.root.iterdir() if _is_dir(path))

    def versions(self, name: str) -> list[str]:
        """Numbered version folders of `name` that hold a manifest, oldest first; named
        ones (`3.tmp`, `canary`) are left out: they load only when asked for by name.

        A folder this server may not read (another user's, mode 700) is left out too,
        and logged once: its PermissionError stopped the start, although another
        model was asked for, and live, every look of the watcher failed as a bug."""
        folder = self._model_folder(name)
        try:
            if not folder.is_dir():
                return []
            entries = sorted(folder.iterdir())
        except OSError as exc:
            self._left_out(folder, exc)
            return []
        self._unreadable.discard(folder)  # readable (again): said once more if it changes
        found = []
        for path in entries:
            if not is_numbered(path.name):
                continue
            try:
                if path.is_dir() and (path / MANIFEST).is_file():
                    found.append(path.name)
            except OSError as exc:
                self._left_out(path, exc)
                continue
            self._unreadable.discard(path)
        return sorted(found, key=int)

    def _left_out(self, path: Path, error: OSError) -> None:
        if path not in self._unreadable:
            self._unreadable.add(path)
            log.warning(
                "model folder left out: this server may not read it",
                extra={"path": str(path), "error": f"{type(error).__name__}: {error.strerror}"},
            )

    def newest(self, name: str) -> str | None:
        versions = self.versions(name)
        return versions[-1] if versions else None

    def fingerprint(self, name: str, version: str, also: Sequence[Path] = ()) -> Fingerprint:
        """What a copy into the version folder changes: each file's name, size,
        modification and change times and inode, then the same of `also`, files
        elsewhere that its load reads. One stat per file; no weight byte is read.

        The change time and inode catch a copy that keeps the modification time
        (`cp -p`, `rsync -a`, `tar x` set it back after writing, which sets the change
        time). NOTE: a file rewritten in place with the same size within one timestamp
        tick (whole seconds on some network filesystems) leaves the fingerprint
        unchanged. Raises OSError when a file vanishes while it is read."""
        directory = self._version_folder(name, version)
        found = [
            _file_state(Path(folder, file).relative_to(directory).as_posix(), Path(folder, file))
            for folder, _, files in os.walk(directory)
            for file in files
        ]
        return (*sorted(found), *(_file_state(str(path), path) for path in also))

    def version_dir(self, name: str, version: str) -> Path:
        """The folder of one version, refusing any name that could leave the root, and
        (BundleError, a refusal of the version) a folder that does: a link elsewhere."""
        folder = self._version_folder(name, version)
        path = folder.resolve()
        if not path.is_relative_to(self.root):
            raise BundleError(
                f"{folder}: resolves to {path}, outside the model root {self.root}; a "
                "version's folder must lie under the model root"
            )
        return path

    def _version_folder(self, name: str, version: str) -> Path:
        """The folder of one version as it is named under the root (a link not followed)."""
        if not VERSION_PATTERN.fullmatch(version) or version in (".", ".."):
            raise ModelNotFound(f"{version!r} is not a version name", model=name)
        folder = self._model_folder(name) / version
        # A folder without manifest.json is there all the same: its load refuses it,
        # naming the file.
        if not folder.is_dir():
            raise ModelNotFound(
                f"model {name!r} has no version {version!r} under the model root", model=name
            )
        return folder

    def _model_folder(self, name: str) -> Path:
        if not is_model_name(name):
            raise ModelNotFound(f"{name!r} is not a model name", model=name)
        return self.root / name


def _refused_at_start(
    name: str, version: str, folder: Path, exc: Exception, refused: Sequence[str]
) -> ModelLoadError:
    """`exc`, the refusal of a model's newest version when every version of it was
    refused at start (`refused`, newest first), as the same kind of error, still
    starting with the file at fault, then naming the model, the version and its
    folder, and what to do. The start serves each model's highest numbered version
    that loads (docs/runbook.md), so it exits only here, and the operator needs the
    folder to act on."""
    message = (
        f"{exc} (version {version} of model {name!r}, {folder}). A server starts each "
        "model on its highest numbered version that loads, and no version of this one "
        f"does (refused: {', '.join(refused)}; each refusal is logged): fix the cause, "
        "or deploy a version that loads"
    )
    # The same class (each takes the one message), so a caller's except clauses still
    # tell a budget refusal from a bundle one; an OSError becomes a bundle refusal.
    kind = type(exc) if isinstance(exc, ModelLoadError) else BundleError
    return kind(message)


def _file_state(shown_as: str, path: Path) -> tuple[str, int, int, int, int]:
    stat = path.stat()
    return (shown_as, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


def _manifest_state(manifest: Path) -> tuple[int, int, int, int] | None:
    """manifest.json's size, modification and change times and inode; None when it
    (or its folder) is gone or cannot be read."""
    try:
        stat = manifest.stat()
    except OSError:
        return None
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


def _folder_change(manifest: Path, digest: str) -> str | None:
    """How the folder whose manifest.json is `manifest` differs from the bundle of
    `digest` loaded from it: FOLDER_REMOVED, FOLDER_REPLACED, or None (the same).

    Read as a load reads it (capped, never through a link, never waiting on a FIFO):
    read whole by its path, a manifest replaced by a 1 GiB file cost 1 GiB of memory
    at every look, one linked to /dev/zero grew until memory ran out, and a FIFO
    stopped the watch of every model."""
    try:
        with BundleFolder(manifest.parent) as folder:
            raw = folder.read_bounded(manifest.name, MAX_DOCUMENT_BYTES)
    except FileNotFoundError:
        return FOLDER_REMOVED
    except BundleFileMissing:
        return FOLDER_REMOVED  # the folder itself is gone
    except (BundleError, OSError):
        return FOLDER_REPLACED  # a link, a FIFO, too large: not the manifest loaded
    return None if hashlib.sha256(raw).hexdigest() == digest else FOLDER_REPLACED


@dataclass
class ServedFolder:
    """What the watcher last saw of a serving version's folder."""

    digest: str  # the digest of the bundle loaded from it: which load this looks after
    manifest: tuple[int, int, int, int] | None  # _manifest_state at the latest look
    change: str | None  # FOLDER_REMOVED or FOLDER_REPLACED as last found; None: as loaded


# A version refused for want of room on the device (MemoryBudgetExceeded: the bundle is
# sound, the device too full for it just then) is tried again with its files unchanged,
# first this long after the refusal, then twice as long after each refusal more, up to
# the longest. Remembered as a broken bundle is, it stayed unloaded once the room came
# (another model's load finished, a version retired) until someone touched its files.
ROOM_RETRY_FIRST_SECONDS = 5.0
ROOM_RETRY_LONGEST_SECONDS = 300.0


@dataclass
class RefusedVersion:
    """A version folder whose load was refused, why, and what its files looked like."""

    refused_as: Fingerprint | None  # when it was refused; None: could not be read
    last_seen: Fingerprint | None  # at the watcher's latest look
    reason: str  # as logged; GetModel reports it
    refused_at: datetime  # UTC
    # For a refusal for room: the event loop's time of its next try, and the wait
    # before the one after; None for a refusal that only a change of files can lift.
    room_retry_at: float | None = None
    room_retry_seconds: float = ROOM_RETRY_FIRST_SECONDS

    @classmethod
    def now(
        cls,
        files: Fingerprint | None,
        error: Exception | str,
        earlier: RefusedVersion | None = None,
    ) -> RefusedVersion:
        """The refusal of a version whose files were `files`, by `error`; `earlier`, the
        version's refusal before this one, spaces out its tries for room."""
        refused = cls(files, files, str(error), datetime.now(UTC))
        if isinstance(error, MemoryBudgetExceeded):
            wait = ROOM_RETRY_FIRST_SECONDS
            if earlier is not None and earlier.room_retry_at is not None:
                wait = min(earlier.room_retry_seconds * 2, ROOM_RETRY_LONGEST_SECONDS)
            refused.room_retry_at = asyncio.get_running_loop().time() + wait
            refused.room_retry_seconds = wait
        return refused


class ModelLifecycle:
    def __init__(
        self,
        root: ModelRoot,
        pool: WorkerPool,
        serving_settings: Mapping[str, ModelServingSettings],
        default_settings: ModelServingSettings,
        metrics: CapabilityMetrics,
    ) -> None:
        self.root = root
        self.pool = pool
        self._settings = serving_settings
        self._default_settings = default_settings
        self._metrics = metrics
        self._locks: dict[str, asyncio.Lock] = {}
        # Versions whose load failed, by (model, version), so the watcher does not
        # retry a broken bundle every poll; it tries one again once its files change
        # (see _worth_retrying). A new version folder is tried afresh.
        self._refused: dict[tuple[str, str], RefusedVersion] = {}
        # Models a ReloadModel of a named version put on it, by name: the watcher
        # leaves them there until a ReloadModel of the newest.
        self._pinned: dict[str, str] = {}
        # (model, version) the watcher found newer than a pinned model's and logged,
        # so that each is logged once, not every poll.
        self._held_back: set[tuple[str, str]] = set()
        # The models the start loads (load_initial); each is loading until it serves.
        self._starting: frozenset[str] = frozenset()
        # The serving version's folder of each model, as the watcher last saw it.
        self._served_folders: dict[str, ServedFolder] = {}

    def settings_for(self, name: str) -> ModelServingSettings:
        return self._settings.get(name, self._default_settings)

    def pinned(self, name: str) -> str | None:
        """The version a ReloadModel pinned `name` to; None: the watcher follows the newest."""
        return self._pinned.get(name)

    async def refusals(self, name: str) -> list[tuple[str, RefusedVersion]]:
        """The numbered versions of `name` in the model root whose load was refused and
        not since loaded, newest first. A folder removed since leaves the list. The root
        is listed off the event loop (a network volume can be slow); a root that cannot
        be listed lists none."""
        if not any(model == name for model, _ in self._refused):
            return []
        try:
            present = await asyncio.to_thread(self.root.versions, name)
        except OSError:
            return []
        # A reload of the serving version refused (its folder damaged since, or no room
        # for a second copy) leaves the loaded one serving: not a version refused.
        serving = self.pool.models().get(name)
        return [
            (version, self._refused[(name, version)])
            for version in reversed(present)
            if (name, version) in self._refused and (serving is None or version != serving.version)
        ]

    def loading(self, name: str) -> bool:
        """Whether `name` is a model the start is loading and that serves no version yet."""
        return name in self._starting and name not in self.pool.models()

    def models_to_serve(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """`names` (--models), or every model under the root when it is empty; refused
        when that is none."""
        # NOTE: logged here, once at start, and not by model_names: a folder skipped in
        # silence (`Sentiment-BYO`, say) is a model its team believes is served.
        for folder, reason in self.root.skipped_folders():
            log.warning("model folder skipped", extra={"folder": str(folder), "reason": reason})
        wanted = names or tuple(self.root.model_names())
        if not wanted:
            raise ModelNotFound(
                f"{CapabilitySettings.names('model_root')}: no model bundles under "
                f"{self.root.root}; run `make bundles`"
            )
        return wanted

    async def load_initial(self, wanted: tuple[str, ...]) -> None:
        """Load each model of `wanted` (as models_to_serve resolved --models) at its
        highest numbered version that loads; refused when a model has none that does."""
        self._starting = self.pool.starting_models = frozenset(wanted)
        for name in wanted:
            # Exported at 0 before any load: a counter first scraped at 1 shows no
            # increase, and ClassifyModelVersionRefused would miss a live refusal.
            for outcome in ("ok", "refused"):
                self._metrics.reloads.labels(name, outcome)
        for name in wanted:
            await self._start_on_newest_that_loads(name)

    async def _start_on_newest_that_loads(self, name: str) -> None:
        """Load `name`'s numbered versions, newest first, until one loads. Each refused
        one is logged at ERROR, counted as a refused reload and remembered as the
        watcher remembers its refusals (tried again once its files change), so a bad
        folder left in the root costs this model its newest version, not the start."""
        versions = await asyncio.to_thread(self.root.versions, name)
        if not versions:
            raise ModelNotFound(
                f"model {name!r} has no numbered version folder under {self.root.root}",
                model=name,
            )
        refusals: list[tuple[str, Exception]] = []
        for version in reversed(versions):
            files = await self._read_fingerprint(name, version)
            try:
                await self._load(name, version)
            except (ModelLoadError, OSError) as exc:
                self._refused[(name, version)] = RefusedVersion.now(files, exc)
                self._metrics.reloads.labels(name, "refused").inc()
                log.error(
                    "version refused at start; trying the version before it",
                    extra={
                        "model": name,
                        "version": version,
                        "folder": str(self.root.root / name / version),
                        "error": str(exc),
                    },
                )
                refusals.append((version, exc))
                continue
            if refusals:
                log.error(
                    "model started on an older version: every newer one was refused",
                    extra={
                        "model": name,
                        "version": version,
                        "refused": [refused for refused, _ in refusals],
                    },
                )
            return
        newest, newest_refusal = refusals[0]
        folder = self.root.root / name / newest
        refused = [version for version, _ in refusals]
        raise _refused_at_start(name, newest, folder, newest_refusal, refused) from newest_refusal

    async def reload(self, name: str, version: str | None) -> tuple[LoadedBundle, str]:
        """ModelService.ReloadModel: load `version` of a served model and pin the model to
        it, or (None) load the newest and unpin it. Returns (new, previous version)."""
        async with self._lock(name):
            if self.loading(name):
                # NOT_FOUND (pool.serving's) would tell an orchestrator's fleet reload,
                # during a rolling restart, that this server does not serve the model.
                raise ModelNotReady(
                    f"model {name!r} is loading its first version; reload it once it serves",
                    model=name,
                )
            previous = self.pool.serving(name)
            target = version or await asyncio.to_thread(self.root.newest, name)
            if target is None:
                raise ModelNotFound(
                    f"model {name!r} has no numbered version folder under {self.root.root}",
                    model=name,
                )
            bundle = await self._reload_locked(name, target, previous.version)
            # Only once the load has succeeded: a refused one changes nothing, so a
            # rollback stays rolled back.
            if version is None:
                self._unpin(name)
            else:
                self._pin(name, version)
        return bundle, previous.version

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _pin(self, name: str, version: str) -> None:
        self._pinned[name] = version
        log.info(
            "model pinned to the version asked for; the watcher loads no newer one until a "
            "ReloadModel without a version",
            extra={"model": name, "version": version},
        )

    def _unpin(self, name: str) -> None:
        version = self._pinned.pop(name, None)
        if version is not None:
            self._held_back = {held for held in self._held_back if held[0] != name}
            log.info(
                "model unpinned; the watcher follows the newest version again",
                extra={"model": name, "was_pinned_to": version},
            )

    async def _reload_locked(self, name: str, target: str, previous: str) -> LoadedBundle:
        """Load `target`, the model's lock held; a refusal is logged, counted and raised
        as ReloadRefused, and `previous` keeps serving."""
        # Taken before the load: files that change during it make a new fingerprint.
        files = await self._read_fingerprint(name, target)
        try:
            bundle = await self._load(name, target)
        except (ModelLoadError, OSError) as exc:
            earlier = self._refused.get((name, target))
            self._refused[(name, target)] = RefusedVersion.now(files, exc, earlier)
            self._metrics.reloads.labels(name, "refused").inc()
            log.warning(
                "reload refused",
                extra={"model": name, "version": target, "error": str(exc), "serving": previous},
            )
            raise ReloadRefused(
                f"version {target} of {name!r} refused, version {previous} keeps serving: {exc}",
                model=name,
                version=target,
            ) from exc
        except ModelNotFound:
            raise  # gone since it was listed: nothing to remember
        except Exception:
            # Not a refusal but a bug, raised as it is (INTERNAL to a ReloadModel caller;
            # logged and counted by the watcher). Remembered like a refusal all the same,
            # so that the watcher does not try the version again every poll.
            self._refused[(name, target)] = RefusedVersion.now(
                files, "internal error while loading (logged with its traceback)"
            )
            raise
        self._refused.pop((name, target), None)
        self._metrics.reloads.labels(name, "ok").inc()
        return bundle

    async def _load(self, name: str, version: str) -> LoadedBundle:
        directory = await asyncio.to_thread(self.root.version_dir, name, version)
        settings = self.settings_for(name)
        if settings.cache_hit_floor is not None:
            self._metrics.result_cache_hit_floor.labels(name).set(settings.cache_hit_floor)
        warm_texts = (
            ()
            if settings.warm_texts is None
            else await asyncio.to_thread(read_warm_texts, settings.warm_texts)
        )
        try:
            return await self.pool.load(
                directory,
                settings.batching,
                settings.precision,
                graph=settings.graph,
                expected_name=name,
                # As listed, not as resolved: a version folder linked to another within
                # the root (`2 -> .release-2`, `2 -> 1`) served under its target's name,
                # and the watcher, seeing "newer" numbered folders, reloaded it every poll.
                version=version,
                residency=settings.residency,
                idle_seconds=settings.idle_seconds,
                warm_texts=warm_texts,
            )
        except torch.OutOfMemoryError as exc:
            # The device had less room than the ledger's prediction (another process
            # on the GPU, fragmentation): a refusal for room, tried again for room and,
            # at start, the version before it tried. As the bug it was taken for, a
            # ReloadModel answered INTERNAL and the start failed outright.
            raise MemoryBudgetExceeded(
                f"the device ran out of memory loading version {version} of {name!r} "
                f"({str(exc).splitlines()[0] if str(exc) else 'no detail'})"
            ) from exc

    async def watch(self, interval_seconds: float) -> None:
        """Reload a model whenever a newer numbered version folder than the serving one
        appears, or a refused one has changed; pinned models are left alone."""
        while True:
            await asyncio.sleep(interval_seconds)
            for name, serving in self.pool.models().items():
                try:
                    await self._check_serving_folder(name, serving)
                    await self._follow_newest(name, serving.version)
                except Exception as exc:  # any other: a bug; see the module docstring
                    self._metrics.reloads.labels(name, "refused").inc()
                    log.exception(
                        "model watcher: unexpected error; the serving version stays, and "
                        "the next poll looks again",
                        extra={"model": name, "serving": serving.version, "error": repr(exc)},
                    )

    async def _check_serving_folder(self, name: str, serving: LoadedBundle) -> None:
        """Log a WARNING, and count it, when the serving version's folder has gone or
        holds another bundle since it was loaded (once per change, not every poll).
        One stat of its manifest.json a poll; the file is hashed only when the stat
        changed, or once for each version that starts serving."""
        # The version's folder as its name resolves now, not the one it was loaded from:
        # a numbered link re-pointed since (`2 -> .release-2b`) leaves the folder loaded
        # untouched, and the next start serves the other bundle under the same name.
        named = self.root.root / name / serving.version
        folder = Path(await asyncio.to_thread(os.path.realpath, named))
        manifest = folder / MANIFEST
        state = await asyncio.to_thread(_manifest_state, manifest)
        seen = self._served_folders.get(name)
        if seen is not None and seen.digest != serving.digest:
            seen = None  # another version serves since: look afresh
        if seen is not None and seen.manifest == state:
            return
        change = await asyncio.to_thread(_folder_change, manifest, serving.digest)
        self._served_folders[name] = ServedFolder(serving.digest, state, change)
        was = None if seen is None else seen.change
        fields = {"model": name, "version": serving.version, "folder": str(folder)}
        if change is None:
            if was is not None:
                log.info("serving version's folder holds the served bundle again", extra=fields)
            return
        if change == was:
            return
        self._metrics.model_folder_changes.labels(name, change).inc()
        log.warning(
            f"serving version's folder {change}: the loaded bundle serves on; a version "
            "folder must not change once it serves (deploy a new version number)",
            extra={**fields, "change": change, "digest": serving.digest},
        )

    async def _follow_newest(self, name: str, serving: str) -> None:
        """Load the newest version newer than `serving` that loads: newest first, as a
        start does, past the refused ones whose files have not changed since. Trying
        the newest alone left a good version 2 unloaded behind a damaged 3 deployed
        with it, while a restart of the same root served 2: a fleet split by when
        each replica last started."""
        listed = await asyncio.to_thread(self.root.versions, name)
        newer = [version for version in reversed(listed) if is_newer(version, serving)]
        if not newer:
            return
        if name in self._pinned:
            newest = newer[0]
            if (name, newest) not in self._held_back:
                self._held_back.add((name, newest))
                log.info(
                    "new version found, not loaded: the model is pinned by ReloadModel",
                    extra={"model": name, "version": newest, "pinned": self._pinned[name]},
                )
            return
        for version in newer:
            if (name, version) in self._refused:
                if not await self._worth_retrying(name, version):
                    continue
            else:
                log.info("new version found", extra={"model": name, "version": version})
            if await self._load_found(name, version):
                return

    async def _load_found(self, name: str, version: str) -> bool:
        """Load `version`, found newer than the serving one, under the model's lock;
        False when it was refused, or its folder went away since it was listed (a copy
        being redone: the next poll sees what is there then), so an older one may be
        tried."""
        # A refusal is logged and counted in _reload_locked; the old version serves on.
        # A manifest gone with the folder is a refusal, retried once the folder changes.
        try:
            async with self._lock(name):
                # A ReloadModel may have come first, while this waited for the lock: a
                # pin it set wins over the watcher, and a version it loaded counts.
                serving = self.pool.serving(name).version
                if name in self._pinned or not is_newer(version, serving):
                    return True
                try:
                    await self._reload_locked(name, version, serving)
                except asyncio.CancelledError:
                    # Only the server's stop cancels the watcher. The load's next stage
                    # never starts (WorkerPool.load); say so, or the version found
                    # above seems to have vanished.
                    log.warning(
                        "load abandoned: shutting down",
                        extra={"model": name, "version": version, "serving": serving},
                    )
                    raise
        except (ReloadRefused, ModelNotFound):
            return False
        return True

    async def _worth_retrying(self, name: str, version: str) -> bool:
        """Whether a refused version's files changed since the refusal and then held
        still since the last look: a copy still under way is left to finish rather
        than verified (every weight byte hashed) on each poll."""
        refused = self._refused[(name, version)]
        files = await self._read_fingerprint(name, version)
        if (
            files is not None
            and refused.room_retry_at is not None
            and asyncio.get_running_loop().time() >= refused.room_retry_at
        ):
            self._metrics.reload_retries.labels(name).inc()
            log.info(
                "version refused for want of room, trying it again",
                extra={"model": name, "version": version, "waited_s": refused.room_retry_seconds},
            )
            return True
        if files is None or files == refused.refused_as:
            return False
        if files != refused.last_seen:
            refused.last_seen = files
            return False
        self._metrics.reload_retries.labels(name).inc()
        log.info(
            "refused version changed, trying it again", extra={"model": name, "version": version}
        )
        return True

    async def _read_fingerprint(self, name: str, version: str) -> Fingerprint | None:
        """The folder's fingerprint, with the model's warm_texts file, read off the event
        loop (a model root on a network volume can take a while to stat); None when it
        cannot be read just now."""
        # A version refused for its signer is tried again once the trusted signers
        # change (the key added), as once its files do.
        also = tuple(
            path
            for path in (self.settings_for(name).warm_texts, self.pool.trusted_signers)
            if path is not None
        )
        try:
            return await asyncio.to_thread(self.root.fingerprint, name, version, also)
        except (ModelNotFound, OSError):
            return None

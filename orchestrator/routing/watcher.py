"""Watch routes.yaml and hand every valid new version to a callback
(classify_common.file_watch says how a file is watched); a refused version leaves
the routes in force."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from classify_common.file_watch import FileIdentity, FileWatcher
from orchestrator.routing.table import RoutesFileError, RouteTable, load_routes

DEFAULT_POLL_SECONDS = 0.5


class RoutesWatcher(FileWatcher[RouteTable]):
    def __init__(
        self,
        path: Path,
        on_change: Callable[[RouteTable], None],
        on_failure: Callable[[Exception], None],
        poll_seconds: float = DEFAULT_POLL_SECONDS,
        loaded: FileIdentity | None = None,
    ) -> None:
        # The parse itself is bounded (see load_routes).
        super().__init__(
            path,
            load_routes,
            RoutesFileError,
            on_change,
            on_failure,
            poll_seconds,
            what="routes file",
            kept="the routes in force stay",
            loaded=loaded,
        )

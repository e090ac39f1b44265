"""SIGTERM while a server is still starting (loading and warming up its models) stops
it gracefully, over a real capability server process.

Its signal handlers were installed only once it served: until then SIGTERM had its
default action, which kills an ordinary process on the spot and is ignored by a
container's first process (the kernel shields PID 1 from signals it does not
handle), so a pod stopped during warm-up sat out its grace period and was killed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from classify_common.serving import serve_until_signal
from tests.conftest import REPO_ROOT, closed_port, write_routes


def log_events(path: Path) -> list[str]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line).get("event", ""))
        except json.JSONDecodeError:
            continue  # a line still being written, or not a log record
    return events


def test_sigterm_during_warm_up_stops_the_server_gracefully(
    model_root: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "capability.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "capability"),
                *("--port", "0", "--metrics-port", "0", "--device", "cpu"),
                *("--model-root", str(model_root), "--watch-seconds", "0"),
                # The largest memory warm-up (the largest batch at the longest length)
                # keeps the server starting for seconds after it listens.
                *("--memory-warm-up", "largest", "--result-cache-entries", "0"),
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        deadline = time.monotonic() + 60
        while "listening, warming up" not in log_events(log_path):
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server never listened"
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    events = log_events(log_path)
    assert returncode == 0, log_path.read_text()  # not -15: killed by the signal
    assert "shutdown signal received while starting" in events
    assert "serving" not in events
    assert events[-1] == "stopped"


class _Recorded:
    """A server that only records its stop, beside a start that waits."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def stop(self, grace_seconds: float | None = None) -> None:
        self.events.append("stopped")

    async def start(self) -> dict[str, object]:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.events.append("start cancelled")
            raise
        return {}


async def test_a_cancelled_serve_cancels_its_start_before_the_server_stops() -> None:
    """Its own cancellation (an embedding program's, a test's) left the start running:
    the server stopped, then the start went on and finished after it."""
    server = _Recorded()
    serving = asyncio.ensure_future(
        serve_until_signal(server, server.start, logging.getLogger(__name__))
    )
    await asyncio.sleep(0.05)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    assert server.events == ["start cancelled", "stopped"]


class _Serving:
    """A server that starts at once and records its stop."""

    def __init__(self) -> None:
        self.stopped = False

    async def stop(self, grace_seconds: float | None = None) -> None:
        self.stopped = True

    async def start(self) -> dict[str, object]:
        return {}


async def test_a_hangup_stops_a_server_unless_it_was_started_to_ignore_hangups() -> None:
    """SIGHUP drains a server as SIGTERM does (a dropped terminal killed it on the
    spot); but one started under nohup, which ignores SIGHUP on purpose, keeps
    serving: a handler would have undone what nohup is for."""
    previous = signal.getsignal(signal.SIGHUP)
    try:
        for ignored in (True, False):
            signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)
            server = _Serving()
            serving = asyncio.ensure_future(
                serve_until_signal(server, server.start, logging.getLogger(__name__))
            )
            await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGHUP)
            await asyncio.sleep(0.2)
            assert serving.done() is not ignored
            if ignored:
                serving.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await serving
            assert server.stopped
    finally:
        # The loop's handler first: closing the loop would otherwise remove it later,
        # setting SIGHUP to its default for the rest of this process and its children.
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("server", ["capability", "orchestrator"])
def test_a_stop_while_the_server_imports_ends_it_at_once_with_status_0(
    server: str, tmp_path: Path, model_root: Path
) -> None:
    """Its handlers came after its imports (seconds: torch, CUDA): a SIGTERM in them
    killed it without a word (status -15), and a container's first process, shielded
    from signals it does not handle, ignored it and went on to serve."""
    # Settings it starts with: a stop that comes after the imports ends it with 0 too,
    # so the outcome does not hang on how fast this machine imports.
    flags = ["--port", "0", "--metrics-port", "-1"]
    if server == "orchestrator":
        routes = write_routes(tmp_path / "routes.yaml", [f"127.0.0.1:{closed_port()}"])
        flags += ["--auth", "disabled", "--routes-file", str(routes)]
    else:
        flags += ["--model-root", str(model_root), "--device", "cpu"]
    process = subprocess.Popen(
        [sys.executable, "-m", server, *flags],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)  # importing: torch alone takes longer than this
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

"""The --processes supervisor (orchestrator.workers) when a process misbehaves: the
supervisor signalled or killed, a second one on its port, a worker frozen, a worker's
replacement hung while starting or unable to start.

The supervisor runs as `python -m orchestrator` where the signal it gets matters, and
in this process (WorkerSupervisor, its real workers spawned) where a test shortens its
intervals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import workers
from orchestrator.workers import WORKER_RESTARTS_TOTAL, WorkerSupervisor
from tests.conftest import (
    REPO_ROOT,
    ProcessStarter,
    RedisServer,
    ServerProcess,
    closed_port,
    orchestrator_settings,
    wait_until,
    write_routes,
)
from tests.system.test_processes import every_worker_logged

PORT_IN_USE = "the port is in use, or the host is not an address of this machine"


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (an exited one that nobody has
    reaped yet, a zombie, has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def supervisor_flags(redis_server: RedisServer, routes_file: Path) -> tuple[str, ...]:
    """Two workers, no capability server (they start without reaching one)."""
    return (
        *("--processes", "2", "--state-url", redis_server.url, "--auth", "disabled"),
        *("--routes-file", str(write_routes(routes_file, [f"127.0.0.1:{closed_port()}"]))),
    )


def start_supervisor(
    start_process: ProcessStarter, redis_server: RedisServer, tmp_path: Path
) -> ServerProcess:
    return start_process(
        "orchestrator",
        *("--port", "0", "--metrics-port", "0"),
        *supervisor_flags(redis_server, tmp_path / "routes.yaml"),
    )


def events(process: ServerProcess, event: str) -> list[dict[str, Any]]:
    return [line for line in process.log_lines() if line.get("event") == event]


async def test_a_hangup_stops_the_supervisor_and_its_workers_gracefully(
    start_process: ProcessStarter, redis_server: RedisServer, tmp_path: Path
) -> None:
    """SIGHUP (a terminal's hangup) had its default action: the supervisor died on the
    spot (129), without a log line, and its workers served on, unsupervised."""
    supervisor = start_supervisor(start_process, redis_server, tmp_path)
    pids = await every_worker_logged(supervisor, 2)
    supervisor.process.send_signal(signal.SIGHUP)
    assert supervisor.process.wait(timeout=60) == 0
    received = events(supervisor, "shutdown signal received")
    assert [line["signal"] for line in received if "worker" not in line] == ["SIGHUP"]
    # The supervisor passed a stop on: each worker drained.
    assert sorted((line["worker"], line["signal"]) for line in received if "worker" in line) == [
        (0, "SIGTERM"),
        (1, "SIGTERM"),
    ]
    assert sorted(line.get("worker", -1) for line in events(supervisor, "stopped")) == [-1, 0, 1]
    assert not any(running(pid) for pid in pids.values())


async def test_workers_drain_and_exit_when_their_supervisor_is_killed(
    start_process: ProcessStarter, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Killed (SIGKILL, the OOM killer), the supervisor left its workers serving the
    port, unsupervised, with no /metrics for the set."""
    supervisor = start_supervisor(start_process, redis_server, tmp_path)
    pids = await every_worker_logged(supervisor, 2)
    try:
        supervisor.process.kill()
        supervisor.process.wait(timeout=30)
        await wait_until(
            lambda: not any(running(pid) for pid in pids.values()), "the workers exited", 60
        )
    finally:
        for pid in pids.values():  # orphans of a failed test
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    # Each drained, as on a stop.
    await wait_until(lambda: len(events(supervisor, "stopped")) == 2, "the workers' lines")
    assert sorted(line["worker"] for line in events(supervisor, "stopped")) == [0, 1]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", supervisor.port), timeout=10).close()


def test_a_second_supervisor_on_a_port_in_use_refuses_to_start(
    start_process: ProcessStarter, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Its workers bind with SO_REUSEPORT, which the first set's listeners allow: a
    second supervisor on the port served beside the first without a word, the kernel
    splitting the connections between the two sets."""
    first = start_supervisor(start_process, redis_server, tmp_path)
    second = subprocess.run(
        [
            *(sys.executable, "-m", "orchestrator"),
            *("--port", str(first.port), "--metrics-port", "-1"),
            *supervisor_flags(redis_server, tmp_path / "second-routes.yaml"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2, second.stderr
    lines = [json.loads(line) for line in second.stderr.splitlines() if line.startswith("{")]
    assert [line["error"] for line in lines if line["event"] == "cannot start"] == [
        f"--port / ORCHESTRATOR_PORT: cannot listen on 127.0.0.1:{first.port}: {PORT_IN_USE}"
    ]
    assert not [line for line in lines if line["event"] == "worker serving"]


# In this process: a supervisor whose intervals a test shortens.


@contextlib.asynccontextmanager
async def supervising(
    redis_server: RedisServer, routes_file: Path
) -> AsyncIterator[WorkerSupervisor]:
    """Two workers started and watched; stopped at the end (any that a test stopped with
    SIGSTOP continued first, so that they can drain)."""
    settings = orchestrator_settings(
        processes=2,
        state_url=redis_server.url,
        routes_file=write_routes(routes_file, [f"127.0.0.1:{closed_port()}"]),
    )
    supervisor = WorkerSupervisor(settings)
    watching: asyncio.Task[None] | None = None
    try:
        await supervisor.start()
        watching = asyncio.create_task(supervisor.watch())
        yield supervisor
    finally:
        if watching is not None:
            watching.cancel()
            await asyncio.wait({watching})
        for _, pid, _ in supervisor.worker_metrics_sources():
            if pid is not None and running(pid):
                os.kill(pid, signal.SIGCONT)
        await supervisor.stop(grace_seconds=0)


def pid_of(supervisor: WorkerSupervisor, slot: int) -> int | None:
    return supervisor.worker_metrics_sources()[slot][1]


def serving_pid(supervisor: WorkerSupervisor, slot: int) -> int | None:
    """The pid of slot's worker once it serves (has reported ready), else None."""
    _, pid, metrics_port = supervisor.worker_metrics_sources()[slot]
    return pid if metrics_port is not None else None


def restarts(supervisor: WorkerSupervisor) -> float | None:
    return supervisor.registry.get_sample_value(WORKER_RESTARTS_TOTAL)


def logged(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.getMessage() == event]


async def test_a_worker_that_stops_answering_is_killed_and_started_again(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stopped (or frozen) worker was never noticed: classify_workers still counted
    it, and the calls and health checks that landed on its connections hung. It is
    stopped as a stop stops it (SIGCONT, SIGTERM: it drains, exit status 0), not
    killed with the calls it holds, and its slot waits a pause before the restart."""
    monkeypatch.setattr(workers, "LIVENESS_SECONDS", 0.3)
    monkeypatch.setattr(workers, "LIVENESS_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(workers, "RESTART_PAUSE_SECONDS", 0.1)
    caplog.set_level(logging.INFO, logger=workers.__name__)
    async with supervising(redis_server, tmp_path / "routes.yaml") as supervisor:
        steady, frozen = pid_of(supervisor, 0), pid_of(supervisor, 1)
        assert frozen is not None
        os.kill(frozen, signal.SIGSTOP)
        await wait_until(
            lambda: serving_pid(supervisor, 1) not in (None, frozen), "worker 1 serving again", 60
        )
        stopped = logged(caplog, "worker not answering; stopping it")
        assert [(r.worker, r.pid, r.checks) for r in stopped] == [  # type: ignore[attr-defined]
            (1, frozen, workers.LIVENESS_FAILURES)
        ]
        exited = logged(caplog, "worker exited")
        assert [(r.worker, r.exit_status) for r in exited] == [(1, 0)]  # type: ignore[attr-defined]
        pauses = [r.pause_seconds for r in logged(caplog, "worker restarting")]  # type: ignore[attr-defined]
        assert pauses == [0.1]  # whatever froze it may freeze the next
        assert restarts(supervisor) == 1
        assert pid_of(supervisor, 0) == steady  # the one that answered is left alone
        assert not running(frozen)


async def test_a_replacement_hung_starting_delays_no_other_restart_and_is_replaced(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Restarts went one at a time: while a replacement hung starting, another worker's
    exit went unnoticed for up to WORKER_START_SECONDS; and a replacement that never
    reported ready was left running, its slot empty for good."""
    start_seconds = 10.0
    monkeypatch.setattr(workers, "WORKER_START_SECONDS", start_seconds)
    caplog.set_level(logging.INFO, logger=workers.__name__)
    async with supervising(redis_server, tmp_path / "routes.yaml") as supervisor:
        first = [pid_of(supervisor, 0), pid_of(supervisor, 1)]
        assert first[0] is not None
        assert first[1] is not None
        os.kill(first[1], signal.SIGKILL)
        await wait_until(lambda: pid_of(supervisor, 1) != first[1], "worker 1 restarting", 30)
        hung = pid_of(supervisor, 1)
        assert hung is not None
        os.kill(hung, signal.SIGSTOP)  # its replacement hangs while starting
        os.kill(first[0], signal.SIGKILL)
        await wait_until(
            lambda: serving_pid(supervisor, 0) not in (None, first[0]), "worker 0 serving again", 30
        )
        # Worker 0 was restarted while worker 1's replacement still had time to start.
        assert logged(caplog, "worker restart failed") == []
        assert pid_of(supervisor, 1) == hung
        assert running(hung)
        # Out of time, it is killed and its slot started again.
        await wait_until(
            lambda: serving_pid(supervisor, 1) not in (None, hung),
            "worker 1 serving again",
            start_seconds + 30,
        )
        failed = logged(caplog, "worker restart failed")
        assert [(r.worker, r.error) for r in failed] == [  # type: ignore[attr-defined]
            (
                1,
                f"orchestrator worker 1 did not report ready in {start_seconds:g}s and was "
                "killed; its log says how far it got",
            )
        ]
        assert not running(hung)
        assert restarts(supervisor) == 3


async def test_a_slot_whose_worker_cannot_start_waits_longer_each_time(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a routes edit the workers refused (the file on disk is invalid), a worker
    that exited was replaced over and over at a fixed 1 s pause (6 starts in 7 s). The
    pause doubles with each quick exit in a row, up to a cap, and starts over once a
    worker has served; each failed start names the exit status (it read None)."""
    monkeypatch.setattr(workers, "RESTART_PAUSE_SECONDS", 0.1)
    monkeypatch.setattr(workers, "RESTART_PAUSE_MAX_SECONDS", 0.2)
    monkeypatch.setattr(workers, "QUICK_EXIT_SECONDS", 0.0)  # a worker that served served long
    caplog.set_level(logging.INFO, logger=workers.__name__)
    routes_file = tmp_path / "routes.yaml"
    async with supervising(redis_server, routes_file) as supervisor:
        good = routes_file.read_text()
        refused = tmp_path / "refused.yaml"
        refused.write_text("version: 1\nbackends: {}\nroutes: []\n")
        refused.replace(routes_file)

        def pauses() -> list[float]:
            return [r.pause_seconds for r in logged(caplog, "worker restarting")]  # type: ignore[attr-defined]

        killed = pid_of(supervisor, 1)
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        await wait_until(lambda: len(pauses()) >= 4, "four restarts", 60)
        routes_file.write_text(good)
        # At once after a worker that served; then 0.1 s, doubled, capped at 0.2 s.
        assert pauses()[:4] == [0.0, 0.1, 0.2, 0.2]
        await wait_until(lambda: serving_pid(supervisor, 1) is not None, "worker 1 serving", 60)
        failed = logged(caplog, "worker restart failed")
        assert len(failed) >= 3
        for record in failed:
            assert record.error.startswith("orchestrator worker 1 did not start (exit status 2)")  # type: ignore[attr-defined]
        assert {r.worker for r in logged(caplog, "worker restarting")} == {1}  # type: ignore[attr-defined]
        # It served: its exit is restarted at once again.
        restarted = len(pauses())
        replacement = serving_pid(supervisor, 1)
        assert replacement is not None
        os.kill(replacement, signal.SIGKILL)
        await wait_until(lambda: len(pauses()) > restarted, "the next restart", 30)
        assert pauses()[restarted] == 0.0


async def test_a_restart_that_cannot_start_a_process_waits_and_is_not_counted(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No process could be started (EAGAIN: out of processes): the slot was tried again
    every 0.1 s, a traceback and a counted restart each time (the alert fired)."""
    monkeypatch.setattr(workers, "RESTART_PAUSE_SECONDS", 0.1)
    monkeypatch.setattr(workers, "QUICK_EXIT_SECONDS", 0.0)  # a worker that served served long
    caplog.set_level(logging.INFO, logger=workers.__name__)
    async with supervising(redis_server, tmp_path / "routes.yaml") as supervisor:
        spawn = supervisor._spawn
        refusals = iter([OSError(11, "Resource temporarily unavailable")] * 2)

        def spawn_or_fail(index: int) -> workers.Worker:
            refusal = next(refusals, None)
            if refusal is not None:
                raise refusal
            return spawn(index)

        monkeypatch.setattr(supervisor, "_spawn", spawn_or_fail)
        killed = pid_of(supervisor, 1)
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        await wait_until(
            lambda: serving_pid(supervisor, 1) not in (None, killed), "worker 1 serving", 60
        )
        pauses = [r.pause_seconds for r in logged(caplog, "worker restarting")]  # type: ignore[attr-defined]
        assert pauses == [0.0, 0.1, 0.2]  # at once after one that served, then backing off
        failed = [r.error for r in logged(caplog, "worker restart failed")]  # type: ignore[attr-defined]
        assert failed == ["[Errno 11] Resource temporarily unavailable"] * 2
        assert restarts(supervisor) == 1  # the one process started

"""The device thread: jobs run in order on one thread, and every caller gets its answer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from capability.workers.device_thread import DeviceThread


@pytest.fixture
def device_thread() -> Iterator[DeviceThread]:
    thread = DeviceThread("device-test")
    yield thread
    thread.close()


async def test_jobs_run_in_submission_order_on_one_thread(device_thread: DeviceThread) -> None:
    ran: list[tuple[int, str]] = []

    def job(n: int) -> int:
        ran.append((n, threading.current_thread().name))
        return n * n

    results = await asyncio.gather(*(device_thread.submit(job, n) for n in range(20)))

    assert results == [n * n for n in range(20)]
    assert [n for n, _ in ran] == list(range(20))
    assert {name for _, name in ran} == {"device-test"}


async def test_an_error_reaches_its_caller_and_the_next_job_still_runs(
    device_thread: DeviceThread,
) -> None:
    def fails() -> None:
        raise ValueError("bad batch")

    failing = device_thread.submit(fails)
    following = device_thread.submit(lambda: "still served")

    with pytest.raises(ValueError, match="bad batch"):
        await failing
    assert await following == "still served"


async def test_a_job_cancelled_before_it_starts_is_not_run(device_thread: DeviceThread) -> None:
    release = threading.Event()
    ran: list[str] = []
    blocking = device_thread.submit(release.wait, 10)
    skipped = device_thread.submit(ran.append, "skipped")
    skipped.cancel()
    release.set()

    assert await blocking is True
    await device_thread.submit(ran.append, "after")
    assert ran == ["after"]


async def test_close_waits_for_the_running_job_and_cancels_the_queued_ones() -> None:
    thread = DeviceThread("device-closing")
    started = threading.Event()
    finished: list[str] = []

    def running() -> str:
        started.set()
        threading.Event().wait(0.2)
        finished.append("running")
        return "done"

    first = thread.submit(running)
    queued = thread.submit(finished.append, "queued")
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)

    thread.close()

    assert finished == ["running"]
    assert queued.cancelled()
    assert await first == "done"
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(finished.append, "too late")

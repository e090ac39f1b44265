"""The thread that owns a device: runs its work in order, and hands results to the event loop.

Why not a one-thread `ThreadPoolExecutor`: the executor's thread wakes the event loop
itself when a job ends. That wake-up is a socket write, and any system call gives up
the GIL; the serving loop, just woken with a batch of answers to send, takes it and
keeps it until the switch interval forces it out, while the next batch, ready to run,
waits. Measured on the 2-core test machine at saturation: about 10 ms of such waits per
100 ms batch. Here a second, small thread does the wake-ups, so the device thread goes
from one job straight into the next, needing the GIL only for the Python between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from capability.workers.threads import use_intra_op_threads

T = TypeVar("T")


@dataclass
class _Job(Generic[T]):
    future: asyncio.Future[T]
    fn: Callable[..., T]
    args: tuple[object, ...]


@dataclass
class _Answer(Generic[T]):
    future: asyncio.Future[T]
    value: T | None
    error: BaseException | None


def _settle(answer: _Answer[Any]) -> None:
    """On the event loop: give the job's caller its value or error, unless it went away."""
    if answer.future.done():
        return
    if answer.error is not None:
        answer.future.set_exception(answer.error)
    else:
        answer.future.set_result(answer.value)


class DeviceThread:
    """Runs submitted functions one at a time, in order, on a thread of its own."""

    def __init__(self, name: str, nice: int = 0, intra_op_threads: int = 1) -> None:
        """`nice`: niceness of the thread that runs the jobs (and of the threads it
        starts, such as torch's intra-op threads on the CPU), so that when the cores
        are busy the event loops serving requests run before the computation.
        `intra_op_threads`: the torch threads the jobs compute on (threads.py)."""
        self._nice = nice
        self._intra_op_threads = intra_op_threads
        self._jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[_Answer[Any] | None] = queue.SimpleQueue()
        self._runner = threading.Thread(target=self._run_jobs, name=name, daemon=True)
        self._answerer = threading.Thread(
            target=self._deliver_answers, name=f"{name}-answers", daemon=True
        )
        self._closed = False
        self._runner.start()
        self._answerer.start()

    def submit(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """Queue `fn(*args)`; the future (of the running loop) settles when it has run."""
        if self._closed:
            raise RuntimeError("the device thread is closed")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._jobs.put(_Job(future, fn, args))
        return future

    def close(self) -> None:
        """Cancel what has not started, wait for the running job, and end both threads.

        Blocks; call it from the event loop's thread.
        """
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.cancel()
        self._jobs.put(None)
        self._runner.join()
        self._answerer.join()

    def _run_jobs(self) -> None:
        if self._nice:
            # Threads inherit it when created: set before the first job starts any.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        use_intra_op_threads(self._intra_op_threads)
        while (job := self._jobs.get()) is not None:
            # Read across threads, so possibly stale: at worst a job whose caller has
            # gone runs anyway and its answer is dropped (`_settle`).
            if job.future.cancelled():
                continue
            try:
                answer = _Answer(job.future, job.fn(*job.args), None)
            except BaseException as exc:  # the caller gets whatever it raised
                answer = _Answer(job.future, None, exc)
            self._answers.put(answer)
        self._answers.put(None)

    def _deliver_answers(self) -> None:
        while (answer := self._answers.get()) is not None:
            # A closed loop raises RuntimeError: nobody is left to answer.
            with contextlib.suppress(RuntimeError):
                answer.future.get_loop().call_soon_threadsafe(_settle, answer)

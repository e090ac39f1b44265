"""Which threads run torch's parallel CPU work, and how many intra-op threads each gets.

torch runs a CPU op in parallel on an OpenMP team. GNU OpenMP (the one torch ships
with) keeps a team for every thread that has ever run a parallel op, for as long as
that thread lives. Once the teams' threads outnumber the cores, it stops spinning
between parallel regions: a team's threads go to sleep after every op, and every op
then pays for waking them. A loader thread that warmed a model up on two threads
keeps such a team, and so makes the device thread's slower. Measured on the 2-core
machine with topic-minilm on the device thread: one text in 4.2 ms while the device
thread's team is the only one, 5.5 to 5.9 ms beside a loader's; 576 texts/s in
batches of 16 against 443 to 502.

So a CPU worker's device thread runs torch on its share of the cores, and every other
thread that touches torch (loaders and their warm-ups, the event loop, CUDA workers'
device threads, which only launch kernels and copy) runs it on one thread, inline,
keeping no team. A forward of several texts does not use the team at all: it runs
as one part per core, each part on one thread (`CpuLanes`), the device thread's
included, so the lanes add no team either.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable

import torch
from torch import Tensor


def cpu_threads_per_worker(cpu_workers: int, torch_threads: int = 0) -> int:
    """torch intra-op threads for each CPU worker's device thread: `torch_threads`, or
    with 0 all usable cores split between the CPU workers.

    All cores, with none kept back for the serving loop: measured on 2 cores through
    the front door (alternated A/B, 32 and 128 clients), two threads served 349-357
    and 442-447 requests/s, one thread 273-287 and 302-319. The loop's ~0.4 ms of CPU
    per request is worth less than the core it would keep idle.
    """
    return torch_threads or max(1, usable_cores() // max(1, cpu_workers))


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform has one
    (a container's cpuset, `taskset`), which os.cpu_count() ignores, counting the
    host's every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def use_intra_op_threads(threads: int) -> None:
    """Give the calling thread, and only it, `threads` torch intra-op threads.

    torch settles each thread's count on its first parallel op, from the count that
    any thread set last, which would undo a count set before then: reading the count
    first settles it, so the one set here stays.
    """
    torch.get_num_threads()
    torch.set_num_threads(threads)


def compute_inline() -> None:
    """Keep the calling thread's torch work on itself, with no OpenMP team: for every
    thread that is not a CPU worker's device thread (also a ThreadPoolExecutor
    initializer)."""
    use_intra_op_threads(1)


# A forward predicted to take less than this is not split: handing a part to another
# thread and waiting for it costs tens of microseconds, more than a split saves on a
# near-free model (topic-static's batches ran 8% fewer a second split than whole).
MIN_SPLIT_SECONDS = 0.001


class _Part:
    """One part of a split forward, handed to a helper thread."""

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor], args: tuple[Tensor, Tensor]):
        self.fn, self.args = fn, args
        self.result: Tensor | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class CpuLanes:
    """A CPU worker's cores as independent lanes: a forward of several texts runs as
    one part per core, each part on one thread, instead of every op on all cores.

    On the 2-core machine (topic-minilm, one process, the device thread at nice 5)
    two halves on a thread each computed batches of 2, 8 and 32 texts at 1.06 to 1.15
    times the rate of the whole batch on two threads, and at 1.16 to 1.22 times while
    another process kept a third of a core busy, as the serving loops do: a part
    that loses its core for a while delays only itself, where every op of a batch on
    two threads waits for the slower thread. One text still runs on all cores.

    The device thread computes the first part; `threads - 1` helper threads, started
    here at the device thread's niceness, compute the others.
    """

    def __init__(self, name: str, threads: int, nice: int = 0) -> None:
        self.threads = threads
        self._nice = nice
        self._parts: list[queue.SimpleQueue[_Part | None]] = []
        self._helpers: list[threading.Thread] = []
        for index in range(threads - 1):
            parts: queue.SimpleQueue[_Part | None] = queue.SimpleQueue()
            helper = threading.Thread(
                target=self._compute_parts,
                args=(parts,),
                name=f"{name}-lane-{index + 1}",
                daemon=True,
            )
            self._parts.append(parts)
            self._helpers.append(helper)
            helper.start()

    def worth_splitting(self, predicted_seconds: float) -> bool:
        """Whether a forward predicted to take this long should be split."""
        return self.threads > 1 and predicted_seconds >= MIN_SPLIT_SECONDS

    def score(
        self, fn: Callable[[Tensor, Tensor], Tensor], input_ids: Tensor, attention_mask: Tensor
    ) -> Tensor:
        """`fn(input_ids, attention_mask)` computed in row parts, one per lane; the
        calling thread (the device thread) computes the first part on one torch
        thread, then gets its own count back."""
        rows = input_ids.shape[0]
        lanes = min(self.threads, rows)
        if lanes < 2:
            return fn(input_ids, attention_mask)
        ids, masks = input_ids.tensor_split(lanes), attention_mask.tensor_split(lanes)
        others = [_Part(fn, (ids[i], masks[i])) for i in range(1, lanes)]
        for part, parts in zip(others, self._parts, strict=False):
            parts.put(part)
        own_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            first = fn(ids[0], masks[0])
        finally:
            torch.set_num_threads(own_threads)
        results = [first]
        for part in others:
            part.done.wait()
            if part.error is not None:
                raise part.error
            assert part.result is not None
            results.append(part.result)
        return torch.cat(results)

    def close(self) -> None:
        """End the helper threads (after the part each is computing)."""
        for parts in self._parts:
            parts.put(None)
        for helper in self._helpers:
            helper.join()

    def _compute_parts(self, parts: queue.SimpleQueue[_Part | None]) -> None:
        if self._nice:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        compute_inline()
        while (part := parts.get()) is not None:
            try:
                # Grad mode is per thread: the caller's inference mode does not reach here.
                with torch.inference_mode():
                    part.result = part.fn(*part.args)
            except BaseException as exc:  # the device thread raises it for the batch
                part.error = exc
            part.done.set()

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
keeping no team.
"""

from __future__ import annotations

import os

import torch


def cpu_threads_per_worker(cpu_workers: int, torch_threads: int = 0) -> int:
    """torch intra-op threads for each CPU worker's device thread: `torch_threads`, or
    with 0 all cores split between the CPU workers.

    All cores, with none kept back for the serving loop: measured on 2 cores through
    the front door (alternated A/B, 32 and 128 clients), two threads served 349-357
    and 442-447 requests/s, one thread 273-287 and 302-319. The loop's ~0.4 ms of CPU
    per request is worth less than the core it would keep idle.
    """
    cores = os.cpu_count() or 1
    return torch_threads or max(1, cores // max(1, cpu_workers))


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

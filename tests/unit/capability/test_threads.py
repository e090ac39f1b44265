"""Only a CPU worker's device thread runs torch on several threads (workers/threads.py)."""

from __future__ import annotations

import asyncio
import threading

import torch

from capability.workers.threads import compute_inline, cpu_threads_per_worker, use_intra_op_threads
from tests.conftest import StartCapability


def test_a_threads_count_stays_when_another_thread_sets_its_own() -> None:
    """torch settles a thread's count on its first parallel op from the count any thread
    set last; a count set with use_intra_op_threads is not undone that way."""
    counts: dict[str, int] = {}
    set_here = threading.Event()
    other_set = threading.Event()

    def device() -> None:
        use_intra_op_threads(3)
        set_here.set()
        other_set.wait(10)
        counts["device"] = torch.get_num_threads()

    def loader() -> None:
        set_here.wait(10)
        compute_inline()
        counts["loader"] = torch.get_num_threads()
        other_set.set()

    threads = [threading.Thread(target=device), threading.Thread(target=loader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts == {"device": 3, "loader": 1}


def test_the_cores_are_split_between_cpu_workers() -> None:
    assert cpu_threads_per_worker(cpu_workers=1, torch_threads=3) == 3
    cores = cpu_threads_per_worker(cpu_workers=1)
    assert cores >= 1
    assert cpu_threads_per_worker(cpu_workers=cores * 2) == 1


async def test_device_threads_compute_on_their_share_and_loaders_inline(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(models=("topic-minilm",), cpu_workers=2, torch_threads=2)
    assert server.pool.cpu_threads == 2
    for worker in server.pool.workers:
        assert await worker.execute(torch.get_num_threads) == 2
    # The threads that loaded and warmed the replicas up keep no torch threads of
    # their own (they would slow every forward on the device threads).
    loop = asyncio.get_running_loop()
    loaders = server.pool._loaders
    assert await loop.run_in_executor(loaders, torch.get_num_threads) == 1

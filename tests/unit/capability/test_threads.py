"""Which threads run torch on the CPU, and a CPU worker's cores as lanes (workers/threads.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from torch import Tensor

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from capability.bundle import load_bundle
from capability.workers.threads import (
    CpuLanes,
    compute_inline,
    cpu_threads_per_worker,
    use_intra_op_threads,
)
from tests.conftest import StartCapability
from tests.unit.capability.test_serving import TEXTS as SERVING_TEXTS

# Five of them: three lanes get parts of 2, 2 and 1 texts.
TEXTS = SERVING_TEXTS[:5]


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


def test_lanes_compute_row_parts_on_their_own_threads_and_join_them_in_order(
    model_root: Path,
) -> None:
    classifier = load_bundle(model_root / "topic-minilm" / "1").classifier
    whole = classifier.classify(TEXTS).probabilities
    lanes = CpuLanes("test", threads=3)
    seen: list[tuple[int, int]] = []  # (thread id, rows) of each part

    def score(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        seen.append((threading.get_ident(), input_ids.shape[0]))
        return classifier._score(input_ids, attention_mask)

    try:
        split = classifier.run(classifier.tokenize(TEXTS), lanes=_Spy(lanes, score)).probabilities
    finally:
        lanes.close()
    assert sorted(rows for _, rows in seen) == [1, 2, 2]  # 5 texts over 3 lanes
    assert len({thread for thread, _ in seen}) == 3
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=0)


def test_a_part_that_fails_fails_the_forward(model_root: Path) -> None:
    classifier = load_bundle(model_root / "topic-minilm" / "1").classifier
    lanes = CpuLanes("test", threads=2)
    main = threading.get_ident()

    def score(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        if threading.get_ident() != main:
            raise RuntimeError("planted failure in a lane")
        return classifier._score(input_ids, attention_mask)

    try:
        with pytest.raises(RuntimeError, match="planted failure in a lane"):
            classifier.run(classifier.tokenize(TEXTS), lanes=_Spy(lanes, score))
        # The lane is still there for the next forward.
        classifier.run(classifier.tokenize(TEXTS), lanes=lanes)
    finally:
        lanes.close()


async def test_a_cpu_workers_batches_are_split_over_its_cores_with_unchanged_scores(
    start_capability: StartCapability,
) -> None:
    server = await start_capability(models=("topic-minilm",), torch_threads=2, max_batch_size=8)
    worker = server.pool.workers[0]
    assert worker.lanes is not None
    split_rows: list[int] = []
    score = worker.lanes.score

    def counting_score(fn: object, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        split_rows.append(input_ids.shape[0])
        return score(fn, input_ids, attention_mask)  # type: ignore[arg-type]

    worker.lanes.score = counting_score  # type: ignore[method-assign]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        one_by_one = [await stub.Classify(pb.ClassifyRequest(text=text)) for text in TEXTS]
        together = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(items=[pb.ClassifyRequest(text=text) for text in TEXTS])
        )
    # One text runs whole on both cores; the five together, once the service-time fit
    # has seen a forward cost more than a split saves, in parts.
    assert len(TEXTS) in split_rows
    for alone, item in zip(one_by_one, together.results, strict=True):
        batched = item.response
        assert [label.name for label in alone.labels] == [label.name for label in batched.labels]
        for a, b in zip(alone.labels, batched.labels, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5)


class _Spy:
    """CpuLanes with the scoring function swapped for the test's."""

    def __init__(self, lanes: CpuLanes, score: object) -> None:
        self._lanes, self._score = lanes, score

    def score(self, fn: object, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self._lanes.score(self._score, input_ids, attention_mask)  # type: ignore[arg-type]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to tell one from all")
def test_all_cores_are_those_the_process_may_run_on() -> None:
    """A container's cpuset (or `taskset`) limits the cores a process may run on, but
    os.cpu_count() counts the host's: every CPU worker took the host's cores, more
    threads than it could run."""
    script = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from capability.workers.threads import cpu_threads_per_worker; "
        "print(cpu_threads_per_worker(1))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "1"

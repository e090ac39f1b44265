"""`make gpu-check`: a worker per GPU, a batch-size sweep, memory and the TF32 state,
the model memory ledger, fragmentation and on-demand cold starts, then, with CUDA,
the full-stack sweep through the front door on the GPU.

The worker sweep runs in under five minutes, the full-stack sweep
(bench/front_door.py --device cuda) in about five more. Without CUDA the worker
sweep runs on the CPU through the same code path, so the script itself is
checked on every machine, and the full-stack sweep is skipped with a note
(`make bench-front-door` runs it on the CPU).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402

from capability.batching import BatchingSettings  # noqa: E402
from capability.memory import format_bytes, read_memory, split_memory  # noqa: E402
from capability.metrics import CACHE_RELEASE_EVICTED, CapabilityMetrics  # noqa: E402
from capability.model import TextClassifier  # noqa: E402
from capability.model.stages import STAGES, StageClock  # noqa: E402
from capability.workers import DeviceWorker, WorkerPool, discover_devices  # noqa: E402
from capability.workers.cuda import (  # noqa: E402
    allocator_report,
    configure_cuda_defaults,
    read_device_memory,
    tf32_enabled,
)

BUNDLE = REPO_ROOT / "build" / "models" / "topic-minilm" / "1"
FRONT_DOOR = Path(__file__).resolve().parent / "front_door.py"
BATCH_SIZES = (1, 8, 32, 128, 256)
SECONDS_PER_SIZE = 3.0
STAGE_BATCH = 32
TEXT = "The striker scored twice in the final minutes of the cup match"
MIB = 1024 * 1024


async def main() -> None:
    configure_cuda_defaults()
    devices = discover_devices("auto", cpu_workers=1)
    print(
        f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, "
        f"devices: {[str(d) for d in devices]}"
    )
    for device in devices:
        if device.type == "cuda":
            print(f"  {device}: {torch.cuda.get_device_name(device)}")
    print(f"TF32 enabled: {tf32_enabled()} (expected False)")
    print(f"allocator: {allocator_report(devices, 'expandable_segments')}")
    pool = WorkerPool(devices, CapabilityMetrics(CollectorRegistry()), memory_threshold=0.82)
    try:
        bundle = await pool.load(BUNDLE, BatchingSettings())
        print(
            f"model {bundle.name} v{bundle.version}, load {bundle.load_seconds:.2f} s per replica"
        )
        for worker in pool.workers:
            classifier = worker.replicas[bundle.name].bundle.classifier
            print(
                f"\n{worker.name}: batch | texts/s | batch latency p50 ms | p99 ms | "
                "allocated MiB | reserved MiB | peak MiB"
            )
            for size in BATCH_SIZES:
                encoded = classifier.tokenize([TEXT] * size)
                await worker.run_on_device(classifier.run, encoded)
                timings: list[float] = []
                stop_at = time.perf_counter() + SECONDS_PER_SIZE
                while time.perf_counter() < stop_at:
                    started = time.perf_counter()
                    # run() copies probabilities to the host, so the device has finished.
                    await worker.run_on_device(classifier.run, encoded)
                    timings.append(time.perf_counter() - started)
                timings.sort()
                memory = read_device_memory(worker.device)
                memory_text = (
                    f"{memory.allocated_bytes / MIB:13.0f} | {memory.reserved_bytes / MIB:12.0f} | "
                    f"{memory.peak_allocated_bytes / MIB:8.0f}"
                    if memory
                    else "            - |            - |        -"
                )
                print(
                    f"{worker.name:>8}: {size:5d} | {size * len(timings) / sum(timings):7.0f} | "
                    f"{statistics.median(timings) * 1000:20.2f} | "
                    f"{timings[int(0.99 * (len(timings) - 1))] * 1000:6.2f} | {memory_text}"
                )
            await print_stages(worker.name, worker.device, classifier)
        print_ledger(pool, bundle.name)
        for worker in pool.workers:
            await print_cold_starts(worker, bundle.name)
    finally:
        await pool.close()


async def print_stages(name: str, device: torch.device, classifier: TextClassifier) -> None:
    """One batch's lifecycle stages as traces record them: CUDA events on a GPU."""
    clock = StageClock(device)
    classifier.run(classifier.tokenize([TEXT] * STAGE_BATCH), clock)
    marks = clock.epoch_ns()
    stages = ", ".join(
        f"{stage} {(end - start) / 1e6:.2f} ms"
        for stage, start, end in zip(STAGES, marks, marks[1:], strict=False)
    )
    print(f"{name:>8}: stages at batch {STAGE_BATCH} ({clock.kind}): {stages}")


def print_ledger(pool: WorkerPool, model: str) -> None:
    """The memory ledger of `model` on each worker, and the allocator's fragmentation."""
    for name, ledger, budget, _ in pool.ledgers(model):
        print(
            f"\n{name}: ledger of {model} ({ledger.source}), budget {format_bytes(budget)}: "
            f"weights {format_bytes(ledger.weights_bytes)}, "
            f"predicted {format_bytes(ledger.predicted_bytes)}, "
            f"footprint {format_bytes(ledger.footprint_bytes)}"
        )
        for stage in ledger.stages:
            grown = stage.after.minus(stage.before)
            after = stage.after
            print(
                f"{name:>8}: {stage.stage:>13} "
                f"allocated {format_bytes(after.allocated_bytes)} "
                f"({grown.allocated_bytes / MIB:+.1f} MiB), "
                f"reserved {format_bytes(after.reserved_bytes)} "
                f"({grown.reserved_bytes / MIB:+.1f} MiB)"
            )
        print(
            f"{name:>8}: warm-up at {ledger.warm_up_batch_size} x {ledger.warm_up_tokens}: "
            f"after {format_bytes(ledger.after_warm_up.allocated_bytes)} allocated, "
            f"{format_bytes(ledger.after_warm_up.reserved_bytes)} reserved, "
            f"peak {format_bytes(ledger.warm_up_peak_bytes)}"
        )
    for worker in pool.workers:
        split = split_memory(worker.device)
        print(
            f"{worker.name:>8}: fragmentation: "
            + (
                f"{format_bytes(split.reserved_unallocated_bytes)} reserved unallocated, "
                f"{format_bytes(split.inactive_split_bytes)} inactive split"
                if split is not None
                else "not measured on the CPU"
            )
        )


async def print_cold_starts(worker: DeviceWorker, model: str, times: int = 3) -> None:
    """Take the model's weights off the device and bring them back (an on_demand cold
    start), `times` times: seconds and memory each way."""
    replica = worker.replicas[model]
    await worker.run_on_device(replica.keep_on_host)
    await worker.release_cached(CACHE_RELEASE_EVICTED)
    for _ in range(times):
        off = read_memory(worker.device).allocated_bytes
        await worker.ensure_resident(replica)
        on = read_memory(worker.device).allocated_bytes
        print(
            f"{worker.name:>8}: cold start {replica.cold_start_seconds or 0:.3f} s, "
            f"allocated {format_bytes(off)} -> {format_bytes(on)}"
        )
        assert replica.on_demand is not None
        await worker.run_on_device(replica.on_demand.evict)
        await worker.release_cached(CACHE_RELEASE_EVICTED)


def run_stack_sweep() -> int:
    """The front-door benchmark with the capability on the GPU; its exit status."""
    if not torch.cuda.is_available():
        print(
            "\nfull-stack sweep: no CUDA device here, skipped "
            "(`make bench-front-door` runs it on the CPU)"
        )
        return 0
    print(f"\nfull-stack sweep: {FRONT_DOOR.name} --device cuda", flush=True)
    command = [sys.executable, str(FRONT_DOOR), "--device", "cuda"]
    return subprocess.run(command, cwd=REPO_ROOT, check=False).returncode


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(run_stack_sweep())

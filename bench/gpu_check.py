"""`make gpu-check`: a worker per GPU, a batch-size sweep, memory and the TF32 state,
then, with CUDA, the full-stack sweep through the front door on the GPU.

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
from capability.metrics import CapabilityMetrics  # noqa: E402
from capability.model import TextClassifier  # noqa: E402
from capability.model.stages import STAGES, StageClock  # noqa: E402
from capability.workers import WorkerPool, discover_devices  # noqa: E402
from capability.workers.cuda import configure_cuda_defaults, read_device_memory, tf32_enabled  # noqa: E402

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

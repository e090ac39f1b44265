"""`make gpu-check`: a worker per GPU, TF32 off, every device's scores against the CPU,
a batch-size sweep with memory, the model memory ledger, fragmentation and on-demand
cold starts, then, with CUDA, the full-stack sweep through the front door on the GPU.

The consistency check runs first: the same texts (short and long, padded
together in one batch) through each worker's replica, loaded in fp32, and
through a CPU replica in fp32 in this process. Each device passes when every
score is within SCORE_TOLERANCE of the CPU's and the top labels agree; TF32
must be off (it would move scores by about 1e-3: the tolerance is set to catch
that). Any failure, of the consistency check or of TF32, makes the exit status 1.

The worker sweep runs in under five minutes, the full-stack sweep
(bench/front_door.py --device cuda) in about five more. Without CUDA the worker
sweep runs on the CPU through the same code path, so the script itself is
checked on every machine, and the full-stack sweep is skipped with a note
(`make bench-front-door` runs it on the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402

from bench.load_clients import percentile  # noqa: E402
from capability.batching import BatchingSettings  # noqa: E402
from capability.bundle import load_bundle  # noqa: E402
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
# Largest |score difference| from the CPU's allowed for a device in fp32 with TF32
# off. fp32 kernels that only sum in another order differ by about 1e-6 here; TF32
# matmuls (10-bit mantissas) by about 1e-3.
SCORE_TOLERANCE = 1e-4
CONSISTENCY_TEXTS = (
    *(
        "The striker scored twice in the final minutes of the cup match",
        "Shares fell sharply after the bank cut its profit forecast",
        "The new chip doubles battery life in laptops",
        "Rebels and the army agreed to a ceasefire in the capital",
        "Tea",
    ),
    # Long ones, so the batch is padded and longer sequences are compared too.
    " ".join(["The central bank said inflation would ease as energy prices fell"] * 12),
    " ".join(["Engineers tested the reusable rocket engine for a full mission burn"] * 20),
)
FRONT_DOOR = Path(__file__).resolve().parent / "front_door.py"
BATCH_SIZES = (1, 8, 32, 128, 256)
SECONDS_PER_SIZE = 3.0
STAGE_BATCH = 32
TEXT = "The striker scored twice in the final minutes of the cup match"
MIB = 1024 * 1024


async def main() -> bool:
    """The sweep after the consistency check; True when every device passed and TF32 is
    off."""
    configure_cuda_defaults()
    devices = discover_devices("auto", cpu_workers=1)
    print(
        f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, "
        f"devices: {[str(d) for d in devices]}"
    )
    for device in devices:
        if device.type == "cuda":
            print(f"  {device}: {torch.cuda.get_device_name(device)}")
    tf32_off = not tf32_enabled() and torch.get_float32_matmul_precision() == "highest"
    print(
        f"TF32 enabled: {tf32_enabled()}, float32 matmul precision "
        f"{torch.get_float32_matmul_precision()!r} (expected False, 'highest'): "
        f"{'ok' if tf32_off else 'FAILED'}"
    )
    print(f"allocator: {allocator_report(devices, 'expandable_segments')}")
    pool = WorkerPool(devices, CapabilityMetrics(CollectorRegistry()), memory_threshold=0.82)
    try:
        bundle = await pool.load(BUNDLE, BatchingSettings(), precision="fp32")
        print(
            f"model {bundle.name} v{bundle.version}, load {bundle.load_seconds:.2f} s per replica"
        )
        consistent = await check_consistency(pool.workers, bundle.name)
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
                    f"{percentile(timings, 0.99) * 1000:6.2f} | {memory_text}"
                )
            await print_stages(worker.name, worker.device, classifier)
        print_ledger(pool, bundle.name)
        for worker in pool.workers:
            await print_cold_starts(worker, bundle.name)
    finally:
        await pool.close()
    return tf32_off and consistent


async def check_consistency(workers: Sequence[DeviceWorker], model: str) -> bool:
    """Each worker's scores for CONSISTENCY_TEXTS against a CPU replica's, both in fp32."""
    reference = load_bundle(BUNDLE, "cpu", precision="fp32").classifier
    encoded = reference.tokenize(list(CONSISTENCY_TEXTS))
    expected = reference.run(encoded).probabilities
    print(
        f"\nconsistency against the CPU in fp32 ({len(CONSISTENCY_TEXTS)} texts, one padded "
        f"batch; tolerance {SCORE_TOLERANCE:g}):"
    )
    print("  device | largest score difference | top labels agree | result")
    passed = True
    for worker in workers:
        classifier = worker.replicas[model].bundle.classifier
        scores = (await worker.run_on_device(classifier.run, encoded)).probabilities
        difference = float((scores - expected).abs().max())
        agree = bool((scores.argmax(dim=1) == expected.argmax(dim=1)).all())
        ok = difference <= SCORE_TOLERANCE and agree
        passed = passed and ok
        print(
            f"  {worker.name:>6} | {difference:24.2e} | {'yes' if agree else 'NO':>16} "
            f"| {'ok' if ok else 'FAILED'}"
        )
    if not any(worker.device.type == "cuda" for worker in workers):
        print(
            "  (no CUDA device here: only the CPU worker was compared; the CUDA rows are skipped)"
        )
    return passed


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
    # No options; --help says what it does instead of starting the sweep.
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    checks_passed = asyncio.run(main())
    sweep_status = run_stack_sweep()
    if not checks_passed:
        print("\ngpu-check: FAILED (TF32 or a device's scores; see above)")
    sys.exit(sweep_status or (0 if checks_passed else 1))

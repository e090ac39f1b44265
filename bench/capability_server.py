"""`make bench-capability`: our server against the raw model ceiling and a naive server.

All three are measured in one run on this machine, with the same bundle, precision
and torch threads, so the ratios mean something on a noisy shared host. Because
the host is shared, the ceiling is measured again right before and right after
each load level, and each level's ratio is to the mean of those two (its
"adjacent" ceiling); the CPU that other processes used during the level is
printed beside it:

1. ceiling: in-process batched forward passes of pre-tokenized short texts at
   each batch size; the best throughput is the ceiling.
2. ours: `python -m capability` (one CPU worker, dynamic batching) under 1, 8,
   32 and 128 concurrent gRPC clients.
3. naive: a gRPC server in this file that runs one forward per request, as
   the simplest model server would, under the same clients.

Prints a table and writes build/bench/capability_server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.harness import (  # noqa: E402
    MODEL_ROOT,
    RESULTS_DIR,
    AdjacentCeiling,
    Progress,
    ServerProcess,
    capability_command,
    drive,
    forward_rate,
    measure_ceiling,
    measure_level,
    naive_command,
    start_server,
    unary_call,
)
from capability.bundle import load_bundle  # noqa: E402
from capability.model import TextClassifier  # noqa: E402
from capability.workers.threads import cpu_threads_per_worker  # noqa: E402

RESULTS = RESULTS_DIR / "capability_server.json"
BUNDLE = MODEL_ROOT / "topic-minilm" / "1"
CONCURRENCY = (1, 8, 32, 128)
# Seconds of each ceiling probe taken right before and right after a load level.
PROBE_SECONDS = 2.0
# The saturation figure alternates short ceiling and server windows, so the host's
# drift (its speed moved by a third within minutes) falls on both alike.
SATURATION_ROUNDS = 5
SATURATION_SECONDS = 3.0
STEPS = 2 + 1 + len(CONCURRENCY) + 1 + len(CONCURRENCY)


def run_load(
    server: ServerProcess,
    ceiling: AdjacentCeiling,
    seconds: float,
    runner: asyncio.Runner,
    progress: Progress,
) -> dict[int, dict[str, Any]]:
    """Each level between two ceiling probes, with the CPU other processes used meanwhile,
    and (for our server) the share of time its device computed and the mean batch."""
    results = {}
    for c in CONCURRENCY:
        progress.step(f"{server.name}: {c} clients")
        result, observed = measure_level(
            server.target,
            c,
            seconds,
            unary_call(),
            runner=runner,
            ceiling=ceiling,
            servers={"server": server},
            progress=progress,
        )
        if server.metrics_url:
            batches = max(observed.delta("server", "classify_batch_size_count"), 1.0)
            busy = observed.delta("server", "classify_worker_busy_seconds_total")
            result["device_busy"] = busy / result["seconds"]
            result["mean_batch"] = observed.delta("server", "classify_batch_size_sum") / batches
        results[c] = result
    return results


def saturation_rounds(
    server: ServerProcess,
    probe: TextClassifier,
    probe_size: int,
    runner: asyncio.Runner,
    progress: Progress,
    errors: list[int],
) -> list[float]:
    """Ours at the highest concurrency over the ceiling probed right before and after,
    one ratio per round; each round's failed texts appended to `errors`."""
    clients = max(CONCURRENCY)
    progress.step(f"{server.name}: {SATURATION_ROUNDS} alternating saturation rounds")
    ceilings = [forward_rate(probe, probe_size, SATURATION_SECONDS)]
    ratios = []
    for round_number in range(SATURATION_ROUNDS):
        progress.show(f"round {round_number + 1}/{SATURATION_ROUNDS}")
        served = runner.run(drive(server.target, clients, SATURATION_SECONDS, unary_call()))
        errors.append(served["errors"])
        ceilings.append(forward_rate(probe, probe_size, SATURATION_SECONDS))
        ratios.append(served["requests_per_second"] / ((ceilings[-2] + ceilings[-1]) / 2))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="load per concurrency level")
    args = parser.parse_args()
    progress = Progress(STEPS)

    # The ceiling the issue asks for uses the server's own thread count; the
    # all-cores figure is printed beside it so the choice of threads is visible.
    all_cores = torch.get_num_threads()
    progress.step(f"ceiling: in-process forward passes ({all_cores} torch threads)")
    ceiling_all_cores = measure_ceiling(load_bundle(BUNDLE, "cpu").classifier, 2.0)
    threads = cpu_threads_per_worker(cpu_workers=1)
    torch.set_num_threads(threads)
    progress.step(f"ceiling: in-process forward passes ({threads} torch threads)")
    # A fresh load after the thread change, as the server would have it.
    probe = load_bundle(BUNDLE, "cpu").classifier
    ceiling = measure_ceiling(probe, 2.0)
    probe_size = ceiling["best_batch_size"]

    # What the same forward reaches while another process keeps the other core busy:
    # on a 2-core machine a server's own serving work is such a neighbour.
    progress.step("ceiling: with a busy process on the other core")
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        contended = forward_rate(probe, probe_size, 4.0)
    finally:
        neighbour.kill()
        neighbour.wait()

    adjacent = AdjacentCeiling(probe, probe_size, PROBE_SECONDS, reuse_between_levels=False)
    with asyncio.Runner() as runner:
        with start_server(
            "ours", capability_command("--models", "topic-minilm", "--device", "cpu")
        ) as ours_server:
            ours = run_load(ours_server, adjacent, args.seconds, runner, progress)
            round_errors: list[int] = []
            rounds = saturation_rounds(
                ours_server, probe, probe_size, runner, progress, round_errors
            )
        with start_server("naive", naive_command("cpu")) as naive_server:
            naive = run_load(naive_server, adjacent, args.seconds, runner, progress)
    progress.clear()

    top = ceiling["ceiling_texts_per_second"]
    print()
    for label, measured in (
        (f"{threads} thread(s), as served", ceiling),
        (f"{all_cores} threads, all cores", ceiling_all_cores),
    ):
        by_size = measured["texts_per_second_by_batch_size"]
        print(
            f"raw ceiling, {label}: {measured['ceiling_texts_per_second']:.0f} texts/s at batch "
            f"{measured['best_batch_size']} (by batch size: "
            + ", ".join(f"{b}: {t:.0f}" for b, t in by_size.items())
            + ")"
        )
    saturated = max(ours[c]["requests_per_second"] for c in CONCURRENCY)
    best_ratio = max(ours[c]["ratio_to_ceiling"] for c in CONCURRENCY)
    print(
        f"raw ceiling at batch {ceiling['best_batch_size']} with a busy process on the other "
        f"core: {contended:.0f} texts/s ({contended / top:.2f} of the ceiling alone)"
    )
    print(
        f"saturation, {SATURATION_ROUNDS} alternating rounds of {SATURATION_SECONDS:.0f} s at "
        f"{max(CONCURRENCY)} clients: ours / ceiling = median {statistics.median(rounds):.2f} "
        f"(rounds: {', '.join(f'{r:.2f}' for r in rounds)})"
    )
    print(
        f"at saturation ours = {best_ratio:.2f} of the adjacent ceiling (batch {probe_size}, "
        f"measured around each level), {saturated / top:.2f} of the up-front served-threads "
        f"ceiling, {saturated / ceiling_all_cores['ceiling_texts_per_second']:.2f} of the "
        "all-cores ceiling"
    )
    print(
        f"{'clients':>7} | {'ours req/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'/adj ceil':>9} "
        f"{'others':>6} | {'naive req/s':>11} {'p50 ms':>7} {'p99 ms':>7} {'/adj ceil':>9} "
        f"{'others':>6} | {'ours/naive':>10}"
    )
    for c in CONCURRENCY:
        o, n = ours[c], naive[c]
        print(
            f"{c:>7} | {o['requests_per_second']:>10.0f} {o['p50_ms']:>7.1f} {o['p99_ms']:>7.1f} "
            f"{o['requests_per_second'] / o['adjacent_ceiling']:>9.2f} "
            f"{o['other_processes_cores']:>6.2f} | {n['requests_per_second']:>11.0f} "
            f"{n['p50_ms']:>7.1f} {n['p99_ms']:>7.1f} "
            f"{n['requests_per_second'] / n['adjacent_ceiling']:>9.2f} "
            f"{n['other_processes_cores']:>6.2f} | "
            f"{o['requests_per_second'] / (n['requests_per_second'] or math.nan):>10.2f}"
        )
    print(
        "/adj ceil: throughput over the ceiling probed right before and after that level; "
        "others: cores used by processes other than the server and this client meanwhile"
    )
    print(
        "ours, share of time the device computed / mean batch: "
        + ", ".join(
            f"{c} clients {ours[c]['device_busy']:.2f} / {ours[c]['mean_batch']:.1f}"
            for c in CONCURRENCY
        )
    )
    errors = sum(r["errors"] for r in (*ours.values(), *naive.values())) + sum(round_errors)
    print(f"errors: {errors} (saturation rounds: {sum(round_errors)})")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": {
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "torch_threads": threads,
                    "torch": torch.__version__,
                },
                "ceiling": ceiling,
                "ceiling_all_cores": ceiling_all_cores,
                "ceiling_with_busy_neighbour_texts_per_second": contended,
                "saturation_rounds_ours_over_ceiling": rounds,
                "saturation_rounds_errors": round_errors,
                "ours": ours,
                "naive": naive,
            },
            indent=2,
        )
    )
    print(f"results: {RESULTS.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()

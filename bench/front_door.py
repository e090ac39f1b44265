"""`make bench-front-door`: what users call, orchestrator + capability, against the ceiling.

The stack is started as `make run` starts it (tools/run_stack.py): both servers with
their default flags, an API keys file, the internal token and routes.yaml; only
the ports differ (free ones), and the key's tenant has no rate limit. Measured in
one run, each load level between two probes of the in-process ceiling (the same
encoder and texts, all cores, the best batch size), so every ratio compares like
with like in time on this shared host:

1. front door, unary Classify under 1, 8, 32 and 128 closed-loop clients;
2. front door, ClassifyBatch of 64 texts per call under 1 and 4 clients (reported
   as not available when the orchestrator answers UNIMPLEMENTED);
3. serving overhead: the same against `topic-static`, whose forward costs almost
   nothing (routes.yaml sends the `model: topic-static` hint there), so what
   remains is the serving path's own CPU per request; 64 clients as well;
4. the capability server alone (`python -m capability`, no orchestrator);
5. the naive one-request-one-forward server (bench/naive_server.py).

Every level reports requests/s and texts/s, p50 and p99 per call, errors, the
ratio to its adjacent ceiling, and the CPU microseconds per text (per request, for
single calls) that each server process, the client and everything else spent,
from /proc/<pid>/stat. The one-client level is also compared with one forward of
one text on all cores.

Prints two tables (markdown), writes build/bench/front_door.json and a plot of
throughput against p99 per system, build/bench/front_door.png.

    python bench/front_door.py [--device cpu|cuda] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.harness import (  # noqa: E402
    BATCH_SIZES,
    MODEL_ROOT,
    NOISY_CEILING_SPREAD,
    NOISY_OTHER_CORES,
    RESULTS_DIR,
    AdjacentCeiling,
    Observation,
    Progress,
    SendCall,
    ServerProcess,
    batch_call,
    capability_command,
    forward_latency,
    measure_ceiling,
    measure_level,
    naive_command,
    orchestrator_command,
    start_server,
    unary_call,
)
from capability.bundle import load_bundle  # noqa: E402
from capability.metrics import BATCH_SIZE, WORKER_BUSY_SECONDS_TOTAL  # noqa: E402
from capability.model import TextClassifier  # noqa: E402
from orchestrator.metrics import MODEL_FALLBACK_TOTAL, UPSTREAM_CALL_ITEMS  # noqa: E402
from orchestrator.security import hash_key, new_key  # noqa: E402

RESULTS = RESULTS_DIR / "front_door.json"
PLOT = RESULTS_DIR / "front_door.png"
# The stack's own files: API keys, internal token, routes with the real port.
STACK_DIR = RESULTS_DIR / "front_door"
ROUTES_TEMPLATE = REPO_ROOT / "routes.yaml"
MODEL = "topic-minilm"
STATIC_MODEL = "topic-static"
CONCURRENCY = (1, 8, 32, 128)
# 64 in flight is where the issue states the serving-overhead target.
STATIC_CONCURRENCY = (1, 8, 32, 64, 128)
BATCH_ITEMS = 64
BATCH_CLIENTS = (1, 4)
STATIC_BATCH_CLIENTS = (4,)
# Seconds of each ceiling probe right before and after a level (the probe after one
# level is the probe before the next while the same servers run).
PROBE_SECONDS = 1.5
# Seconds of forward passes per batch size in the up-front ceiling sweep.
SWEEP_SECONDS_PER_SIZE = 1.6
# On a GPU larger batches pay off; the sweep goes on to them there.
CUDA_BATCH_SIZES = (*BATCH_SIZES, 128, 256)
# The one-client target: p50 at most one forward of one text (all cores) plus this.
ONE_CLIENT_MARGIN_MS = 1.5
# The key's tenant; the keys file gives it no rate limit.
TENANT = "bench"

STEPS = (
    2  # ceiling sweeps
    + 1  # start the stack
    + len(CONCURRENCY)
    + len(BATCH_CLIENTS)
    + len(STATIC_CONCURRENCY)
    + len(STATIC_BATCH_CLIENTS)
    + 1  # start the capability alone
    + len(CONCURRENCY)
    + 1  # start the naive server
    + len(CONCURRENCY)
)

NOISY_MARK = " (noisy)"

FRONT_DOOR = "front door"
FRONT_DOOR_BATCH = f"front door, ClassifyBatch x{BATCH_ITEMS}"
CAPABILITY_ALONE = "capability alone"
NAIVE = "naive"


def write_credentials() -> tuple[str, dict[str, str]]:
    """A fresh API key for a tenant without a rate limit, and the internal token, under
    STACK_DIR; returns the key and the environment that points both servers at them
    (the variables tools/run_stack.py sets)."""
    STACK_DIR.mkdir(parents=True, exist_ok=True)
    key = new_key()
    keys_file, token_file = STACK_DIR / "api-keys.yaml", STACK_DIR / "internal-token"
    keys_file.write_text(
        "# Written by bench/front_door.py: one key, its tenant without a rate limit.\n"
        "keys:\n"
        f"  - id: bench\n    sha256: {hash_key(key)}\n    tenant: {TENANT}\n    role: user\n"
    )
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    for path in (keys_file, token_file):
        path.chmod(0o600)
    return key, {
        "ORCHESTRATOR_API_KEYS_FILE": str(keys_file),
        "ORCHESTRATOR_INTERNAL_TOKEN_FILE": str(token_file),
        "CAPABILITY_INTERNAL_TOKEN_FILE": str(token_file),
    }


def write_routes(capability_target: str) -> Path:
    """routes.yaml as it stands, with every backend pointed at the bench's capability
    server (the repository's file names the `make run` port)."""
    routes = yaml.safe_load(ROUTES_TEMPLATE.read_text())
    for backend in routes["backends"].values():
        backend["targets"] = [capability_target]
    path = STACK_DIR / "routes.yaml"
    path.write_text(yaml.safe_dump(routes, sort_keys=False))
    return path


def add_server_figures(
    result: dict[str, Any], observed: Observation, servers: Mapping[str, ServerProcess]
) -> None:
    """What the servers counted over the level: the capability's mean batch and the
    share of time its device computed; the orchestrator's texts per upstream call
    and answers that came from a fallback."""
    if "capability" in servers:
        batches = observed.delta("capability", f"{BATCH_SIZE}_count")
        texts = observed.delta("capability", f"{BATCH_SIZE}_sum")
        busy = observed.delta("capability", WORKER_BUSY_SECONDS_TOTAL)
        result["mean_batch"] = texts / batches if batches > 0 else float("nan")
        result["device_busy"] = busy / result["seconds"]
    if "orchestrator" in servers:
        calls = observed.delta("orchestrator", f"{UPSTREAM_CALL_ITEMS}_count")
        items = observed.delta("orchestrator", f"{UPSTREAM_CALL_ITEMS}_sum")
        result["upstream_calls"] = calls
        result["texts_per_upstream_call"] = items / calls if calls > 0 else float("nan")
        result["fallbacks"] = observed.delta("orchestrator", MODEL_FALLBACK_TOTAL)


def run_levels(
    system: str,
    model: str,
    concurrency: Sequence[int],
    send: SendCall,
    *,
    servers: Mapping[str, ServerProcess],
    target: ServerProcess,
    ceiling: AdjacentCeiling,
    seconds: float,
    runner: asyncio.Runner,
    progress: Progress,
    items_per_call: int = 1,
) -> list[dict[str, Any]]:
    """One level per concurrency. A call the server cannot take (UNIMPLEMENTED, say)
    ends the sweep with one level marked not available."""
    levels: list[dict[str, Any]] = []
    for clients in concurrency:
        progress.step(f"{system}, {model}: {clients} clients")
        level: dict[str, Any] = {"system": system, "model": model, "concurrency": clients}
        try:
            result, observed = measure_level(
                target.target,
                clients,
                seconds,
                send,
                runner=runner,
                ceiling=ceiling,
                servers=servers,
                items_per_call=items_per_call,
                progress=progress,
            )
        except grpc.aio.AioRpcError as refused:
            # The warm-up call was refused: this server does not offer the call.
            level["available"] = False
            level["refused"] = f"{refused.code().name}: {refused.details()}"
            levels.append(level)
            progress.skip(len(concurrency) - len(levels))
            return levels
        add_server_figures(result, observed, servers)
        levels.append({**level, "available": True, **result})
    return levels


def bs1_forward_ms(classifier: TextClassifier) -> dict[str, float]:
    """Median milliseconds of one forward of one text in this process: on all cores (the
    issue's reference), and on one thread, as the capability serves on 2 cores."""
    all_cores = forward_latency(classifier, 1.0) * 1000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = forward_latency(classifier, 0.5) * 1000
    finally:
        torch.set_num_threads(threads)
    return {"all_cores": all_cores, "one_thread": one_thread}


def sweep_ceiling(classifier: TextClassifier, device: str) -> dict[str, Any]:
    sizes = CUDA_BATCH_SIZES if device.startswith("cuda") else BATCH_SIZES
    return measure_ceiling(classifier, SWEEP_SECONDS_PER_SIZE, batch_sizes=sizes)


class FrontDoorBench:
    """The run's shared state: the probes, the client's event loop, the progress line,
    and the levels measured so far."""

    def __init__(self, device: str, seconds: float, runner: asyncio.Runner) -> None:
        self.device = device
        self.seconds = seconds
        self.runner = runner
        self.progress = Progress(STEPS)
        self.levels: list[dict[str, Any]] = []
        self.forward_ms: dict[str, list[dict[str, float]]] = {MODEL: [], STATIC_MODEL: []}
        self.ceilings: dict[str, dict[str, Any]] = {}
        self.classifiers: dict[str, TextClassifier] = {}
        self.probes: dict[str, AdjacentCeiling] = {}

    def measure_ceilings(self) -> None:
        """The up-front sweep per model (this process's torch threads: all cores), which
        picks the batch size every adjacent probe then uses."""
        for model, probe_seconds in ((MODEL, PROBE_SECONDS), (STATIC_MODEL, PROBE_SECONDS / 3)):
            self.progress.step(
                f"ceiling: {model} in-process forward passes "
                f"({torch.get_num_threads()} threads, {self.device})"
            )
            classifier = load_bundle(MODEL_ROOT / model / "1", self.device).classifier
            self.classifiers[model] = classifier
            self.ceilings[model] = sweep_ceiling(classifier, self.device)
            self.probes[model] = AdjacentCeiling(
                classifier,
                self.ceilings[model]["best_batch_size"],
                probe_seconds,
                reuse_between_levels=True,
            )

    def run(
        self,
        system: str,
        model: str,
        concurrency: Sequence[int],
        send: SendCall,
        servers: Mapping[str, ServerProcess],
        target: ServerProcess,
        items_per_call: int = 1,
    ) -> None:
        self.levels += run_levels(
            system,
            model,
            concurrency,
            send,
            servers=servers,
            target=target,
            ceiling=self.probes[model],
            seconds=self.seconds,
            runner=self.runner,
            progress=self.progress,
            items_per_call=items_per_call,
        )

    def measure_front_door(self) -> None:
        """Orchestrator + capability as `make run` starts them, with a key that has no
        rate limit: unary and ClassifyBatch, topic-minilm and then topic-static."""
        key, environment = write_credentials()
        metadata = (("authorization", f"Bearer {key}"),)
        self.progress.step("starting orchestrator + capability (loading the models)")
        with start_server(
            "front_door-capability", capability_command("--device", self.device), environment
        ) as capability:
            routes = write_routes(capability.target)
            with start_server(
                "front_door-orchestrator",
                orchestrator_command("--routes-file", str(routes)),
                environment,
            ) as orchestrator:
                stack = {"orchestrator": orchestrator, "capability": capability}
                for model, concurrency, batch_clients in (
                    (MODEL, CONCURRENCY, BATCH_CLIENTS),
                    (STATIC_MODEL, STATIC_CONCURRENCY, STATIC_BATCH_CLIENTS),
                ):
                    # routes.yaml's static-hint route takes the topic-static hint; the
                    # default route sends calls without a hint to topic-minilm.
                    hint = model if model == STATIC_MODEL else ""
                    unary = unary_call(hint, metadata)
                    # One client, between two forwards of one text in this process.
                    self.probes[model].forget()
                    self.forward_ms[model].append(bs1_forward_ms(self.classifiers[model]))
                    self.run(FRONT_DOOR, model, concurrency[:1], unary, stack, orchestrator)
                    self.forward_ms[model].append(bs1_forward_ms(self.classifiers[model]))
                    self.probes[model].forget()
                    self.run(FRONT_DOOR, model, concurrency[1:], unary, stack, orchestrator)
                    batch = batch_call(BATCH_ITEMS, hint, metadata)
                    self.run(
                        FRONT_DOOR_BATCH,
                        model,
                        batch_clients,
                        batch,
                        stack,
                        orchestrator,
                        BATCH_ITEMS,
                    )

    def measure_alone(self, system: str, name: str, command: Sequence[str]) -> None:
        """A single server (the capability alone, or the naive one) under unary load."""
        self.probes[MODEL].forget()
        self.progress.step(f"starting {system} (loading the models)")
        with start_server(f"front_door-{name}", command) as server:
            self.run(system, MODEL, CONCURRENCY, unary_call(), {name: server}, server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda: the capability's device")
    parser.add_argument("--seconds", type=float, default=5.0, help="load per level")
    args = parser.parse_args()
    started = time.perf_counter()
    with asyncio.Runner() as runner:
        bench = FrontDoorBench(args.device, args.seconds, runner)
        bench.measure_ceilings()
        bench.measure_front_door()
        bench.measure_alone(
            CAPABILITY_ALONE, "capability", capability_command("--device", args.device)
        )
        bench.measure_alone(NAIVE, "naive", naive_command(args.device))
        bench.progress.clear()

    duration = time.perf_counter() - started
    forward_all_cores = {
        model: [figures["all_cores"] for figures in measured]
        for model, measured in bench.forward_ms.items()
    }
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "ceiling_torch_threads": torch.get_num_threads(),
            "device": args.device,
            "cuda_device": torch.cuda.get_device_name(0)
            if args.device.startswith("cuda")
            else None,
        },
        "seconds_per_level": args.seconds,
        "ceiling": bench.ceilings,
        "one_forward_batch_1_ms": {
            model: {
                "before_and_after_one_client": measured,
                "all_cores_mean": statistics.mean(forward_all_cores[model]),
                "one_thread_mean": statistics.mean(m["one_thread"] for m in measured),
            }
            for model, measured in bench.forward_ms.items()
        },
        "levels": bench.levels,
        "targets": targets(bench.levels, forward_all_cores),
        "duration_seconds": duration,
    }
    print_report(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json_text(report))
    plot(report, PLOT)
    print(f"\nresults: {RESULTS.relative_to(REPO_ROOT)}, plot: {PLOT.relative_to(REPO_ROOT)}")
    print(f"took {duration:.0f} s")


def find(levels: Sequence[dict[str, Any]], system: str, model: str, clients: int) -> dict[str, Any]:
    for level in levels:
        if (level["system"], level["model"], level["concurrency"]) == (system, model, clients):
            return level
    return {"available": False}


def targets(
    levels: Sequence[dict[str, Any]], forward_ms: Mapping[str, list[float]]
) -> dict[str, Any]:
    """The issue's targets beside this run's figures (a benchmark, not a test)."""
    one = find(levels, FRONT_DOOR, MODEL, 1)
    forward = sum(forward_ms[MODEL]) / len(forward_ms[MODEL])
    static_64 = find(levels, FRONT_DOOR, STATIC_MODEL, 64)
    batch = find(levels, FRONT_DOOR_BATCH, MODEL, max(BATCH_CLIENTS))
    nan = float("nan")
    serving_us = (
        static_64["cpu_us_per_text"]["orchestrator"] + static_64["cpu_us_per_text"]["capability"]
        if static_64.get("available")
        else nan
    )
    return {
        "one_client_p50_ms": one.get("p50_ms", nan),
        "one_client_p50_limit_ms": forward + ONE_CLIENT_MARGIN_MS,
        "unary_32_ratio": find(levels, FRONT_DOOR, MODEL, 32).get("ratio_to_ceiling", nan),
        "unary_32_ratio_target": 0.85,
        "unary_128_ratio": find(levels, FRONT_DOOR, MODEL, 128).get("ratio_to_ceiling", nan),
        "unary_128_ratio_target": 0.90,
        "front_door_errors": sum(
            level.get("errors", 0) for level in levels if level["system"] != NAIVE
        ),
        "batch_ratio": batch.get("ratio_to_ceiling", nan),
        "batch_ratio_target": 0.95,
        "static_64_servers_cpu_us_per_request": serving_us,
        "static_64_servers_cpu_us_target": 750.0,
        "static_64_requests_per_second": static_64.get("requests_per_second", nan),
    }


def json_text(report: Mapping[str, Any]) -> str:
    """JSON with NaN written as null, so strict parsers read it."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(report), indent=2)


def cell(value: float, digits: int = 0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def print_report(report: Mapping[str, Any]) -> None:
    levels: list[dict[str, Any]] = report["levels"]
    machine = report["machine"]
    for model in (MODEL, STATIC_MODEL):
        measured = report["ceiling"][model]
        print(
            f"ceiling, {model}: {measured['ceiling_texts_per_second']:,.0f} texts/s at batch "
            f"{measured['best_batch_size']} ({machine['ceiling_torch_threads']} torch threads, "
            f"{machine['device']}); by batch size: "
            + ", ".join(
                f"{b}: {t:,.0f}" for b, t in measured["texts_per_second_by_batch_size"].items()
            )
        )
    print(
        f"\nThroughput ({report['seconds_per_level']:.0f} s per level; req/s counts calls, "
        "a ClassifyBatch call carries 64 texts; / adj. ceiling: texts/s over the in-process "
        "ceiling probed right before and after the level)\n"
    )
    print(
        "| system | model | clients | req/s | texts/s | p50 ms | p99 ms | errors "
        "| / adj. ceiling | adj. ceiling texts/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        head = f"| {level['system']} | {level['model']} | {level['concurrency']} |"
        if not level.get("available"):
            print(f"{head} not available: {level.get('refused', '')} | | | | | | |")
            continue
        print(
            f"{head} {cell(level['requests_per_second'])} | {cell(level['texts_per_second'])} "
            f"| {cell(level['p50_ms'], 1)} | {cell(level['p99_ms'], 1)} | {level['errors']} "
            f"| {cell(level['ratio_to_ceiling'], 2)}{NOISY_MARK if level.get('noisy') else ''} "
            f"| {cell(level['adjacent_ceiling'])} |"
        )
    if any(level.get("noisy") for level in levels):
        print(
            f"\n{NOISY_MARK} noisy: other processes used more than {NOISY_OTHER_CORES} cores "
            f"during the level, or its two ceiling probes differ by more than "
            f"{NOISY_CEILING_SPREAD:.0%}; the all-cores ceiling suffers most from a neighbour "
            "on 2 cores, so read that ratio with care"
        )
    print(
        "\nCPU per request (per text for ClassifyBatch), microseconds, from /proc/<pid>/stat "
        "over the level; others: cores that other processes used meanwhile\n"
    )
    print(
        "| system | model | clients | orchestrator µs | capability µs | servers µs | client µs "
        "| others cores | mean batch | texts per upstream call |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        if not level.get("available"):
            continue
        cpu = level["cpu_us_per_text"]
        server_names = [name for name in cpu if name not in ("client", "others")]
        print(
            f"| {level['system']} | {level['model']} | {level['concurrency']} "
            f"| {cell(cpu.get('orchestrator', math.nan))} "
            f"| {cell(cpu.get('capability', cpu.get('naive', math.nan)))} "
            f"| {cell(sum(cpu[name] for name in server_names))} | {cell(cpu['client'])} "
            f"| {cell(level['other_processes_cores'], 2)} "
            f"| {cell(level.get('mean_batch', math.nan), 1)} "
            f"| {cell(level.get('texts_per_upstream_call', math.nan), 1)} |"
        )
    fallbacks = sum(level.get("fallbacks", 0) for level in levels)
    if fallbacks:
        print(f"\nNOTE: {fallbacks:.0f} front-door answers came from a fallback backend")
    for level in levels:
        if level.get("first_error"):
            print(
                f"NOTE: {level['system']}, {level['model']}, {level['concurrency']} clients: "
                f"{level['errors']} texts failed; first: {level['first_error']}"
            )

    goal = report["targets"]
    forward = report["one_forward_batch_1_ms"][MODEL]
    print("\nAgainst the issue's targets (benchmark figures from this one run):")
    print(
        f"- one client: p50 {cell(goal['one_client_p50_ms'], 1)} ms; one forward of one text "
        f"(all cores) {forward['all_cores_mean']:.1f} ms + {ONE_CLIENT_MARGIN_MS} ms = "
        f"{goal['one_client_p50_limit_ms']:.1f} ms (one thread, as served here: "
        f"{forward['one_thread_mean']:.1f} ms)"
    )
    print(
        f"- unary / adjacent ceiling: {cell(goal['unary_32_ratio'], 2)} at 32 clients "
        f"(target 0.85), {cell(goal['unary_128_ratio'], 2)} at 128 (target 0.90); "
        f"front-door errors {goal['front_door_errors']}"
    )
    print(
        f"- ClassifyBatch x{BATCH_ITEMS} at {max(BATCH_CLIENTS)} clients / adjacent ceiling: "
        f"{cell(goal['batch_ratio'], 2)} (target 0.95)"
    )
    print(
        f"- serving overhead ({STATIC_MODEL}, 64 clients): orchestrator + capability "
        f"{cell(goal['static_64_servers_cpu_us_per_request'])} µs of CPU per request "
        f"(target 750), {cell(goal['static_64_requests_per_second'])} req/s"
    )


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Throughput against p99 per system: topic-minilm on the left, the serving
    overhead (topic-static) on the right, each with the in-process ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels: list[dict[str, Any]] = report["levels"]
    figure, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    panels = (
        (axes[0], MODEL, (FRONT_DOOR, FRONT_DOOR_BATCH, CAPABILITY_ALONE, NAIVE)),
        (axes[1], STATIC_MODEL, (FRONT_DOOR, FRONT_DOOR_BATCH)),
    )
    for axis, model, systems in panels:
        for system in systems:
            points = [
                level
                for level in levels
                if level["system"] == system and level["model"] == model and level.get("available")
            ]
            if not points:
                continue
            x = [level["texts_per_second"] for level in points]
            y = [level["p99_ms"] for level in points]
            (line,) = axis.plot(x, y, marker="o", label=system)
            for level in points:
                axis.annotate(
                    str(level["concurrency"]),
                    (level["texts_per_second"], level["p99_ms"]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                    color=line.get_color(),
                )
        measured = report["ceiling"][model]["texts_per_second_by_batch_size"]
        sizes = sorted(int(size) for size in measured)
        rates = [measured[size] for size in sizes]
        # A batch's latency in the ceiling loop is its size over the rate.
        axis.plot(
            rates,
            [size / rate * 1000 for size, rate in zip(sizes, rates, strict=True)],
            linestyle="--",
            color="black",
            marker=".",
            label="ceiling (in-process; numbers: batch size; latency: one batch)",
        )
        for size, rate in zip(sizes, rates, strict=True):
            axis.annotate(
                f"b{size}",
                (rate, size / rate * 1000),
                textcoords="offset points",
                xytext=(4, -10),
                fontsize=7,
            )
        axis.set_yscale("log")
        if model == STATIC_MODEL:
            axis.set_xscale("log")
        axis.set_xlabel("texts per second")
        axis.set_ylabel("p99 latency per call, ms (log)")
        axis.set_title(f"{model}" + (" (serving overhead)" if model == STATIC_MODEL else ""))
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    machine = report["machine"]
    figure.suptitle(
        f"Throughput against p99 (numbers: concurrent clients); {machine['cpus']} CPUs, "
        f"capability on {machine['device']}"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()

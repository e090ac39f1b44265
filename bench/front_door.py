"""`make bench-front-door`: what users call, orchestrator + capability, against the ceiling.

The stack is started as `make run` starts it (tools/run_stack.py): both servers with
their default flags, an API keys file, the internal token and routes.yaml; only
the ports differ (free ones), the key's tenant has no rate limit, and the
capability's result cache is off (the bench repeats a few texts: with it on, the
figures would be the cache's). Measured in
one run, each load level between two probes of the in-process ceiling (the same
encoder and texts, all cores, the best batch size), so every ratio compares like
with like in time on this shared host:

1. front door, unary Classify under 1, 8, 32 and 128 closed-loop clients;
2. front door, ClassifyBatch of 64 texts per call under 1 and 4 clients (reported
   as not available when the orchestrator answers UNIMPLEMENTED);
3. serving overhead: the same against `topic-static`, whose forward costs almost
   nothing (routes.yaml sends the `model: topic-static` hint there), so what
   remains is the serving path's own CPU per request; 64 clients as well;
4. the serving path's floor: two gRPC hops that do nothing else
   (bench/echo_server.py, one passing each call on to the other) at 1 and 64
   clients, right after the stack, so that the one-client latency and the
   serving overhead also read against what bare hops cost in the same minute;
5. the capability server alone (`python -m capability`, no orchestrator);
6. the naive one-request-one-forward server (bench/naive_server.py).

Every level reports requests/s and texts/s, p50 and p99 per call, errors, the
ratio to its adjacent ceiling, and the CPU microseconds per text (per request, for
single calls) that each server process, the client and everything else spent,
from /proc/<pid>/stat. The one-client level is also compared with one forward of
one text on all cores.

Prints two tables (markdown), writes build/bench/front_door.json and a plot of
throughput against p99 per system, build/bench/front_door.png.

    python bench/front_door.py [--device cpu|cuda|cuda:N] [--seconds 5] [--orchestrator-processes 1]
        [--torch-threads N] [--front-door-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
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
    echo_command,
    forward_latency,
    measure_ceiling,
    measure_level,
    naive_command,
    orchestrator_command,
    orchestrator_processes,
    start_server,
    torch_threads,
    unary_call,
)
from capability.bundle import load_bundle  # noqa: E402
from capability.metrics import BATCH_SIZE, WORKER_BUSY_SECONDS_TOTAL  # noqa: E402
from capability.model import TextClassifier  # noqa: E402
from capability.workers.threads import cpu_threads_per_worker  # noqa: E402
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
# The echo hops: one client (the latency floor) and the serving overhead's 64.
ECHO_CONCURRENCY = (1, 64)
# Seconds of each ceiling probe right before and after a level (the probe after one
# level is the probe before the next while the same servers run): all cores, and
# the capability's own threads.
PROBE_SECONDS = 1.2
SERVED_PROBE_SECONDS = 1.0
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
    + 1  # start the echo hops
    + len(ECHO_CONCURRENCY)
    + 1  # start the capability alone
    + len(CONCURRENCY)
    + 1  # start the naive server
    + len(CONCURRENCY)
)

NOISY_MARK = " (noisy)"
SERVED_RATIO = "ratio_to_served_threads_ceiling"

FRONT_DOOR = "front door"
FRONT_DOOR_BATCH = f"front door, ClassifyBatch x{BATCH_ITEMS}"
CAPABILITY_ALONE = "capability alone"
NAIVE = "naive"
ECHO = "two echo hops"
# The echo rows' model column: they run none.
NO_MODEL = "none"
# The echo hops' processes, reported in the orchestrator's and the capability's columns.
ECHO_FRONT = "echo front"
ECHO_BACK = "echo back"


def write_credentials(directory: Path | None = None) -> tuple[str, dict[str, str]]:
    """A fresh API key for a tenant without a rate limit, and the internal token, under
    `directory` (default STACK_DIR); returns the key and the environment that points
    both servers at them (the variables tools/run_stack.py sets)."""
    directory = directory or STACK_DIR
    directory.mkdir(parents=True, exist_ok=True)
    key = new_key()
    keys_file, token_file = directory / "api-keys.yaml", directory / "internal-token"
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


def write_routes(
    capability_target: str,
    directory: Path | None = None,
    first_routes: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """routes.yaml as it stands, with every backend pointed at the bench's capability
    server (the repository's file names the `make run` port), and `first_routes` put
    before its own; written under `directory` (default STACK_DIR)."""
    routes = yaml.safe_load(ROUTES_TEMPLATE.read_text())
    for backend in routes["backends"].values():
        backend["targets"] = [capability_target]
    routes["routes"] = [*first_routes, *routes["routes"]]
    path = (directory or STACK_DIR) / "routes.yaml"
    path.write_text(yaml.safe_dump(routes, sort_keys=False))
    return path


def add_server_figures(
    result: dict[str, Any], observed: Observation, servers: Mapping[str, ServerProcess]
) -> None:
    """What the servers counted over the level: the capability's mean batch and the
    seconds its workers computed per second (`device_busy`: summed over the workers,
    so up to one per device); the orchestrator's texts per upstream call and answers
    that came from a fallback."""
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


def bs1_forward_ms(classifier: TextClassifier, served_threads: int) -> dict[str, float]:
    """Median milliseconds of one forward of one text in this process: on all cores (the
    issue's reference), and with the capability's own torch threads."""
    all_cores = forward_latency(classifier, 1.0) * 1000
    with torch_threads(served_threads):
        served = forward_latency(classifier, 0.5) * 1000
    return {"all_cores": all_cores, "served_threads": served}


def sweep_ceiling(
    classifier: TextClassifier, device: str, share_of_time: float = 1.0
) -> dict[str, Any]:
    sizes = CUDA_BATCH_SIZES if device.startswith("cuda") else BATCH_SIZES
    seconds = SWEEP_SECONDS_PER_SIZE * share_of_time
    return measure_ceiling(classifier, seconds, batch_sizes=sizes)


class FrontDoorBench:
    """The run's shared state: the probes, the client's event loop, the progress line,
    and the levels measured so far."""

    def __init__(self, device: str, seconds: float, runner: asyncio.Runner) -> None:
        self.device = device
        self.seconds = seconds
        self.runner = runner
        # The orchestrator's --processes (more than 1: with a Redis for their state).
        self.orchestrator_processes = 1
        self.progress = Progress(STEPS)
        self.levels: list[dict[str, Any]] = []
        self.forward_ms: dict[str, list[dict[str, float]]] = {MODEL: [], STATIC_MODEL: []}
        self.classifiers: dict[str, TextClassifier] = {}
        # The all-cores ceilings (the reference), per model.
        self.ceilings: dict[str, dict[str, Any]] = {}
        self.probes: dict[str, AdjacentCeiling] = {}
        # On the CPU, topic-minilm's ceiling with the capability's own torch threads too,
        # where they are fewer than all cores (`--torch-threads N`, or several CPU
        # workers): a neighbour on the other core spoils it far less.
        # All the cores the capability's worker uses by default (every logical CPU):
        # torch's own default is the physical cores, half of them with hyperthreads.
        self.all_cores = cpu_threads_per_worker(cpu_workers=1)
        torch.set_num_threads(self.all_cores)
        # The capability's --torch-threads (0: all cores), set from the command line.
        self.torch_threads = 0
        self.served_threads = self.all_cores
        self.served_ceilings: dict[str, dict[str, Any]] = {}
        self.served_probes: dict[str, AdjacentCeiling] = {}

    def measure_ceilings(self) -> None:
        """The up-front sweep per model, which picks the batch size every adjacent probe
        then uses: on all cores, and for topic-minilm on the CPU with the served threads."""
        for model, probe_seconds in ((MODEL, PROBE_SECONDS), (STATIC_MODEL, PROBE_SECONDS / 3)):
            self.progress.step(
                f"ceiling: {model} in-process forward passes ({self.all_cores} threads, "
                f"{self.device})"
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
            if model == MODEL and self.device == "cpu" and self.served_threads < self.all_cores:
                with torch_threads(self.served_threads):
                    self.served_ceilings[model] = sweep_ceiling(classifier, self.device, 0.5)
                self.served_probes[model] = AdjacentCeiling(
                    classifier,
                    self.served_ceilings[model]["best_batch_size"],
                    SERVED_PROBE_SECONDS,
                    reuse_between_levels=True,
                    threads=self.served_threads,
                )

    def capability_command(self) -> list[str]:
        """`python -m capability` on the bench's device, with its --torch-threads if set."""
        threads = ("--torch-threads", str(self.torch_threads)) if self.torch_threads else ()
        return capability_command("--device", self.device, *threads)

    def forget_probes(self) -> None:
        """The next level probes its ceilings afresh (something else ran since the last)."""
        for probe in (*self.probes.values(), *self.served_probes.values()):
            probe.forget()

    def run(
        self,
        system: str,
        model: str,
        concurrency: Sequence[int],
        send: SendCall,
        servers: Mapping[str, ServerProcess],
        target: ServerProcess,
        ceiling_model: str | None = None,
        items_per_call: int = 1,
    ) -> None:
        """One level per concurrency, between probes of `ceiling_model`'s ceiling
        (`model`'s by default). A call the server does not offer (UNIMPLEMENTED) ends
        the sweep with one level marked not available."""
        probed = ceiling_model or model
        for done, clients in enumerate(concurrency):
            self.progress.step(f"{system}, {model}: {clients} clients")
            level: dict[str, Any] = {"system": system, "model": model, "concurrency": clients}
            try:
                result, observed = measure_level(
                    target.target,
                    clients,
                    self.seconds,
                    send,
                    runner=self.runner,
                    ceiling=self.probes[probed],
                    served_ceiling=self.served_probes.get(probed),
                    servers=servers,
                    items_per_call=items_per_call,
                    progress=self.progress,
                )
            except grpc.aio.AioRpcError as refused:
                self.levels.append(
                    {
                        **level,
                        "available": False,
                        "refused": f"{refused.code().name}: {refused.details()}",
                    }
                )
                self.progress.skip(len(concurrency) - done - 1)
                return
            add_server_figures(result, observed, servers)
            self.levels.append({**level, "available": True, **result})

    def measure_front_door(self) -> None:
        """Orchestrator + capability as `make run` starts them, with a key that has no
        rate limit: unary and ClassifyBatch, topic-minilm and then topic-static."""
        key, environment = write_credentials()
        metadata = (("authorization", f"Bearer {key}"),)
        self.progress.step("starting orchestrator + capability (loading the models)")
        with start_server(
            "front_door-capability", self.capability_command(), environment
        ) as capability:
            routes = write_routes(capability.target)
            with (
                orchestrator_processes(self.orchestrator_processes) as processes_flags,
                start_server(
                    "front_door-orchestrator",
                    orchestrator_command("--routes-file", str(routes), *processes_flags),
                    environment,
                ) as orchestrator,
            ):
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
                    self.forget_probes()
                    self.forward_ms[model].append(
                        bs1_forward_ms(self.classifiers[model], self.served_threads)
                    )
                    self.run(FRONT_DOOR, model, concurrency[:1], unary, stack, orchestrator)
                    self.forward_ms[model].append(
                        bs1_forward_ms(self.classifiers[model], self.served_threads)
                    )
                    self.forget_probes()
                    self.run(FRONT_DOOR, model, concurrency[1:], unary, stack, orchestrator)
                    batch = batch_call(BATCH_ITEMS, hint, metadata)
                    self.run(
                        FRONT_DOOR_BATCH,
                        model,
                        batch_clients,
                        batch,
                        stack,
                        orchestrator,
                        items_per_call=BATCH_ITEMS,
                    )

    def measure_echo(self) -> None:
        """Two echo hops, the front one passing each call on to the back one: what gRPC
        alone costs per request on this machine now (the ceiling probed beside them is
        topic-static's, which costs next to nothing)."""
        self.forget_probes()
        self.progress.step("starting the two echo hops")
        with (
            start_server("front_door-echo-back", echo_command()) as back,
            start_server("front_door-echo-front", echo_command(back.target)) as front,
        ):
            hops = {ECHO_FRONT: front, ECHO_BACK: back}
            send = unary_call()
            self.run(ECHO, NO_MODEL, ECHO_CONCURRENCY, send, hops, front, STATIC_MODEL)

    def measure_alone(self, system: str, name: str, command: Sequence[str]) -> None:
        """A single server (the capability alone, or the naive one) under unary load."""
        self.forget_probes()
        self.progress.step(f"starting {system} (loading the models)")
        with start_server(f"front_door-{name}", command) as server:
            self.run(system, MODEL, CONCURRENCY, unary_call(), {name: server}, server)


def bench_device(text: str) -> str:
    """The device the bench measures on, as the capability's --device takes it: `cuda`
    is cuda:0, where the in-process ceiling runs (the capability refuses a bare `cuda`,
    and `make gpu-check`'s sweep failed on every GPU machine for it)."""
    if text == "cuda":
        return "cuda:0"
    if text == "cpu" or re.fullmatch(r"cuda:(0|[1-9][0-9]*)", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        type=bench_device,
        default="cpu",
        help="cpu, cuda (cuda:0) or cuda:N: the device of the capability and the ceiling",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="load per level")
    parser.add_argument(
        "--orchestrator-processes", type=int, default=1, help="its --processes (>1: with Redis)"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="the capability's --torch-threads (0: all cores); fewer adds a ceiling with as many",
    )
    parser.add_argument(
        "--front-door-only",
        action="store_true",
        help="skip the capability server alone and the naive server (not the echo hops)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    with asyncio.Runner() as runner:
        bench = FrontDoorBench(args.device, args.seconds, runner)
        bench.orchestrator_processes = args.orchestrator_processes
        if args.torch_threads > 0:
            bench.torch_threads = args.torch_threads
            bench.served_threads = cpu_threads_per_worker(1, args.torch_threads)
        bench.measure_ceilings()
        bench.measure_front_door()
        bench.measure_echo()
        if not args.front_door_only:
            bench.measure_alone(CAPABILITY_ALONE, "capability", bench.capability_command())
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
            "ceiling_torch_threads": bench.all_cores,
            "served_torch_threads": bench.served_threads,
            "device": args.device,
            "cuda_device": (
                torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
            ),
        },
        "seconds_per_level": args.seconds,
        "orchestrator_processes": args.orchestrator_processes,
        "ceiling": bench.ceilings,
        "ceiling_served_threads": bench.served_ceilings,
        "one_forward_batch_1_ms": {
            model: {
                "before_and_after_one_client": measured,
                "all_cores_mean": statistics.mean(forward_all_cores[model]),
                "served_threads_mean": statistics.mean(m["served_threads"] for m in measured),
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
    echo_1 = find(levels, ECHO, NO_MODEL, 1)
    echo_64 = find(levels, ECHO, NO_MODEL, 64)
    batch = find(levels, FRONT_DOOR_BATCH, MODEL, max(BATCH_CLIENTS))
    unary_32 = find(levels, FRONT_DOOR, MODEL, 32)
    unary_128 = find(levels, FRONT_DOOR, MODEL, 128)
    nan = float("nan")
    serving_us = (
        static_64["cpu_us_per_text"]["orchestrator"] + static_64["cpu_us_per_text"]["capability"]
        if static_64.get("available")
        else nan
    )
    echo_us = (
        echo_64["cpu_us_per_text"][ECHO_FRONT] + echo_64["cpu_us_per_text"][ECHO_BACK]
        if echo_64.get("available")
        else nan
    )
    figures = {
        "one_client_p50_ms": one.get("p50_ms", nan),
        "one_client_p50_limit_ms": forward + ONE_CLIENT_MARGIN_MS,
        "unary_32_ratio": unary_32.get("ratio_to_ceiling", nan),
        "unary_32_ratio_served_threads": unary_32.get(SERVED_RATIO, nan),
        "unary_32_ratio_target": 0.85,
        "unary_128_ratio": unary_128.get("ratio_to_ceiling", nan),
        "unary_128_ratio_served_threads": unary_128.get(SERVED_RATIO, nan),
        "unary_128_ratio_target": 0.90,
        "front_door_errors": sum(
            level.get("errors", 0)
            for level in levels
            if level["system"] in (FRONT_DOOR, FRONT_DOOR_BATCH)
        ),
        # The other systems' errors, for the notes below the table.
        "other_errors": sum(
            level.get("errors", 0)
            for level in levels
            if level["system"] not in (FRONT_DOOR, FRONT_DOOR_BATCH)
        ),
        "batch_ratio": batch.get("ratio_to_ceiling", nan),
        "batch_ratio_served_threads": batch.get(SERVED_RATIO, nan),
        "batch_ratio_target": 0.95,
        "static_64_servers_cpu_us_per_request": serving_us,
        "static_64_servers_cpu_us_target": 750.0,
        "static_64_requests_per_second": static_64.get("requests_per_second", nan),
        # For scale, not targets: the two echo hops in the same run.
        "echo_1_p50_ms": echo_1.get("p50_ms", nan),
        "echo_64_servers_cpu_us_per_request": echo_us,
        "echo_64_requests_per_second": echo_64.get("requests_per_second", nan),
        "static_64_cpu_over_echo": serving_us / echo_us if echo_us > 0 else nan,
    }
    return {**figures, "met": verdicts(figures)}


def verdicts(figures: Mapping[str, Any]) -> dict[str, bool]:
    """Whether each target is met (a figure not measured, NaN, meets none)."""
    return {
        "one_client_p50": figures["one_client_p50_ms"] <= figures["one_client_p50_limit_ms"],
        "unary_32_ratio": figures["unary_32_ratio"] >= figures["unary_32_ratio_target"],
        "unary_128_ratio": figures["unary_128_ratio"] >= figures["unary_128_ratio_target"],
        "zero_front_door_errors": figures["front_door_errors"] == 0,
        "batch_ratio": figures["batch_ratio"] >= figures["batch_ratio_target"],
        "static_64_servers_cpu_us": (
            figures["static_64_servers_cpu_us_per_request"]
            <= figures["static_64_servers_cpu_us_target"]
        ),
    }


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


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


def print_ceiling(label: str, measured: Mapping[str, Any]) -> None:
    print(
        f"ceiling, {label}: {measured['ceiling_texts_per_second']:,.0f} texts/s at batch "
        f"{measured['best_batch_size']}; by batch size: "
        + ", ".join(f"{b}: {t:,.0f}" for b, t in measured["texts_per_second_by_batch_size"].items())
    )


def print_report(report: Mapping[str, Any]) -> None:
    levels: list[dict[str, Any]] = report["levels"]
    machine = report["machine"]
    device, all_cores = machine["device"], machine["ceiling_torch_threads"]
    served = machine.get("served_torch_threads")
    for model in (MODEL, STATIC_MODEL):
        print_ceiling(f"{model}, {all_cores} torch threads, {device}", report["ceiling"][model])
    for model, measured in report.get("ceiling_served_threads", {}).items():
        print_ceiling(f"{model}, {served} torch thread(s) as the capability serves", measured)
    print(
        f"\nThroughput ({report['seconds_per_level']:.0f} s per level; req/s counts calls, a "
        f"ClassifyBatch call carries {BATCH_ITEMS} texts; / adj. ceiling: texts/s over the "
        f"in-process ceiling probed right before and after the level, on all cores "
        f"({all_cores} threads) and with the capability's {served} thread(s))\n"
    )
    print(
        "| system | model | clients | req/s | texts/s | p50 ms | p99 ms | errors "
        f"| / adj. ceiling, {all_cores} threads | / adj. ceiling, {served} thread(s) "
        "| adj. ceiling texts/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        head = f"| {level['system']} | {level['model']} | {level['concurrency']} |"
        if not level.get("available"):
            print(f"{head} not available: {level.get('refused', '')} | | | | | | | |")
            continue
        print(
            f"{head} {cell(level['requests_per_second'])} | {cell(level['texts_per_second'])} "
            f"| {cell(level['p50_ms'], 1)} | {cell(level['p99_ms'], 1)} | {level['errors']} "
            f"| {cell(level['ratio_to_ceiling'], 2)}{NOISY_MARK if level.get('noisy') else ''} "
            f"| {cell(level.get('ratio_to_served_threads_ceiling', math.nan), 2)} "
            f"| {cell(level['adjacent_ceiling'])} |"
        )
    if any(level.get("noisy") for level in levels):
        print(
            f"\n{NOISY_MARK}: other processes used more than {NOISY_OTHER_CORES} cores during "
            f"the level, or its two all-cores ceiling probes differ by more than "
            f"{NOISY_CEILING_SPREAD:.0%}. On 2 cores a neighbour slows the all-cores forward "
            "several times over (each parallel op waits for the displaced thread), so that "
            "ratio then overstates; the served-threads ratio is the steadier one."
        )
    print(
        "\nCPU per request (per text for ClassifyBatch), microseconds, from /proc/<pid>/stat "
        "over the level; others: cores that other processes used meanwhile\n"
    )
    print(
        "| system | model | clients | orchestrator (echo: front hop) µs "
        "| capability (echo: back hop) µs | servers µs | client µs "
        "| others cores | mean batch | devices busy | texts per upstream call |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        if not level.get("available"):
            continue
        cpu = level["cpu_us_per_text"]
        server_names = [name for name in cpu if name not in ("client", "others")]
        print(
            f"| {level['system']} | {level['model']} | {level['concurrency']} "
            f"| {cell(cpu.get('orchestrator', cpu.get(ECHO_FRONT, math.nan)))} "
            f"| {cell(cpu.get('capability', cpu.get('naive', cpu.get(ECHO_BACK, math.nan))))} "
            f"| {cell(sum(cpu[name] for name in server_names))} | {cell(cpu['client'])} "
            f"| {cell(level['other_processes_cores'], 2)} "
            f"| {cell(level.get('mean_batch', math.nan), 1)} "
            f"| {cell(level.get('device_busy', math.nan), 2)} "
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
    met = goal["met"]
    forward = report["one_forward_batch_1_ms"][MODEL]
    print("\nAgainst the issue's targets (benchmark figures from this one run):")
    print(
        f"- one client: p50 {cell(goal['one_client_p50_ms'], 1)} ms; one forward of one text "
        f"(all cores) {forward['all_cores_mean']:.1f} ms + {ONE_CLIENT_MARGIN_MS} ms = "
        f"{goal['one_client_p50_limit_ms']:.1f} ms: {verdict(met['one_client_p50'])} (with "
        f"the capability's {served} thread(s): {forward['served_threads_mean']:.1f} ms); two "
        f"echo hops alone: p50 {cell(goal['echo_1_p50_ms'], 2)} ms"
    )
    print(
        f"- unary / adjacent ceiling: {cell(goal['unary_32_ratio'], 2)} at 32 clients "
        f"(target 0.85: {verdict(met['unary_32_ratio'])}), "
        f"{cell(goal['unary_128_ratio'], 2)} at 128 (target 0.90: "
        f"{verdict(met['unary_128_ratio'])}); with {served} thread(s): "
        f"{cell(goal['unary_32_ratio_served_threads'], 2)} and "
        f"{cell(goal['unary_128_ratio_served_threads'], 2)}; front-door errors "
        f"{goal['front_door_errors']} (target 0: {verdict(met['zero_front_door_errors'])}; "
        f"the other systems' {goal['other_errors']})"
    )
    print(
        f"- ClassifyBatch x{BATCH_ITEMS} at {max(BATCH_CLIENTS)} clients / adjacent ceiling: "
        f"{cell(goal['batch_ratio'], 2)} (target 0.95: {verdict(met['batch_ratio'])}); "
        f"with {served} thread(s): "
        f"{cell(goal['batch_ratio_served_threads'], 2)}"
    )
    print(
        f"- serving overhead ({STATIC_MODEL}, 64 clients): orchestrator + capability "
        f"{cell(goal['static_64_servers_cpu_us_per_request'])} µs of CPU per request "
        f"(target 750: {verdict(met['static_64_servers_cpu_us'])}), "
        f"{cell(goal['static_64_requests_per_second'])} req/s; for scale, two echo "
        f"hops at 64 clients {cell(goal['echo_64_servers_cpu_us_per_request'])} µs at "
        f"{cell(goal['echo_64_requests_per_second'])} req/s "
        f"({cell(goal['static_64_cpu_over_echo'], 2)}x; not like with like: each echo hop "
        "makes one upstream call per request, the orchestrator merges them)"
    )


def plot_ceiling(axis: Any, by_size: Mapping[Any, float], threads: str, style: str) -> None:
    """The in-process ceiling as a curve: each batch size's rate, and one batch's time
    (its size over the rate), labelled with the size."""
    sizes = sorted(int(size) for size in by_size)
    rates = [by_size[size] if size in by_size else by_size[str(size)] for size in sizes]
    latencies = [size / rate * 1000 for size, rate in zip(sizes, rates, strict=True)]
    axis.plot(
        rates,
        latencies,
        linestyle=style,
        color="black",
        marker=".",
        label=f"ceiling, {threads} (in-process; bN: batch size; latency: one batch)",
    )
    for size, rate, latency in zip(sizes, rates, latencies, strict=True):
        axis.annotate(
            f"b{size}", (rate, latency), textcoords="offset points", xytext=(4, -10), fontsize=7
        )


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Throughput against p99 per system: topic-minilm on the left, the serving
    overhead (topic-static) on the right, each with the in-process ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels: list[dict[str, Any]] = report["levels"]
    figure, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    systems_of_minilm = [(system, MODEL) for system in (FRONT_DOOR, FRONT_DOOR_BATCH)]
    systems_of_minilm += [(CAPABILITY_ALONE, MODEL), (NAIVE, MODEL)]
    # The echo hops beside the serving overhead: the floor under it.
    systems_of_static = [(FRONT_DOOR, STATIC_MODEL), (FRONT_DOOR_BATCH, STATIC_MODEL)]
    systems_of_static.append((ECHO, NO_MODEL))
    panels = ((axes[0], MODEL, systems_of_minilm), (axes[1], STATIC_MODEL, systems_of_static))
    for axis, model, systems in panels:
        for system, level_model in systems:
            points = [
                level
                for level in levels
                if (level["system"], level["model"]) == (system, level_model)
                and level.get("available")
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
        machine = report["machine"]
        curves = [(report["ceiling"][model], f"{machine['ceiling_torch_threads']} threads", "--")]
        if model in report.get("ceiling_served_threads", {}):
            served = report["ceiling_served_threads"][model]
            curves.append((served, f"{machine['served_torch_threads']} thread(s)", ":"))
        for measured, threads, style in curves:
            plot_ceiling(axis, measured["texts_per_second_by_batch_size"], threads, style)
        axis.set_yscale("log")
        if model == STATIC_MODEL:
            axis.set_xscale("log")
        axis.set_xlabel("texts per second")
        axis.set_ylabel("p99 latency per call, ms (log)")
        axis.set_title(f"{model}" + (" (serving overhead)" if model == STATIC_MODEL else ""))
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7, framealpha=0.7)
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

"""`make bench-gate`: a short front-door run that fails on a performance regression.

`make test` runs it after the test suite. The stack starts as `make bench-front-door`
starts it (orchestrator + capability as `make run` serves, on free ports), and
every figure is a ratio to something measured in the same run, right before and
after it, never an absolute time: CI runs on a shared 2-core machine whose speed
drifts by a third within minutes. Two kinds of adjacent ceiling:

- the in-process ceiling (bench/harness.py's AdjacentCeiling: the same encoder
  and texts, no server in the way, on one torch thread) for topic-minilm, where
  the model's forward is most of the work;
- the capability server called directly (no orchestrator) for topic-static,
  whose forward costs almost nothing: what the front door adds is the serving
  path itself, where a per-request delay shows at once.

The checks (the bounds below say what each normally shows on the development
machine, quiet and with other jobs running, and what a planted regression does):

- topic-minilm, 32 clients: texts/s at least MIN_UNARY_RATIO of the adjacent
  ceiling, and p99 at most MAX_P99_BATCHES times the ceiling's batch latency
  (one forward of its best batch size);
- topic-minilm, ClassifyBatch of 64 texts, 1 client: texts/s at least
  MIN_BATCH_RATIO of the adjacent ceiling;
- topic-static, 1 client: front-door p50 at most MAX_STATIC_P50_RATIO times the
  capability's own; 32 clients: front-door texts/s at least MIN_STATIC_RATIO of
  the capability's own;
- shadow traffic at one client: p50 with every call shadowed (to topic-static)
  at most MAX_SHADOW_P50_RATIO times p50 without, the median over alternated
  windows;
- no errors at any level.

A check that fails is measured once more and passes if the second measurement
holds (both are reported): a neighbour's burst on the shared machine should not
fail CI, a real regression fails both times.

Writes build/bench/gate.json, a latency heatmap (each level's calls by latency
bucket) build/bench/gate_heatmap.png and throughput against p99
build/bench/gate_throughput_p99.png. Exits 1 when a check fails.

    python bench/gate.py [--seconds 2.5]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.front_door import cell, json_text, write_credentials, write_routes  # noqa: E402
from bench.harness import (  # noqa: E402
    LATENCY_BUCKETS_MS,
    MODEL_ROOT,
    RESULTS_DIR,
    AdjacentCeiling,
    SendCall,
    ServerProcess,
    batch_call,
    capability_command,
    drive,
    measure_ceiling,
    measure_level,
    orchestrator_command,
    start_server,
    torch_threads,
    unary_call,
)
from capability.bundle import load_bundle  # noqa: E402
from classify_common.context import INTERNAL_TOKEN_HEADER  # noqa: E402

RESULTS = RESULTS_DIR / "gate.json"
HEATMAP = RESULTS_DIR / "gate_heatmap.png"
THROUGHPUT_PLOT = RESULTS_DIR / "gate_throughput_p99.png"
STACK_DIR = RESULTS_DIR / "gate"
MODEL = "topic-minilm"
STATIC_MODEL = "topic-static"
BATCH_ITEMS = 64
# Calls with this header take the gate's shadow route: topic-minilm, every call
# shadowed by topic-static.
SHADOW_HEADER = "x-bench-gate"
SHADOW_ROUTE: Mapping[str, Any] = {
    "name": "gate-shadow",
    "match": {"header": {"name": SHADOW_HEADER, "values": ["shadow"]}},
    "backend": "topic-minilm",
    "shadow": {"backend": "topic-static", "percent": 100},
}
FRONT_DOOR = "front door"
CAPABILITY = "capability direct"

# The bounds. In brackets, the range ten runs on the development machine showed
# while other jobs used up to 1.7 cores, then four runs with `time.sleep(0.002)`
# per request planted in the orchestrator's dispatcher (docs/benchmark.md).
# texts/s over the adjacent one-thread ceiling at 32 clients [0.83-2.34; 0.97-1.37].
MIN_UNARY_RATIO = 0.35
# p99 over one batch of the ceiling's best size, 32 clients [2.4-9.1; 1.8-3.6].
MAX_P99_BATCHES = 30.0
# ClassifyBatch x64 texts/s over the adjacent ceiling [0.90-2.27; 0.64-1.07].
MIN_BATCH_RATIO = 0.5
# topic-static, 1 client: front-door p50 over the capability's own
# [1.86-2.86, once 3.54 first; 3.4-5.8].
MAX_STATIC_P50_RATIO = 3.0
# topic-static, 32 clients: front-door texts/s over the capability's own
# [0.63-1.37; 0.11-0.40]. A blocking 2 ms per request caps the front door near 400/s.
MIN_STATIC_RATIO = 0.45
# p50 at one client, every call shadowed, over p50 without [1.09-1.19; 0.92-1.05]:
# the shadow call's own CPU on the same two cores.
MAX_SHADOW_P50_RATIO = 1.3

# Torch threads of the in-process ceiling. NOTE: one, not all cores: a forward on
# both of 2 cores slows down several times over while any other process runs (each
# parallel op waits for the thread a neighbour displaced), far more than the served
# stack does, so an all-cores ceiling makes the ratios swing with the neighbours.
# One thread takes its share of the CPU as the servers do.
PROBE_THREADS = 1
PROBE_SECONDS = 1.0
# The ceiling sweep: seconds per batch size, and the sizes (the best on CPUs here).
SWEEP_SECONDS_PER_SIZE = 0.8
SWEEP_BATCH_SIZES = (8, 16, 32)
# Alternated one-client windows without and with shadowing, and each one's seconds.
SHADOW_WINDOWS = 5
SHADOW_WINDOW_SECONDS = 1.2


@dataclass(frozen=True)
class Level:
    name: str
    model: str
    clients: int
    send: SendCall
    items_per_call: int = 1


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # the level whose figures it reads
    figure: Callable[[Mapping[str, Any]], float]
    bound: float
    at_least: bool  # True: figure >= bound; False: figure <= bound

    def holds(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound


def batch_latency_ms(ceiling: Mapping[str, Any]) -> float:
    """One forward of the ceiling's best batch size, in milliseconds."""
    return float(ceiling["best_batch_size"] / ceiling["ceiling_texts_per_second"] * 1000)


CHECKS = (
    Check(
        "topic-minilm x32: texts/s / adjacent ceiling",
        "topic-minilm x32",
        lambda level: float(level["ratio_to_ceiling"]),
        MIN_UNARY_RATIO,
        at_least=True,
    ),
    Check(
        "topic-minilm x32: p99 / ceiling batch latency",
        "topic-minilm x32",
        lambda level: float(level["p99_in_ceiling_batches"]),
        MAX_P99_BATCHES,
        at_least=False,
    ),
    Check(
        f"ClassifyBatch x{BATCH_ITEMS}: texts/s / adjacent ceiling",
        f"topic-minilm ClassifyBatch x{BATCH_ITEMS}",
        lambda level: float(level["ratio_to_ceiling"]),
        MIN_BATCH_RATIO,
        at_least=True,
    ),
    Check(
        "topic-static x1: p50 / capability's own",
        "topic-static x1",
        lambda level: float(level["p50_over_capability"]),
        MAX_STATIC_P50_RATIO,
        at_least=False,
    ),
    Check(
        "topic-static x32: texts/s / capability's own",
        "topic-static x32",
        lambda level: float(level["ratio_to_capability"]),
        MIN_STATIC_RATIO,
        at_least=True,
    ),
)


class Gate:
    """The run: the ceiling, the stack, the levels measured, the checks' outcomes."""

    def __init__(self, seconds: float, runner: asyncio.Runner) -> None:
        self.seconds = seconds
        self.runner = runner
        self.ceiling: dict[str, Any] = {}
        self.probe: AdjacentCeiling | None = None
        self.levels: dict[str, dict[str, Any]] = {}
        self.remeasured: dict[str, dict[str, Any]] = {}
        self.shadow_windows: list[dict[str, float]] = []
        # The shadow ratio of a first measurement that failed, before its second.
        self.shadow_first_ratio: float | None = None
        # Texts failed in every measurement, those `levels` no longer holds included
        # (a first measurement done again, the capability's own run before a level,
        # the shadow windows before the last).
        self.errors = 0

    def measure_ceiling(self) -> None:
        print(f"ceiling: {MODEL}, in-process forward passes", flush=True)
        classifier = load_bundle(MODEL_ROOT / MODEL / "1", "cpu").classifier
        with torch_threads(PROBE_THREADS):
            self.ceiling = measure_ceiling(
                classifier, SWEEP_SECONDS_PER_SIZE, passes=2, batch_sizes=SWEEP_BATCH_SIZES
            )
        self.probe = AdjacentCeiling(
            classifier,
            self.ceiling["best_batch_size"],
            PROBE_SECONDS,
            reuse_between_levels=True,
            threads=PROBE_THREADS,
        )

    def run(self) -> None:
        key, environment = write_credentials(STACK_DIR)
        front_door = (("authorization", f"Bearer {key}"),)
        internal = ((INTERNAL_TOKEN_HEADER, (STACK_DIR / "internal-token").read_text().strip()),)
        with start_server("gate-capability", capability_command(), environment) as capability:
            routes = write_routes(capability.target, STACK_DIR, first_routes=[SHADOW_ROUTE])
            with start_server(
                "gate-orchestrator", orchestrator_command("--routes-file", str(routes)), environment
            ) as orchestrator:
                servers = {"orchestrator": orchestrator, "capability": capability}
                minilm = self.minilm_levels(front_door)
                for level in minilm:
                    self.measure_against_ceiling(level, orchestrator, servers)
                static = self.static_levels(front_door, internal)
                for level, direct in static:
                    self.measure_against_capability(level, direct, orchestrator, capability)
                self.measure_again_what_failed(minilm, static, orchestrator, capability, servers)
                self.measure_shadow(front_door, orchestrator)
                if self.shadow_ratio() > MAX_SHADOW_P50_RATIO:
                    # Measured once more, as a failed level is.
                    self.shadow_first_ratio = self.shadow_ratio()
                    self.shadow_windows = []
                    self.measure_shadow(front_door, orchestrator)

    @staticmethod
    def minilm_levels(metadata: Sequence[tuple[str, str]]) -> list[Level]:
        unary = unary_call("", metadata)
        return [
            Level("topic-minilm x1", MODEL, 1, unary),
            Level("topic-minilm x8", MODEL, 8, unary),
            Level("topic-minilm x32", MODEL, 32, unary),
            Level(
                f"topic-minilm ClassifyBatch x{BATCH_ITEMS}",
                MODEL,
                1,
                batch_call(BATCH_ITEMS, "", metadata),
                BATCH_ITEMS,
            ),
        ]

    @staticmethod
    def static_levels(
        front_door: Sequence[tuple[str, str]], internal: Sequence[tuple[str, str]]
    ) -> list[tuple[Level, Level]]:
        """(through the front door, the capability directly) at each concurrency."""
        return [
            (
                Level(
                    f"topic-static x{clients}",
                    STATIC_MODEL,
                    clients,
                    unary_call(STATIC_MODEL, front_door),
                ),
                Level(
                    f"topic-static x{clients}, {CAPABILITY}",
                    STATIC_MODEL,
                    clients,
                    unary_call(STATIC_MODEL, internal),
                ),
            )
            for clients in (1, 32)
        ]

    def measure_against_ceiling(
        self, level: Level, target: ServerProcess, servers: Mapping[str, ServerProcess]
    ) -> None:
        print(f"level: {level.name}", flush=True)
        assert self.probe is not None
        result, _ = measure_level(
            target.target,
            level.clients,
            self.seconds,
            level.send,
            runner=self.runner,
            ceiling=self.probe,
            servers=servers,
            items_per_call=level.items_per_call,
        )
        result["p99_in_ceiling_batches"] = result["p99_ms"] / batch_latency_ms(self.ceiling)
        self.errors += int(result["errors"])
        self.levels[level.name] = {"level": level.name, "model": level.model, **result}

    def drive(self, level: Level, target: ServerProcess, seconds: float) -> dict[str, Any]:
        print(f"level: {level.name}", flush=True)
        result: dict[str, Any] = self.runner.run(
            drive(
                target.target,
                level.clients,
                seconds,
                level.send,
                items_per_call=level.items_per_call,
            )
        )
        self.errors += int(result["errors"])
        return {"level": level.name, "model": level.model, "concurrency": level.clients, **result}

    def measure_against_capability(
        self, level: Level, direct: Level, orchestrator: ServerProcess, capability: ServerProcess
    ) -> None:
        """The front-door level between two levels on the capability directly."""
        before = self.drive(direct, capability, self.seconds / 2)
        result = self.drive(level, orchestrator, self.seconds)
        after = self.drive(direct, capability, self.seconds / 2)
        own_rate = (before["texts_per_second"] + after["texts_per_second"]) / 2
        own_p50 = (before["p50_ms"] + after["p50_ms"]) / 2
        result["capability_texts_per_second"] = own_rate
        result["capability_p50_ms"] = own_p50
        # NaN where the capability answered nothing: the check then fails, where the
        # division stopped the gate with a traceback.
        result["ratio_to_capability"] = (
            result["texts_per_second"] / own_rate if own_rate > 0 else math.nan
        )
        result["p50_over_capability"] = result["p50_ms"] / own_p50 if own_p50 > 0 else math.nan
        self.levels[level.name] = result
        self.levels[direct.name] = after

    def measure_again_what_failed(
        self,
        minilm: Sequence[Level],
        static: Sequence[tuple[Level, Level]],
        orchestrator: ServerProcess,
        capability: ServerProcess,
        servers: Mapping[str, ServerProcess],
    ) -> None:
        """Each level with a failed check, once more."""
        failed = {
            check.level
            for check in CHECKS
            if not check.holds(check.figure(self.levels[check.level]))
        }
        for level in minilm:
            if level.name in failed:
                self.remeasured[level.name] = self.levels[level.name]
                assert self.probe is not None
                self.probe.forget()
                self.measure_against_ceiling(level, orchestrator, servers)
        for level, direct in static:
            if level.name in failed:
                self.remeasured[level.name] = self.levels[level.name]
                self.measure_against_capability(level, direct, orchestrator, capability)

    def measure_shadow(self, metadata: Sequence[tuple[str, str]], target: ServerProcess) -> None:
        """One client, alternating windows without and with every call shadowed."""
        plain = Level("topic-minilm x1, not shadowed", MODEL, 1, unary_call("", metadata))
        shadowed = Level(
            "topic-minilm x1, shadowed",
            MODEL,
            1,
            unary_call("", (*metadata, (SHADOW_HEADER, "shadow"))),
        )
        for _ in range(SHADOW_WINDOWS):
            window = {}
            for level in (plain, shadowed):
                measured = self.drive(level, target, SHADOW_WINDOW_SECONDS)
                window[level.name] = measured["p50_ms"]
                self.levels[level.name] = measured  # the last window's, for the plots
            self.shadow_windows.append(window)

    def shadow_ratio(self) -> float:
        """Median over the windows of p50 shadowed over p50 not."""
        return statistics.median(
            window["topic-minilm x1, shadowed"] / window["topic-minilm x1, not shadowed"]
            for window in self.shadow_windows
        )

    def outcomes(self) -> list[dict[str, Any]]:
        results = []
        for check in CHECKS:
            value = check.figure(self.levels[check.level])
            first = self.remeasured.get(check.level)
            results.append(
                {
                    "check": check.name,
                    "value": value,
                    "bound": check.bound,
                    "at_least": check.at_least,
                    "first_measurement": None if first is None else check.figure(first),
                    "passed": check.holds(value),
                }
            )
        ratio = self.shadow_ratio()
        errors = self.errors
        for name, value, bound, first_value, passed in (
            (
                "shadowed p50 / not shadowed p50 at one client",
                ratio,
                MAX_SHADOW_P50_RATIO,
                self.shadow_first_ratio,
                ratio <= MAX_SHADOW_P50_RATIO,
            ),
            ("errors at every level", errors, 0, None, errors == 0),
        ):
            results.append(
                {
                    "check": name,
                    "value": value,
                    "bound": bound,
                    "at_least": False,
                    "first_measurement": first_value,
                    "passed": passed,
                }
            )
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.5, help="load per level")
    args = parser.parse_args()
    started = time.perf_counter()
    with asyncio.Runner() as runner:
        gate = Gate(args.seconds, runner)
        gate.measure_ceiling()
        gate.run()
    checks = gate.outcomes()
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "seconds_per_level": args.seconds,
        "ceiling": gate.ceiling,
        "levels": list(gate.levels.values()),
        "remeasured": list(gate.remeasured.values()),
        "shadow_windows_p50_ms": gate.shadow_windows,
        "latency_buckets_ms": list(LATENCY_BUCKETS_MS),
        "checks": checks,
        "passed": all(check["passed"] for check in checks),
        "duration_seconds": time.perf_counter() - started,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json_text(report))
    plot_heatmap(report, HEATMAP)
    plot_throughput(report, THROUGHPUT_PLOT)
    print_report(report)
    sys.exit(0 if report["passed"] else 1)


def print_report(report: Mapping[str, Any]) -> None:
    print(
        "\n| level | texts/s | p50 ms | p99 ms | errors | / adjacent ceiling | / capability's own |"
    )
    print("|---|---|---|---|---|---|---|")
    for level in report["levels"]:
        print(
            f"| {level['level']} | {level['texts_per_second']:,.0f} | {level['p50_ms']:.1f} "
            f"| {level['p99_ms']:.1f} | {level['errors']} "
            f"| {cell(level.get('ratio_to_ceiling', math.nan), 2)} "
            f"| {cell(level.get('ratio_to_capability', math.nan), 2)} |"
        )
    print("\n| check | value | bound | first measurement | |")
    print("|---|---|---|---|---|")
    for check in report["checks"]:
        sign = ">=" if check["at_least"] else "<="
        first = check["first_measurement"]
        print(
            f"| {check['check']} | {check['value']:.3g} | {sign} {check['bound']:g} "
            f"| {'' if first is None else f'{first:.3g}'} "
            f"| {'ok' if check['passed'] else 'FAILED'} |"
        )
    print(
        f"\nbench-gate: {'passed' if report['passed'] else 'FAILED'} in "
        f"{report['duration_seconds']:.0f} s; {RESULTS.relative_to(REPO_ROOT)}, "
        f"{HEATMAP.relative_to(REPO_ROOT)}, {THROUGHPUT_PLOT.relative_to(REPO_ROOT)}"
    )


def plot_heatmap(report: Mapping[str, Any], path: Path) -> None:
    """Each level (model by concurrency) a row, each latency bucket a column, the share
    of its calls in each bucket as the colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    edges = report["latency_buckets_ms"]
    shares = [
        [count / max(sum(level["latency_counts"]), 1) for count in level["latency_counts"]]
        for level in levels
    ]
    figure, axis = plt.subplots(figsize=(12, 0.5 * len(levels) + 2))
    image = axis.imshow(shares, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    axis.set_yticks(range(len(levels)), [level["level"] for level in levels], fontsize=8)
    columns = [f"≤{edge:g}" for edge in edges] + [f">{edges[-1]:g}"]
    axis.set_xticks(range(len(columns)), columns, rotation=60, fontsize=7)
    axis.set_xlabel("latency per call, ms (bucket)")
    for row, level in enumerate(levels):
        for column, count in enumerate(level["latency_counts"]):
            if count:
                axis.text(column, row, str(count), ha="center", va="center", fontsize=6, color="w")
    figure.colorbar(image, ax=axis, label="share of the level's calls")
    axis.set_title("bench-gate: calls by latency bucket, per level (model, clients)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_throughput(report: Mapping[str, Any], path: Path) -> None:
    """Texts/s against p99 per level, one panel per model, with the ceiling's best batch
    (rate, one batch's latency) as a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 5))
    for axis, model in zip(axes, (MODEL, STATIC_MODEL), strict=True):
        points = [level for level in report["levels"] if level["model"] == model]
        for level in points:
            axis.scatter(level["texts_per_second"], level["p99_ms"])
            axis.annotate(
                level["level"].removeprefix(f"{model} "),
                (level["texts_per_second"], level["p99_ms"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        if model == MODEL:
            ceiling = report["ceiling"]
            axis.scatter(
                ceiling["ceiling_texts_per_second"],
                batch_latency_ms(ceiling),
                marker="*",
                s=150,
                color="black",
                label=f"ceiling, batch {ceiling['best_batch_size']} (in-process, 1 thread)",
            )
            axis.legend(fontsize=7)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("texts per second")
        axis.set_ylabel("p99 per call, ms")
        axis.set_title(model)
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle("bench-gate: throughput against p99")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()

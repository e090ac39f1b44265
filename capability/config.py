"""Capability server settings: flags override environment variables override defaults.

Per-model serving settings (batching, precision, graph) come from an optional YAML
file (`--model-config`), one mapping per model name:

    topic-minilm:
      max_batch_size: 32      # texts per forward pass, 1..1024
      max_wait_ms: 0          # oldest request's wait for a fuller batch, 0..1000
      queue_capacity: 256     # queued requests per worker, 1..100000
      length_buckets: [16, 32, 64, 128, 256, 512]
      precision: fp32         # fp32 or bf16; absent: the bundle's own
      graph: torchscript      # torchscript or eager: how the encoder's forward runs

A model not in the file gets the server-wide defaults from the flags. The file is
read once, at start-up, within classify_common.documents' bounds (size, depth, no
YAML aliases).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capability.batching import BatchingSettings
from capability.batching.settings import (
    DEFAULT_LENGTH_BUCKETS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_WAIT_SECONDS,
    DEFAULT_QUEUE_CAPACITY,
)
from capability.model import DEFAULT_GRAPH, GRAPHS
from classify_common.documents import DocumentRefused, load_yaml
from classify_common.settings import SettingsError, add_setting, check_port, check_range
from classify_common.tls import ServerTls, server_tls

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9102
DEFAULT_MODEL_ROOT = Path("build/models")
DEFAULT_MODEL = "topic-minilm"
DEFAULT_DEVICE = "auto"
DEFAULT_CPU_WORKERS = 1
DEFAULT_MEMORY_THRESHOLD = 0.82
DEFAULT_WATCH_SECONDS = 2.0
DEFAULT_GRACE_SECONDS = 10.0
PRECISIONS = ("fp32", "bf16")


# Measured with `make bench-overload` (README, "Overload"): at 5 the serving loops
# of both servers get the cores first when torch keeps them busy.
DEFAULT_CPU_COMPUTE_NICE = 5


@dataclass(frozen=True)
class ModelServingSettings:
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    # "fp32" or "bf16"; None keeps the precision written in the bundle.
    precision: str | None = None
    # "torchscript" or "eager" (capability.model.classifier.GRAPHS).
    graph: str = DEFAULT_GRAPH

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise SettingsError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        if self.graph not in GRAPHS:
            raise SettingsError(f"graph {self.graph!r} is not one of {GRAPHS}")


_MODEL_KEYS = {
    *("max_batch_size", "max_wait_ms", "queue_capacity", "length_buckets"),
    *("precision", "graph"),
}


def parse_model_config(
    document: Any, defaults: ModelServingSettings
) -> dict[str, ModelServingSettings]:
    """Per-model settings from the YAML document; errors name the model and key."""
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise SettingsError("model config: expected a mapping of model name to settings")
    parsed: dict[str, ModelServingSettings] = {}
    for name, spec in document.items():
        if not isinstance(spec, dict):
            raise SettingsError(f"model config: {name}: expected a mapping")
        unknown = sorted(set(spec) - _MODEL_KEYS)
        if unknown:
            raise SettingsError(f"model config: {name}.{unknown[0]}: unknown key")
        base = defaults.batching
        try:
            batching = BatchingSettings(
                max_batch_size=int(spec.get("max_batch_size", base.max_batch_size)),
                max_wait_seconds=float(spec.get("max_wait_ms", base.max_wait_seconds * 1000))
                / 1000,
                queue_capacity=int(spec.get("queue_capacity", base.queue_capacity)),
                length_buckets=tuple(
                    int(b) for b in spec.get("length_buckets", base.length_buckets)
                ),
            )
            parsed[name] = ModelServingSettings(
                batching,
                spec.get("precision", defaults.precision),
                spec.get("graph", defaults.graph),
            )
        except (SettingsError, TypeError, ValueError) as exc:
            raise SettingsError(f"model config: {name}: {exc}") from exc
    return parsed


@dataclass(frozen=True)
class CapabilitySettings:
    # Interface to bind. 127.0.0.1 keeps the model server off the network;
    # containers set 0.0.0.0.
    host: str = DEFAULT_HOST
    # gRPC port, 0..65535; 0 picks a free port (logged in the "serving" line).
    port: int = DEFAULT_PORT
    # Prometheus /metrics port, 0..65535; 0 picks a free one, -1 disables it.
    metrics_port: int = DEFAULT_METRICS_PORT
    # Folder of model bundles: <root>/<model>/<version>/ (built by `make bundles`).
    model_root: Path = DEFAULT_MODEL_ROOT
    # Models to serve; empty serves every model under the root.
    models: tuple[str, ...] = ()
    # Model used when a request names none.
    default_model: str = DEFAULT_MODEL
    # "auto" (one worker per CUDA device, else CPU), "cpu", or devices "cuda:0,cuda:1".
    device: str = DEFAULT_DEVICE
    # CPU workers when running on the CPU, 1..64.
    cpu_workers: int = DEFAULT_CPU_WORKERS
    # torch intra-op threads on the CPU, 0..256; 0 splits all cores between the
    # CPU workers.
    torch_threads: int = 0
    # Niceness of CPU workers' compute threads (the device thread and its torch
    # threads), 0..19: when the cores are busy, the serving loops run first.
    cpu_compute_nice: int = DEFAULT_CPU_COMPUTE_NICE
    # Server-wide batching defaults; --model-config overrides them per model.
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_wait_ms: float = DEFAULT_MAX_WAIT_SECONDS * 1000
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY
    # How encoders run: "torchscript" (traced, off the GIL) or "eager"; per model too.
    graph: str = DEFAULT_GRAPH
    # Optional YAML of per-model settings (see the module docstring).
    model_config: Path | None = None
    # Share of CUDA memory in use above which admission refuses, 0.1..1.0.
    memory_threshold: float = DEFAULT_MEMORY_THRESHOLD
    # Seconds between looks for new version folders, 0 (off) or 0.1..3600.
    watch_seconds: float = DEFAULT_WATCH_SECONDS
    # TLS: PEM certificate and key to serve with; with a client CA, callers must present
    # a certificate it signed (mTLS). None of them: plaintext.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    # File with the token the orchestrator must send (x-internal-token); None accepts
    # any caller (development only).
    internal_token_file: Path | None = None
    # OTLP gRPC receiver for spans, host:port (Jaeger: 4317); None exports nothing.
    otlp_endpoint: str | None = None
    # Share of traces started here that are kept, 0..1 (parent-based: a caller's
    # decision wins).
    trace_sample_ratio: float = 1.0
    # Seconds admitted work gets to finish on SIGTERM, 0..300.
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    log_level: str = "INFO"
    per_model: Mapping[str, ModelServingSettings] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_port(self.port, "--port", "CAPABILITY_PORT")
        check_port(
            self.metrics_port, "--metrics-port", "CAPABILITY_METRICS_PORT", allow_disabled=True
        )
        device_names = [name.strip() for name in self.device.split(",")]
        if not (self.device in ("auto", "cpu") or all(n.startswith("cuda:") for n in device_names)):
            raise SettingsError(
                f"--device / CAPABILITY_DEVICE: {self.device!r} is not auto, cpu or cuda:N[,cuda:M]"
            )
        check_range(self.cpu_workers, 1, 64, "--cpu-workers", "CAPABILITY_CPU_WORKERS")
        check_range(self.torch_threads, 0, 256, "--torch-threads", "CAPABILITY_TORCH_THREADS")
        check_range(
            self.cpu_compute_nice, 0, 19, "--cpu-compute-nice", "CAPABILITY_CPU_COMPUTE_NICE"
        )
        check_range(
            self.memory_threshold, 0.1, 1.0, "--memory-threshold", "CAPABILITY_MEMORY_THRESHOLD"
        )
        if self.watch_seconds != 0:
            check_range(
                self.watch_seconds, 0.1, 3600, "--watch-seconds", "CAPABILITY_WATCH_SECONDS"
            )
        check_range(self.grace_seconds, 0, 300, "--grace-seconds", "CAPABILITY_GRACE_SECONDS")
        check_range(
            self.trace_sample_ratio, 0, 1, "--trace-sample-ratio", "CAPABILITY_TRACE_SAMPLE_RATIO"
        )
        self.server_tls()  # refuses an incomplete set of TLS files now, not at bind time
        try:
            defaults = self.default_serving()
        except SettingsError as exc:
            raise SettingsError(
                f"--max-batch-size / --max-wait-ms / --queue-capacity / --graph: {exc}"
            ) from exc
        if self.model_config is not None and not self.per_model:
            try:
                document = load_yaml(self.model_config)
            except (OSError, DocumentRefused) as exc:
                raise SettingsError(f"--model-config / CAPABILITY_MODEL_CONFIG: {exc}") from exc
            object.__setattr__(self, "per_model", parse_model_config(document, defaults))

    def server_tls(self) -> ServerTls | None:
        return server_tls(
            self.tls_cert_file,
            self.tls_key_file,
            self.tls_client_ca_file,
            "--tls-cert-file / --tls-key-file / --tls-client-ca-file",
        )

    def default_serving(self) -> ModelServingSettings:
        return ModelServingSettings(
            BatchingSettings(
                max_batch_size=self.max_batch_size,
                max_wait_seconds=self.max_wait_ms / 1000,
                queue_capacity=self.queue_capacity,
                length_buckets=DEFAULT_LENGTH_BUCKETS,
            ),
            graph=self.graph,
        )

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ
    ) -> CapabilitySettings:
        parser = argparse.ArgumentParser(
            prog="python -m capability", description="Capability (model) server."
        )

        def setting(flag: str, env: str, default: object, text: str, kind: type = str) -> None:
            add_setting(parser, flag, env, default, text, environ, kind)

        setting("--host", "CAPABILITY_HOST", DEFAULT_HOST, "interface to bind")
        setting("--port", "CAPABILITY_PORT", DEFAULT_PORT, "gRPC port (0: any free)", int)
        setting(
            "--metrics-port",
            "CAPABILITY_METRICS_PORT",
            DEFAULT_METRICS_PORT,
            "Prometheus port (0: any, -1: off)",
            int,
        )
        setting(
            "--model-root",
            "CAPABILITY_MODEL_ROOT",
            DEFAULT_MODEL_ROOT,
            "bundle folder <root>/<model>/<version>",
            Path,
        )
        setting(
            "--models",
            "CAPABILITY_MODELS",
            "",
            "comma-separated models to serve (empty: all under the root)",
        )
        setting(
            "--default-model",
            "CAPABILITY_DEFAULT_MODEL",
            DEFAULT_MODEL,
            "model for requests that name none",
        )
        setting("--device", "CAPABILITY_DEVICE", DEFAULT_DEVICE, "auto, cpu, or cuda:N[,cuda:M]")
        setting("--cpu-workers", "CAPABILITY_CPU_WORKERS", DEFAULT_CPU_WORKERS, "CPU workers", int)
        setting(
            "--torch-threads",
            "CAPABILITY_TORCH_THREADS",
            0,
            "torch CPU threads (0: all cores, split between workers)",
            int,
        )
        setting(
            "--cpu-compute-nice",
            "CAPABILITY_CPU_COMPUTE_NICE",
            DEFAULT_CPU_COMPUTE_NICE,
            "niceness of CPU compute threads, 0..19 (serving loops first)",
            int,
        )
        setting(
            "--max-batch-size",
            "CAPABILITY_MAX_BATCH_SIZE",
            DEFAULT_MAX_BATCH_SIZE,
            "texts per batch",
            int,
        )
        setting(
            "--max-wait-ms",
            "CAPABILITY_MAX_WAIT_MS",
            DEFAULT_MAX_WAIT_SECONDS * 1000,
            "batch window",
            float,
        )
        setting(
            "--queue-capacity",
            "CAPABILITY_QUEUE_CAPACITY",
            DEFAULT_QUEUE_CAPACITY,
            "queued requests per worker",
            int,
        )
        setting(
            "--graph",
            "CAPABILITY_GRAPH",
            DEFAULT_GRAPH,
            "how encoders run: torchscript (traced, off the GIL) or eager",
        )
        setting(
            "--model-config", "CAPABILITY_MODEL_CONFIG", None, "YAML of per-model settings", Path
        )
        setting(
            "--memory-threshold",
            "CAPABILITY_MEMORY_THRESHOLD",
            DEFAULT_MEMORY_THRESHOLD,
            "CUDA memory share refusing admission",
            float,
        )
        setting(
            "--watch-seconds",
            "CAPABILITY_WATCH_SECONDS",
            DEFAULT_WATCH_SECONDS,
            "poll for new versions (0: off)",
            float,
        )
        setting(
            "--grace-seconds",
            "CAPABILITY_GRACE_SECONDS",
            DEFAULT_GRACE_SECONDS,
            "drain time on shutdown",
            float,
        )
        setting(
            "--internal-token-file",
            "CAPABILITY_INTERNAL_TOKEN_FILE",
            None,
            "token required from callers (none: any caller, development only)",
            Path,
        )
        setting("--tls-cert-file", "CAPABILITY_TLS_CERT_FILE", None, "PEM certificate (TLS)", Path)
        setting("--tls-key-file", "CAPABILITY_TLS_KEY_FILE", None, "PEM private key (TLS)", Path)
        setting(
            "--tls-client-ca-file",
            "CAPABILITY_TLS_CLIENT_CA_FILE",
            None,
            "CA that client certificates must be signed by (mTLS)",
            Path,
        )
        setting(
            "--otlp-endpoint",
            "CAPABILITY_OTLP_ENDPOINT",
            None,
            "OTLP gRPC host:port (none: no export)",
        )
        setting(
            "--trace-sample-ratio",
            "CAPABILITY_TRACE_SAMPLE_RATIO",
            1.0,
            "share of traces kept",
            float,
        )
        setting("--log-level", "CAPABILITY_LOG_LEVEL", "INFO", "log level")
        values = vars(parser.parse_args(argv))
        values["models"] = tuple(
            name.strip() for name in values["models"].split(",") if name.strip()
        )
        return cls(**values)

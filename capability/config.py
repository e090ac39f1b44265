"""Capability server settings: flags override environment variables override defaults.

Per-model serving settings (batching, precision, graph) come from an optional YAML
file (`--model-config`), one mapping per model name:

    topic-minilm:
      max_batch_size: 64      # texts per forward pass, 1..1024
      max_wait_ms: 0          # oldest request's wait for a fuller batch, 0..1000
      queue_capacity: 256     # queued requests per worker, 1..100000
      length_buckets: [16, 32, 64, 128, 256, 512]
      precision: fp32         # fp32 or bf16; absent: the bundle's own
      graph: torchscript      # torchscript or eager: how the encoder's forward runs
      residency: on_demand    # resident, on_demand or sharded (capability/workers/residency.py)
      idle_seconds: 300       # on_demand: unused this long, it leaves the device, 0.1..86400
      warm_texts: hot.txt     # frequent texts, one a line, computed at each load to fill
                              # the result cache (relative to this file's folder)
      cache_hit_floor: 0.9    # the result cache's hit ratio this model should keep, 0..1
                              # (exported for the ClassifyResultCacheHitRatioLow alert)

A model not in the file gets the server-wide defaults from the flags. A name in
the file that the server does not serve (`--models`, else every model under the
root) is refused at start-up, naming the file, its line and the served models
(`check_model_config_names`). The file is read once, at start-up (by
`from_args`, or `with_model_config()`), within classify_common.documents' bounds
(size, depth, no YAML aliases); it is not reloaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Self

import torch

from capability.batching import BatchingSettings
from capability.batching.settings import (
    DEFAULT_LENGTH_BUCKETS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_WAIT_SECONDS,
    DEFAULT_QUEUE_CAPACITY,
)
from capability.memory import parse_byte_size
from capability.model import DEFAULT_GRAPH, GRAPHS
from capability.result_cache import DEFAULT_BYTES, DEFAULT_ENTRIES, DEFAULT_WARM
from capability.workers.cuda import CUDA_ALLOCATORS, DEFAULT_CUDA_ALLOCATOR
from capability.workers.residency import DEFAULT_IDLE_SECONDS, RESIDENCIES, RESIDENT, SHARDED
from classify_common.documents import DocumentRefused
from classify_common.fields import FieldRefused, Fields, read_yaml
from classify_common.model_names import MODEL_NAME_RULE, is_model_name
from classify_common.server_settings import (
    ServerSettings,
    metrics_port_setting,
    port_setting,
)
from classify_common.settings import (
    SettingsError,
    comma_list,
    path_value,
    setting,
    setting_file,
    spoken_number,
)

DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9102
DEFAULT_MODEL_ROOT = Path("build/models")
DEFAULT_MODEL = "topic-minilm"
DEFAULT_DEVICE = "auto"
DEFAULT_CPU_WORKERS = 1
DEFAULT_MEMORY_THRESHOLD = 0.82
DEFAULT_WATCH_SECONDS = 2.0
PRECISIONS = ("fp32", "bf16")


# At 5 the serving loops of both servers get the cores first when torch keeps them
# busy. Alternated `make bench-overload` windows with 0, 5 and 10 differed within the
# 2-core machine's noise (docs/serving.md, "Overload"); 19 starved the model.
DEFAULT_CPU_COMPUTE_NICE = 5


@dataclass(frozen=True)
class ModelServingSettings:
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    # "fp32" or "bf16"; None keeps the precision written in the bundle.
    precision: str | None = None
    # "torchscript" or "eager" (capability.model.classifier.GRAPHS).
    graph: str = DEFAULT_GRAPH
    # capability.workers.residency.RESIDENCIES; on_demand leaves the device after
    # `idle_seconds` unused, 0.1..86400 s.
    residency: str = RESIDENT
    idle_seconds: float = DEFAULT_IDLE_SECONDS
    # A file of frequent texts, one a line, computed at each load into the result
    # cache (capability.result_cache.read_warm_texts); None: none.
    warm_texts: Path | None = None
    # The result cache's hit ratio this model is expected to keep, 0..1; exported as
    # classify_result_cache_hit_floor for the alert. None: no expectation.
    cache_hit_floor: float | None = None

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise SettingsError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        if self.graph not in GRAPHS:
            raise SettingsError(f"graph {self.graph!r} is not one of {GRAPHS}")
        if self.residency not in RESIDENCIES:
            raise SettingsError(f"residency {self.residency!r} is not one of {RESIDENCIES}")
        if not 0.1 <= self.idle_seconds <= 86_400:
            raise SettingsError(f"idle_seconds {self.idle_seconds} is outside 0.1..86400")
        if self.cache_hit_floor is not None and not 0 <= self.cache_hit_floor <= 1:
            raise SettingsError(f"cache_hit_floor {self.cache_hit_floor} is outside 0..1")


def parse_model_config(
    document: Any, defaults: ModelServingSettings
) -> dict[str, ModelServingSettings]:
    """Per-model settings from the YAML document; a FieldRefused names model and key."""
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise FieldRefused("", "expected a mapping of model name to settings")
    parsed: dict[str, ModelServingSettings] = {}
    for name, spec in document.items():
        if not is_model_name(name):
            raise FieldRefused(str(name), f"not a model name ({MODEL_NAME_RULE})")
        try:
            parsed[str(name)] = _model_serving(Fields(spec, str(name)), defaults)
        except (SettingsError, TypeError) as exc:
            raise FieldRefused(str(name), str(exc)) from exc
    return parsed


def _model_serving(spec: Fields, defaults: ModelServingSettings) -> ModelServingSettings:
    """One model's settings; what it leaves out is the server-wide default."""
    base = defaults.batching
    max_batch_size = spec.integer("max_batch_size", base.max_batch_size)
    max_wait_ms = spec.number("max_wait_ms", base.max_wait_seconds * 1000)
    queue_capacity = spec.integer("queue_capacity", base.queue_capacity)
    length_buckets = spec.integers("length_buckets", base.length_buckets)
    # Checked, with their messages, by ModelServingSettings.
    precision = spec.raw("precision", defaults.precision)
    graph = spec.raw("graph", defaults.graph)
    residency = spec.raw("residency", defaults.residency)
    idle_seconds = spec.number("idle_seconds", defaults.idle_seconds)
    warm_texts = spec.raw("warm_texts", None)
    cache_hit_floor = spec.optional_number("cache_hit_floor")
    spec.refuse_unknown()
    if warm_texts is not None and not isinstance(warm_texts, str):
        raise FieldRefused(spec.path("warm_texts"), f"{warm_texts!r} is not a file name")
    try:
        batching = BatchingSettings(
            max_batch_size, max_wait_ms / 1000, queue_capacity, length_buckets
        )
    except SettingsError as exc:
        raise _refused_batching_key(spec, str(exc), max_wait_ms) from exc
    try:
        return ModelServingSettings(
            batching,
            precision,
            graph,
            residency,
            idle_seconds,
            None if warm_texts is None else Path(warm_texts),
            cache_hit_floor,
        )
    except SettingsError as exc:
        # At the key's line, as a batching key's: these were put at the model's.
        raise _refused_key(spec, str(exc)) from exc


def _refused_batching_key(spec: Fields, message: str, max_wait_ms: float) -> FieldRefused:
    """A BatchingSettings refusal, put to the key of the file that set it (its line, not
    the model's), in the file's words: `max_wait_ms` in milliseconds, where the
    setting's own message speaks of max_wait_seconds."""
    field = message.split(" ", 1)[0]
    if field == "max_wait_seconds":
        return FieldRefused(
            # Exactly as written: :g printed 1000.0000001 as "1000 is outside 0..1000".
            spec.path("max_wait_ms"),
            f"max_wait_ms {spoken_number(max_wait_ms)} is outside 0..1000",
        )
    return _refused_key(spec, message)


def _refused_key(spec: Fields, message: str) -> FieldRefused:
    """A setting's refusal, whose message starts with the setting's name, put to that
    key of the file (its line), or to the model's entry when the file does not set it."""
    field = message.split(" ", 1)[0]
    return FieldRefused(spec.path(field) if field in spec.raw_keys() else spec.where, message)


# A CUDA device as torch.device reads it: str.isdigit also took `cuda:00` and other
# scripts' digits (`cuda:\u0660`), which torch then refused with a RuntimeError traceback.
CUDA_DEVICE_NAME = re.compile(r"cuda:(0|[1-9][0-9]*)")


def check_cuda_devices(names: Sequence[str]) -> None:
    """Refuse a name that is not `cuda:N` as torch reads it, one named twice (two workers
    on one device passed sharded's two-device rule), and `cuda:N` names this machine
    has no device for (torch would fail later, inside a worker, with its own assertion)."""
    for at, name in enumerate(names):
        if not CUDA_DEVICE_NAME.fullmatch(name):
            raise SettingsError(
                f"--device / CAPABILITY_DEVICE: {name!r} is not cuda:N "
                "(N a device index in the digits 0-9, without a leading zero)"
            )
        if name in names[:at]:
            raise SettingsError(
                f"--device / CAPABILITY_DEVICE: {name!r} is named twice (one worker per device)"
            )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name in names:
        if int(name.removeprefix("cuda:")) >= count:
            have = f"cuda:0..cuda:{count - 1}" if count else "no CUDA device"
            raise SettingsError(f"--device / CAPABILITY_DEVICE: {name!r}: this machine has {have}")


@dataclass(frozen=True)
class CapabilitySettings(ServerSettings):
    ENV_PREFIX: ClassVar[str] = "CAPABILITY_"
    PROG: ClassVar[str] = "python -m capability"
    DESCRIPTION: ClassVar[str] = "Capability (model) server."

    port: int = port_setting(DEFAULT_PORT)
    metrics_port: int = metrics_port_setting(DEFAULT_METRICS_PORT)
    # Built by `make bundles`.
    model_root: Path = setting(
        DEFAULT_MODEL_ROOT, "bundle folder `<root>/<model>/<version>`", path_value
    )
    models: tuple[str, ...] = setting(
        (),
        "comma-separated models to serve (empty: all under the root)",
        comma_list,
        test=is_model_name,
        rule="a model name",
        note=MODEL_NAME_RULE,
    )
    default_model: str = setting(
        DEFAULT_MODEL,
        "model for requests that name none",
        test=is_model_name,
        rule="a model name",
        note=MODEL_NAME_RULE,
    )
    # "auto" is one worker per CUDA device, else CPU (checked in check_together).
    device: str = setting(
        DEFAULT_DEVICE,
        "auto, cpu, or cuda:N[,cuda:M] (auto: every CUDA device, else CPU; each device once)",
    )
    cpu_workers: int = setting(
        DEFAULT_CPU_WORKERS, "CPU workers (when on the CPU)", int, low=1, high=64
    )
    # 0 splits all cores between the CPU workers.
    torch_threads: int = setting(
        0,
        "torch threads of each CPU worker's device thread (0: all cores, split between workers)",
        int,
        low=0,
        high=256,
    )
    # Niceness of CPU workers' compute threads (the device thread and its torch
    # threads): when the cores are busy, the serving loops run first.
    cpu_compute_nice: int = setting(
        DEFAULT_CPU_COMPUTE_NICE,
        "niceness of CPU compute threads (serving loops first)",
        int,
        low=0,
        high=19,
    )
    # Server-wide batching defaults; --model-config overrides them per model. The
    # bounds are BatchingSettings'.
    max_batch_size: int = setting(DEFAULT_MAX_BATCH_SIZE, "texts per batch", int, low=1, high=1024)
    max_wait_ms: float = setting(
        DEFAULT_MAX_WAIT_SECONDS * 1000, "batch window", float, low=0, high=1000, unit="ms"
    )
    queue_capacity: int = setting(
        DEFAULT_QUEUE_CAPACITY, "queued requests per worker and model", int, low=1, high=100_000
    )
    # "torchscript" is traced and runs off the GIL; per model too.
    graph: str = setting(DEFAULT_GRAPH, "how encoders run", choices=GRAPHS)
    # See the module docstring.
    model_config: Path | None = setting(
        None, "YAML of per-model batching, precision and graph", path_value
    )
    memory_threshold: float = setting(
        DEFAULT_MEMORY_THRESHOLD,
        "CUDA memory share refusing admission",
        float,
        low=0.1,
        high=1.0,
    )
    # 0: capability.memory.DEFAULT_BUDGET_SHARE of the device (CPU: of host memory).
    device_memory_budget: int = setting(
        0,
        "bytes the model versions resident on a worker may hold together (e.g. 12GiB; "
        "0: 80% of the device, on the CPU of host memory)",
        parse_byte_size,
        low=0,
        unit="bytes",
    )
    # What the model ledger measures at load: `largest` is the real worst case.
    memory_warm_up: str = setting(
        "largest",
        "warm-up the memory ledger measures: the largest batch of the longest texts the "
        "model reads (its max_seq_length), or a small batch (faster starts)",
        choices=("largest", "small"),
    )
    # Per model too (--model-config); sharded needs 2 devices (see check_devices).
    residency: str = setting(
        RESIDENT,
        "where models' weights live: kept on the device, copied there on demand, or "
        "the encoder's layers split across the devices",
        choices=RESIDENCIES,
    )
    idle_seconds: float = setting(
        DEFAULT_IDLE_SECONDS,
        "an on_demand model unused this long leaves the device",
        float,
        low=0.1,
        high=86_400,
        unit="s",
    )
    # The result cache (capability/result_cache.py), in front of every model's queue.
    result_cache_entries: int = setting(
        DEFAULT_ENTRIES,
        "results the cache keeps, all models together (0: no cache)",
        int,
        low=0,
        high=10_000_000,
    )
    result_cache_bytes: int = setting(
        DEFAULT_BYTES,
        "estimated bytes the result cache may hold (e.g. 64MiB)",
        parse_byte_size,
        low=1,
        unit="bytes",
    )
    result_cache_warm: int = setting(
        DEFAULT_WARM,
        "most hit texts computed again on a model's new version after a swap (0: none)",
        int,
        low=0,
        high=100_000,
    )
    # Written into PYTORCH_CUDA_ALLOC_CONF before CUDA starts, unless the operator set
    # that variable; logged at start-up (capability/workers/cuda.py).
    cuda_allocator: str = setting(
        DEFAULT_CUDA_ALLOCATOR,
        "CUDA caching allocator (no effect on the CPU; PYTORCH_CUDA_ALLOC_CONF wins)",
        choices=tuple(CUDA_ALLOCATORS),
    )
    watch_seconds: float = setting(
        DEFAULT_WATCH_SECONDS,
        "poll for new version folders (0: off)",
        float,
        low=0.1,
        high=3600,
        off=0,
        unit="s",
    )
    # None accepts any caller (development only).
    internal_token_file: Path | None = setting(
        None,
        "token required from callers, x-internal-token (none: any caller, dev only; "
        "`make run`: .run/internal-token)",
        path_value,
    )
    # None loads unsigned bundles (development); see docs/models.md, "Signed bundles".
    trusted_signers: Path | None = setting(
        None,
        "OpenSSH allowed-signers file; every bundle's manifest.json must be signed by one "
        "of its keys (none: unsigned bundles load; `make run`: .run/bundle-signers)",
        path_value,
    )
    # Read from model_config by from_args() / with_model_config().
    per_model: Mapping[str, ModelServingSettings] = field(default_factory=dict, repr=False)

    def check_together(self) -> None:
        super().check_together()
        device_names = [name.strip() for name in self.device.split(",")]
        if not (self.device in ("auto", "cpu") or all(n.startswith("cuda:") for n in device_names)):
            raise SettingsError(
                f"--device / CAPABILITY_DEVICE: {self.device!r} is not auto, cpu or cuda:N[,cuda:M]"
            )
        if self.device not in ("auto", "cpu"):
            check_cuda_devices(device_names)
        setting_file(self, "trusted_signers")
        try:
            self.default_serving()
        except SettingsError as exc:
            raise SettingsError(
                f"--max-batch-size / --max-wait-ms / --queue-capacity / --graph: {exc}"
            ) from exc

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ
    ) -> Self:
        """Settings from flags, variables and defaults, with --model-config read."""
        return super().from_args(argv, environ).with_model_config()

    def with_model_config(self) -> Self:
        """These settings with `per_model` read from --model-config (none: unchanged)."""
        config = setting_file(self, "model_config")  # refused unless a regular file
        if config is None:
            return self
        defaults = self.default_serving()
        try:
            per_model = read_yaml(config, lambda document: parse_model_config(document, defaults))
        except (OSError, DocumentRefused, FieldRefused) as exc:
            raise SettingsError(f"--model-config / CAPABILITY_MODEL_CONFIG: {exc}") from exc
        folder = config.parent
        for name, serving in per_model.items():
            if serving.warm_texts is None:
                continue
            warm_texts = folder / serving.warm_texts  # an absolute path stays as it is
            if not warm_texts.is_file():
                raise SettingsError(
                    f"--model-config / CAPABILITY_MODEL_CONFIG: {name}: warm_texts: "
                    f"{warm_texts} is not a file"
                )
            per_model[name] = replace(serving, warm_texts=warm_texts)
        return replace(self, per_model=per_model)

    def check_model_config_names(self, served: Sequence[str]) -> None:
        """Refuse a --model-config entry for a model this server does not serve (read
        at start-up, once the models to serve are known): a misspelt name would
        otherwise leave its model on the defaults without a word. The SettingsError
        names the file and the entry's line, as the file's other refusals do."""
        unknown = [name for name in self.per_model if name not in served]
        if not unknown:
            return
        refused = FieldRefused(
            unknown[0], f"no model served here has this name (served: {', '.join(served)})"
        )
        if self.model_config is not None:

            def locate(_document: Any) -> None:
                raise refused

            # NOTE: the file is read again only to find the line: read_yaml adds the
            # file and the line to a FieldRefused raised while it holds the document.
            try:
                read_yaml(self.model_config, locate)
            except FieldRefused as located:
                refused = located
            except (OSError, DocumentRefused):
                refused = FieldRefused(refused.where, refused.problem, file=str(self.model_config))
        raise SettingsError(f"--model-config / CAPABILITY_MODEL_CONFIG: {refused}")

    def check_default_model(self, served: Sequence[str]) -> None:
        """Refuse a default model this server does not serve (known at start-up): every
        call that names no model would be NOT_FOUND while the server said SERVING."""
        if self.default_model not in served:
            raise SettingsError(
                f"--default-model / CAPABILITY_DEFAULT_MODEL: {self.default_model!r} is not "
                f"served here (served: {', '.join(served)})"
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
            residency=self.residency,
            idle_seconds=self.idle_seconds,
        )

    def check_devices(self, worker_names: Sequence[str]) -> None:
        """Refuse a residency the discovered devices cannot give (read at start-up,
        once the devices are known)."""
        chosen = [("--residency / CAPABILITY_RESIDENCY", self.residency)] + [
            (f"--model-config: {name}: residency", serving.residency)
            for name, serving in self.per_model.items()
        ]
        for where, residency in chosen:
            if residency != SHARDED:
                continue
            if len(worker_names) < 2:
                raise SettingsError(
                    f"{where}: sharded splits a model's layers across devices and needs at "
                    f"least 2; this server has {len(worker_names)} ({', '.join(worker_names)}). "
                    "Use resident or on_demand, or give --device cuda:0,cuda:1"
                )

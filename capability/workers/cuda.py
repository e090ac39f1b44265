"""CUDA settings applied once per process, and device-memory readings.

TF32 is off so results are reproducible and match the CPU to fp32 tolerance;
a model that wants TF32's speed should say so by choosing bf16. The caching
allocator is chosen by --cuda-allocator: expandable segments (the default, which
avoids the fragmentation that variable-length batches otherwise cause),
cudaMallocAsync (the driver's pool), or the native allocator as torch ships it.
Both must be set before CUDA starts; the choice in effect, with the CUDA runtime
and driver versions, is logged at start-up ("not applicable" on the CPU).

The collector reads every worker's memory when Prometheus scrapes, through
capability.memory (so CPU workers report the process's resident memory), and
starts a new peak window after each scrape: `peak` is the most allocated since
the previous scrape.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

# NOTE: torch.cuda.utilization reads NVML through pynvml (nvidia-ml-py), which torch
# does not depend on: without it classify_device_utilisation was never exported on any
# GPU. Imported here, unused, so that the capability's requirements must declare it
# (tools/check_imports.py); loading it touches no driver.
import pynvml  # type: ignore[import-untyped]  # noqa: F401
import torch
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from capability.memory import (
    PEAK_WINDOW,
    read_memory,
    read_peak,
    reset_peak,
    split_memory,
    total_bytes,
)
from capability.metrics import DEVICE_FRAGMENTATION_BYTES, DEVICE_MEMORY_BYTES, DEVICE_UTILISATION

ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
# --cuda-allocator: what each choice writes into PYTORCH_CUDA_ALLOC_CONF.
CUDA_ALLOCATORS = {
    "expandable_segments": "expandable_segments:True",
    "cudaMallocAsync": "backend:cudaMallocAsync",
    "native": "",
}
DEFAULT_CUDA_ALLOCATOR = "expandable_segments"
NOT_APPLICABLE = "not applicable (no CUDA device)"


def configure_cuda_defaults(allocator: str = DEFAULT_CUDA_ALLOCATOR) -> None:
    """Reproducible math and the chosen caching allocator (an operator's own
    PYTORCH_CUDA_ALLOC_CONF wins)."""
    setting = CUDA_ALLOCATORS[allocator]
    if setting:
        os.environ.setdefault(ALLOCATOR_ENV, setting)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def allocator_report(devices: Iterable[torch.device], allocator: str) -> dict[str, str]:
    """What the start-up log says about device memory: the allocator in effect, and
    the CUDA runtime and driver versions; on the CPU, that none of it applies."""
    if not any(device.type == "cuda" for device in devices):
        return {"cuda_allocator": NOT_APPLICABLE, "cuda_runtime": NOT_APPLICABLE}
    return {
        "cuda_allocator": allocator,
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "alloc_conf": os.environ.get(ALLOCATOR_ENV, ""),
        "cuda_runtime": str(torch.version.cuda),
        "cuda_driver": cuda_driver_version(),
    }


def cuda_driver_version() -> str:
    """The driver's CUDA version, e.g. "12.4" ("unknown" where torch does not say)."""
    read = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        version = int(read()) if read is not None else 0
    except RuntimeError:
        version = 0
    return f"{version // 1000}.{version % 1000 // 10}" if version else "unknown"


def tf32_enabled() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


@dataclass(frozen=True)
class DeviceMemory:
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    total_bytes: int
    # GPU busy share over the last sample period, 0..1, when NVML is available.
    utilisation: float | None


def read_device_memory(device: torch.device) -> DeviceMemory | None:
    """Memory (and, with NVML, utilisation) of a CUDA device; None on the CPU."""
    if device.type != "cuda":
        return None
    _, total = torch.cuda.mem_get_info(device)
    utilisation = _utilisation(device)
    return DeviceMemory(
        allocated_bytes=torch.cuda.memory_allocated(device),
        reserved_bytes=torch.cuda.memory_reserved(device),
        peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
        total_bytes=total,
        utilisation=utilisation,
    )


class DeviceMemoryCollector(Collector):
    """Memory (allocated, reserved, peak since the last scrape, total), fragmentation
    (CUDA only) and NVML utilisation per worker, read when Prometheus scrapes. A CPU
    worker reports the process's resident memory (every CPU worker the same figures:
    they share the process) and no fragmentation, which glibc does not measure."""

    def __init__(self, devices: Callable[[], Iterable[tuple[str, torch.device]]]) -> None:
        self._devices = devices

    def collect(self) -> Iterator[GaugeMetricFamily]:
        memory = GaugeMetricFamily(
            DEVICE_MEMORY_BYTES,
            "Device memory by kind, in bytes; peak is the most allocated since the last "
            "scrape. CPU workers: the process's resident memory.",
            labels=["worker", "kind"],
        )
        fragmentation = GaugeMetricFamily(
            DEVICE_FRAGMENTATION_BYTES,
            "CUDA caching allocator memory no tensor uses, by kind: reserved_unallocated "
            "(reserved minus allocated) and inactive_split (free parts of split blocks).",
            labels=["worker", "kind"],
        )
        utilisation = GaugeMetricFamily(
            DEVICE_UTILISATION, "Share of time the GPU was busy (NVML), 0..1.", labels=["worker"]
        )
        workers = list(self._devices())
        # Every peak is read before any is reset: CPU workers share the process's.
        with PEAK_WINDOW:
            peaks = [read_peak(device) for _, device in workers]
            for device in {device for _, device in workers}:
                reset_peak(device)
        for (name, device), peak in zip(workers, peaks, strict=True):
            reading = read_memory(device)
            for kind, value in (
                ("allocated", reading.allocated_bytes),
                ("reserved", reading.reserved_bytes),
                ("peak", peak),
                ("total", total_bytes(device)),
            ):
                memory.add_metric([name, kind], value)
            split = split_memory(device)
            if split is not None:
                fragmentation.add_metric(
                    [name, "reserved_unallocated"], split.reserved_unallocated_bytes
                )
                fragmentation.add_metric([name, "inactive_split"], split.inactive_split_bytes)
            busy = _utilisation(device)
            if busy is not None:
                utilisation.add_metric([name], busy)
        yield memory
        yield fragmentation
        yield utilisation


def _utilisation(device: torch.device) -> float | None:
    """NVML's busy share of a CUDA device, 0..1; None on the CPU, or where NVML cannot
    be read (no driver library in the container)."""
    if device.type != "cuda":
        return None
    try:
        return float(torch.cuda.utilization(device)) / 100
    except (ModuleNotFoundError, RuntimeError):
        return None

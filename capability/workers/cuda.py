"""CUDA settings applied once per process, and device-memory readings.

TF32 is off so results are reproducible and match the CPU to fp32 tolerance;
a model that wants TF32's speed should say so by choosing bf16. The caching
allocator uses expandable segments, which avoids the fragmentation that
variable-length batches otherwise cause. Both must be set before CUDA starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from capability.metrics import DEVICE_MEMORY_BYTES, DEVICE_UTILISATION

ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOCATOR_SETTING = "expandable_segments:True"


def configure_cuda_defaults() -> None:
    """Reproducible math and a fragmentation-resistant allocator (an operator's own
    PYTORCH_CUDA_ALLOC_CONF wins)."""
    os.environ.setdefault(ALLOCATOR_ENV, ALLOCATOR_SETTING)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


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
    try:
        utilisation: float | None = torch.cuda.utilization(device) / 100
    except (ModuleNotFoundError, RuntimeError):  # no pynvml / NVML here
        utilisation = None
    return DeviceMemory(
        allocated_bytes=torch.cuda.memory_allocated(device),
        reserved_bytes=torch.cuda.memory_reserved(device),
        peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
        total_bytes=total,
        utilisation=utilisation,
    )


class DeviceMemoryCollector(Collector):
    """CUDA memory (allocated, reserved, peak, total) and NVML utilisation per worker,
    read when Prometheus scrapes; CPU workers report nothing."""

    def __init__(self, devices: Callable[[], Iterable[tuple[str, torch.device]]]) -> None:
        self._devices = devices

    def collect(self) -> Iterator[GaugeMetricFamily]:
        memory = GaugeMetricFamily(
            DEVICE_MEMORY_BYTES, "Device memory by kind, in bytes.", labels=["worker", "kind"]
        )
        utilisation = GaugeMetricFamily(
            DEVICE_UTILISATION, "Share of time the GPU was busy (NVML), 0..1.", labels=["worker"]
        )
        for name, device in self._devices():
            reading: DeviceMemory | None = read_device_memory(device)
            if reading is None:
                continue
            for kind, value in (
                ("allocated", reading.allocated_bytes),
                ("reserved", reading.reserved_bytes),
                ("peak", reading.peak_allocated_bytes),
                ("total", reading.total_bytes),
            ):
                memory.add_metric([name, kind], value)
            if reading.utilisation is not None:
                utilisation.add_metric([name], reading.utilisation)
        yield memory
        yield utilisation

"""Device memory as the model ledger reads it, on every device through one code path.

    reading      allocated and reserved bytes now
    peak         the high-water mark since the last reset, and the reset
    total        what the device holds, the base of the default budget
    release      hand cached, unused blocks back (after a version is retired)
    split        reserved-but-unallocated and inactive split bytes (fragmentation)

On a CUDA device each is the caching allocator's own figure (`torch.cuda.memory_*`).
On the CPU there is no allocator to ask, so the same readings come from the process:
resident memory (`/proc/self/statm`) stands for both allocated and reserved, the
high-water mark is `VmHWM` (`/proc/self/status`, reset by writing 5 to
`/proc/self/clear_refs`), the total is the cgroup's memory limit or else `MemTotal`,
and releasing calls glibc's `malloc_trim`. Fragmentation has no honest CPU figure
(glibc does not report one), so `split` returns None there and nothing is exported.

NOTE: on the CPU every reading is the whole process's: several CPU workers, or a
model serving while another loads, share the same resident memory, so a ledger
entry taken then also counts the others' growth. On CUDA the readings are per device.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

# The `source` of a ledger entry: which readings it was kept from.
SOURCE_CUDA_ALLOCATOR = "cuda_allocator"
SOURCE_PROCESS_RESIDENT = "process_resident"

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_STATM = Path("/proc/self/statm")
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_MEMINFO = Path("/proc/meminfo")
_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")
# What /proc/self/clear_refs takes to reset the peak resident set size (Linux >= 4.0).
_RESET_PEAK_RSS = "5"

# --device-memory-budget 0: this share of the device (on the CPU, of host memory or
# the cgroup's limit). The rest is for what the ledger cannot see: other processes,
# the CUDA context, the serving loops' own Python objects.
DEFAULT_BUDGET_SHARE = 0.8

# Held while a peak is reset and read back (a warm-up measuring its peak, a scrape
# reading the peak of its window), so neither resets the other's window half-way.
# One lock for every device: on the CPU all workers share the process's peak.
PEAK_WINDOW = threading.Lock()


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """Device memory at one moment, in bytes. On the CPU both are the resident set."""

    allocated_bytes: int
    reserved_bytes: int

    def minus(self, earlier: MemoryReading) -> MemoryReading:
        """Growth since `earlier` (negative where memory was given back)."""
        return MemoryReading(
            self.allocated_bytes - earlier.allocated_bytes,
            self.reserved_bytes - earlier.reserved_bytes,
        )


@dataclass(frozen=True, slots=True)
class SplitMemory:
    """How much of the allocator's reserve no tensor uses (CUDA only)."""

    reserved_unallocated_bytes: int
    inactive_split_bytes: int


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Device memory before and after one load stage (capability.bundle.STAGES)."""

    stage: str
    before: MemoryReading
    after: MemoryReading


class LoadWatch(Protocol):
    """What load_bundle asks of the worker it loads for: readings around each stage,
    and whether the weights' bytes may be read onto the device at all (it raises
    to refuse)."""

    def read(self) -> MemoryReading: ...

    def admit_weights(self, weights_bytes: int) -> None: ...


@dataclass(frozen=True)
class MemoryLedger:
    """What one model version costs on one worker's device: the model ledger's entry."""

    source: str  # SOURCE_CUDA_ALLOCATOR or SOURCE_PROCESS_RESIDENT
    weights_bytes: int  # parameters and buffers, exact
    predicted_bytes: int  # the footprint foreseen before any weight was read
    stages: tuple[StageMemory, ...]  # before and after each load stage, in order
    # After the warm-up at the largest batch and length bucket, and the peak during it.
    after_warm_up: MemoryReading
    warm_up_peak_bytes: int
    warm_up_batch_size: int
    warm_up_tokens: int
    # The version whose warm-up measured the overhead beyond the weights that this
    # entry's peak carries (a live reload of a version that computes alike skips the
    # largest warm-up: capability/workers/worker.py); None: measured on this one.
    carried_from: str | None = None

    @property
    def before_load(self) -> MemoryReading:
        return self.stages[0].before if self.stages else self.after_warm_up

    @property
    def loaded(self) -> MemoryReading:
        """Growth over the load stages (warm-up at the largest shape excluded)."""
        last = self.stages[-1].after if self.stages else self.after_warm_up
        return last.minus(self.before_load)

    @property
    def warmed(self) -> MemoryReading:
        """Growth from before the load to after the largest warm-up."""
        return self.after_warm_up.minus(self.before_load)

    @property
    def footprint_bytes(self) -> int:
        """What the version needs on the device at its largest batch: the warm-up peak
        above the memory before its load, and never less than its weights (on the CPU
        freed heap can be reused without the resident set growing)."""
        peak_growth = self.warm_up_peak_bytes - self.before_load.allocated_bytes
        return max(self.weights_bytes, peak_growth)


def memory_source(device: torch.device) -> str:
    return SOURCE_CUDA_ALLOCATOR if device.type == "cuda" else SOURCE_PROCESS_RESIDENT


def read_memory(device: torch.device) -> MemoryReading:
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        return MemoryReading(allocated, torch.cuda.memory_reserved(device))
    resident = _resident_bytes()
    return MemoryReading(resident, resident)


def read_peak(device: torch.device) -> int:
    """Most bytes allocated since the last `reset_peak` (CPU: peak resident set)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_kib("VmHWM") * 1024


def reset_peak(device: torch.device) -> None:
    """Start a new peak window. On the CPU, where the kernel refuses the reset (an old
    kernel, a locked-down /proc), the peak stays the process's lifetime peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)


def total_bytes(device: torch.device) -> int:
    """The device's memory; on the CPU the cgroup's limit where one is set, else RAM."""
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return int(total)
    ram = _meminfo_kib("MemTotal") * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = _CGROUP_LIMIT.read_text().strip()
        if limit != "max":
            return min(ram, int(limit))
    return ram


def budget_bytes(device: torch.device, configured: int) -> int:
    """The device memory budget: `configured` bytes, or 0 for DEFAULT_BUDGET_SHARE."""
    return configured or int(DEFAULT_BUDGET_SHARE * total_bytes(device))


def split_memory(device: torch.device) -> SplitMemory | None:
    """Fragmentation of the caching allocator; None on the CPU (see the module docstring)."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return SplitMemory(
        reserved_unallocated_bytes=int(
            stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
        ),
        inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
    )


def release_cached(device: torch.device) -> None:
    """Collect garbage, then hand the allocator's unused cached blocks back: CUDA's
    `empty_cache`, or on the CPU glibc's `malloc_trim` (a no-op without glibc)."""
    gc.collect()
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    trim: Callable[[int], int] | None = getattr(libc, "malloc_trim", None)
    return trim


def _resident_bytes() -> int:
    # statm: size resident shared text lib data dt, in pages.
    return int(_STATM.read_text().split()[1]) * _PAGE_BYTES


def _status_kib(key: str) -> int:
    return _field_kib(_STATUS, key)


def _meminfo_kib(key: str) -> int:
    return _field_kib(_MEMINFO, key)


def _field_kib(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    raise OSError(f"{path} has no {key}")


def format_bytes(count: float) -> str:
    """Bytes for a person: `312.4 MiB`."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_byte_size(text: str) -> int:
    """`0`, `1048576`, `512MiB`, `2GiB`, `64M` (binary units) as bytes."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = cleaned, ""
    if cleaned and cleaned[-1] in units:
        number, unit = cleaned[:-1], cleaned[-1]
    example = "e.g. 1073741824, 512MiB, 2GiB"
    try:
        return int(float(number) * units[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a size in bytes ({example})") from None
    except OverflowError:
        # float("inf"), 1e400: int() of it raised OverflowError, which the settings
        # parser does not expect, and the server died with a traceback.
        raise ValueError(f"{text!r} is not a finite size in bytes ({example})") from None

"""Memory figures and clean-up for the training device, small and direct.

CUDA figures come from the in-process allocator (`torch.cuda.memory_stats`, one call per
step) and `torch.cuda.mem_get_info`; CPU figures from the host (see monitor/host.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
import time
from typing import Any

import torch

from autotune.monitor.host import describe_host_memory, host_sample
from autotune.oom import is_oom, maybe_not_memory, oom_message
from autotune.snapshot import AllocatorStats, DeviceSample
from autotune.units import format_bytes

_libc: ctypes.CDLL | None | bool = None  # None: not looked up yet; False: not available


def load_libc() -> ctypes.CDLL | None:
    """glibc, loaded once (looking it up can run a subprocess, so do it before any OOM)."""
    global _libc
    if _libc is None:
        name = "libc.so.6" if sys.platform.startswith("linux") else ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    return _libc or None


def _malloc_trim() -> None:
    # glibc keeps freed heap pages; malloc_trim(0) hands them back to the OS, the CPU
    # analogue of empty_cache. Outside glibc there is nothing to do.
    libc = load_libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


_mkl: ctypes.CDLL | None | bool = None


def load_mkl() -> ctypes.CDLL | None:
    """The MKL inside torch's CPU library, for freeing its buffer cache; None if not there."""
    global _mkl
    if _mkl is None:
        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        try:
            lib = ctypes.CDLL(path)
            _mkl = lib if hasattr(lib, "mkl_serv_free_buffers") else False
        except OSError:
            _mkl = False
    return _mkl or None


def free_cpu_caches() -> None:
    """Hand back what CPU libraries cache: MKL's buffers (kept at the size of the largest
    matrix product seen, so a larger micro-batch leaves the old ones mapped) and glibc's
    freed heap pages."""
    mkl = load_mkl()
    if mkl is not None:
        mkl.mkl_serv_free_buffers()
    _malloc_trim()


def free_memory(device: torch.device) -> None:
    """Collect garbage and return cached memory to the device (CUDA) or the OS (CPU)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "cpu":
        free_cpu_caches()


def device_sample(device: torch.device, soft_cap_bytes: int | None = None) -> DeviceSample:
    """Memory in use against the cap that binds on `device`."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceSample(time=time.time(), used_bytes=total - free, cap_bytes=soft_cap_bytes or total,
                            total_bytes=total, source="cuda")
    return host_sample(soft_cap_bytes)


def cuda_uuid(device: torch.device) -> str | None:
    """The UUID of a CUDA device, for finding it in NVML (indexes differ under
    CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER); None for other devices."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def allocator_stats(device: torch.device, reset_peak: bool = True) -> AllocatorStats | None:
    """The CUDA caching allocator's figures since the last reset; None on other devices."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return AllocatorStats(
        allocated_bytes=stats.get("allocated_bytes.all.current", 0),
        reserved_bytes=stats.get("reserved_bytes.all.current", 0),
        peak_bytes=stats.get("allocated_bytes.all.peak", 0),
        reserved_peak_bytes=stats.get("reserved_bytes.all.peak", 0),
        num_alloc_retries=stats.get("num_alloc_retries", 0),
        num_ooms=stats.get("num_ooms", 0),
        inactive_split_bytes=stats.get("inactive_split_bytes.all.current", 0),
    )


def describe_memory(device: torch.device) -> str:
    """One line of memory figures for messages: allocator and device on CUDA, host on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (f"allocated {format_bytes(torch.cuda.memory_allocated(device))}, "
                f"reserved {format_bytes(torch.cuda.memory_reserved(device))}, "
                f"device free {format_bytes(free)} of {format_bytes(total)}")
    return describe_host_memory()


class StepPeak:
    """The peak memory of one training step, for how much a step *demands*.

    CUDA: the caching allocator's peak of allocated bytes (reset every step). CPU: the
    process's peak resident size (VmHWM), reset through /proc/self/clear_refs; where that
    is not possible (not Linux, no permission) the CPU peak is not available (None).
    """

    _CLEAR_REFS = "/proc/self/clear_refs"
    _STATUS = "/proc/self/status"

    def __init__(self, device: torch.device):
        self.device = device
        # Opened once and kept: an open() per step costs more than the read itself (a ~1 ms step
        # pays for every microsecond here). Unbuffered: each read regenerates the figures.
        self._clear: Any = None
        self._status: Any = None
        self.available = device.type == "cuda" or self._open_host()

    def _open_host(self) -> bool:
        try:
            self._clear = open(self._CLEAR_REFS, "wb", buffering=0)
            self._status = open(self._STATUS, "rb", buffering=0)
            return self._reset_host()
        except OSError:
            return False

    def _reset_host(self) -> bool:
        try:
            self._clear.write(b"5")  # 5: reset the peak resident size to the current one
            return True
        except OSError:
            return False

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.available:
            self._reset_host()

    def current(self) -> int | None:
        """Memory in use now, in the same measure as `peak`."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._status_bytes(b"VmRSS:") if self.available else None

    def peak(self) -> int | None:
        """The peak since `start`."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._status_bytes(b"VmHWM:") if self.available else None

    def _status_bytes(self, field: bytes) -> int | None:
        try:
            self._status.seek(0)
            text = self._status.read()
            at = text.index(field) + len(field)
            return int(text[at:text.index(b"kB", at)]) * 1024
        except (OSError, ValueError):
            return None


class StepDemand:
    """What a step demands: its peak memory less what was in use when the room was measured,
    over the room the cap left then (weights, libraries and the cap as they were). Near 1: the
    step barely fits. None where the step peak cannot be measured."""

    def __init__(self, device: torch.device, cap_bytes: int | None):
        self.device, self.cap_bytes = device, cap_bytes
        self.peak = StepPeak(device)
        self.room: tuple[int, int] | None = None  # (memory in use, room left under the cap)
        self.last: float | None = None  # the last step's demand

    def measure_room(self) -> None:
        """Measure the room now: at the start of a fit, and after a relief changed what stays resident."""
        sample = device_sample(self.device, self.cap_bytes)
        in_use = self.peak.current()
        if sample.cap_bytes is None or sample.used_bytes is None or in_use is None:
            self.room = None
        else:
            self.room = (in_use, sample.cap_bytes - sample.used_bytes)

    def start(self) -> None:
        self.peak.start()

    def finish(self) -> float | None:
        """The demand of the step since `start` (also kept as `last`)."""
        peak = self.peak.peak()
        if peak is None or self.room is None or self.room[1] <= 0:
            self.last = None
        else:
            self.last = max(0, peak - self.room[0]) / self.room[1]
        return self.last


def memory_text(device: torch.device, cap_bytes: int | None) -> str:
    """Memory in use (and free under the cap) for a progress bar."""
    sample = device_sample(device, cap_bytes)
    if sample.cap_bytes and sample.used_bytes is not None:
        return f"{format_bytes(sample.used_bytes)} ({format_bytes(sample.cap_bytes - sample.used_bytes)} free)"
    return format_bytes(sample.used_bytes)


def warm_up_oom_path(device: torch.device, cap_bytes: int | None) -> None:
    """Under a hard memory cap anything may fail to allocate, including a lazy import or a
    first-time library lookup. Run the OOM path's helpers once, while there is memory, so the
    path itself needs next to nothing later."""
    warm_up = RuntimeError("warm-up")
    is_oom(warm_up), maybe_not_memory(warm_up), oom_message(warm_up)
    load_libc()
    load_mkl()
    describe_memory(device)
    memory_text(device, cap_bytes)

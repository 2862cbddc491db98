"""Memory figures and clean-up for the training device, small and direct.

CUDA figures come from the in-process allocator (`torch.cuda.memory_stats`, one call per
step) and `torch.cuda.mem_get_info`; CPU figures from the host (see monitor/host.py).

Owns: reading memory figures and freeing caches (gc, the allocator, glibc's heap), and how
autotune's own threads start under an address-space cap. What a step demands is demand.py's.
Touches nothing of the model or the optimizer.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys
import threading
import time
from typing import Iterator

import torch
from loguru import logger

from autotune.common.oom import is_oom, maybe_not_memory, oom_message
from autotune.common.snapshot import AllocatorStats, DeviceSample
from autotune.common.units import format_bytes
from autotune.memory import onednn
from autotune.memory.onednn import clear_jit_error, flush_kernel_cache
from autotune.monitor.host import describe_host_memory, host_sample

_libc: ctypes.CDLL | None | bool = None  # None: not looked up yet; False: not available


def with_cuda_index(device: torch.device) -> torch.device:
    """`device`, and for "cuda" without an index the current CUDA device's, "cuda:N"."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
    matrix product seen, so a larger micro-batch leaves the old ones mapped), oneDNN's
    compiled kernels (one set per shape on CPUs with native bf16) and glibc's freed heap
    pages. Also clears the error a refused allocation leaves in oneDNN's JIT on this thread,
    which would fail every kernel it compiles later (onednn.py)."""
    mkl = load_mkl()
    if mkl is not None:
        mkl.mkl_serv_free_buffers()
    clear_jit_error()
    flush_kernel_cache()
    _malloc_trim()


def free_memory(device: torch.device) -> None:
    """Collect garbage and return cached memory to the device (CUDA) or the OS (CPU)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "cpu":
        free_cpu_caches()


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """A full gc.collect() after an OOM walks every object torch and the user's code created
    (~0.2 s). Freezing what exists now leaves it only the objects made inside (a failed
    attempt's among them). Nothing is frozen if the caller froze already."""
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


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


# The caching allocator's figures autotune reads, by the names `torch.cuda.memory_stats()` gives them.
ALLOCATOR_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "peak_bytes": "allocated_bytes.all.peak",
    "reserved_peak_bytes": "reserved_bytes.all.peak",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
}


def allocator_stats(device: torch.device, reset_peak: bool = True) -> AllocatorStats | None:
    """The CUDA caching allocator's figures since the last reset; None on other devices. Before
    CUDA allocates anything `memory_stats()` is empty: every figure is 0 then. A key it lacks
    otherwise (renamed by a torch release, or another allocator plugged in) is an error that
    names it: read as 0, it would turn sizing and pressure blind without a word."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    if not stats:
        return AllocatorStats(**dict.fromkeys(ALLOCATOR_KEYS, 0))
    missing = [key for key in ALLOCATOR_KEYS.values() if key not in stats]
    if missing:
        raise RuntimeError(f"torch.cuda.memory_stats() on {device} has no {', '.join(map(repr, missing))} (torch "
                           f"{torch.__version__}; {len(stats)} keys, e.g. {', '.join(sorted(stats)[:4])}): autotune "
                           "sizes micro-batches and sees allocator pressure from these figures")
    return AllocatorStats(**{field: stats[key] for field, key in ALLOCATOR_KEYS.items()})


def cuda_reserved_cap(device: torch.device, soft_cap_bytes: int | None = None) -> tuple[int, int]:
    """(cap, outside): the most this process's caching allocator may reserve on `device`, and
    what the device holds outside it now (the CUDA context, other processes). The allocator is
    refused past a per-process fraction of the total (`set_per_process_memory_fraction`, which
    `memory_cap` sets) counted in its own reserved bytes alone, and the device past what is free;
    the cap is the smaller. Where torch cannot say the fraction (an older release), `soft_cap_bytes`
    (the memory_cap that set it) stands in."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    by_fraction = int(fraction(device) * total) if fraction is not None else soft_cap_bytes or total
    return min(by_fraction, reserved + free), max(0, total - free - reserved)


def describe_memory(device: torch.device) -> str:
    """One line of memory figures for messages: allocator and device on CUDA, host on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (f"allocated {format_bytes(torch.cuda.memory_allocated(device))}, "
                f"reserved {format_bytes(torch.cuda.memory_reserved(device))}, "
                f"device free {format_bytes(free)} of {format_bytes(total)}")
    return describe_host_memory()


SAMPLER_STACK_BYTES = 256 * 1024


def start_with_small_stack(thread: threading.Thread, stack_bytes: int = SAMPLER_STACK_BYTES) -> None:
    """Start one of autotune's own threads with a small stack: RLIMIT_AS counts a thread's whole
    stack reservation (8 MiB by default), and autotune's threads only read files, sleep and write.
    (threading.stack_size is the process's setting: set for this start only.)"""
    previous = threading.stack_size(stack_bytes)
    try:
        thread.start()
    finally:
        threading.stack_size(previous)


def one_arena_under_an_address_space_cap() -> bool:
    """Under RLIMIT_AS, make every thread allocate from glibc's main arena (`mallopt(M_ARENA_MAX,
    1)`); True if the cap is there and it was done. A thread's first allocation otherwise reserves
    an arena of its own, 64 MiB of address space that the cap counts: the first thread autotune
    starts (the step's virtual-peak sampler, a checkpoint writer) took 64 MiB of a 320 MiB cap,
    whatever it did (issue 34). Without a cap nothing changes: the reservation costs nothing then."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return False
    libc = load_libc()
    if libc is None or not hasattr(libc, "mallopt") or not libc.mallopt(M_ARENA_MAX, 1):
        return False
    logger.info("RLIMIT_AS is set: every thread allocates from one malloc arena (a thread's own arena would "
                "reserve 64 MiB of the cap)")
    return True


M_ARENA_MAX = -8  # glibc's mallopt parameter


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
    if device.type == "cpu" and cap_bytes is not None:
        onednn.available()  # finds oneDNN's functions now (~0.1 s), not after the first OOM
    describe_memory(device)
    memory_text(device, cap_bytes)

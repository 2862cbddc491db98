"""Caps a process can put on itself: RLIMIT_AS on CPU, the allocator fraction on CUDA.

Used by the demo, the tests and the benchmarks to make real out-of-memory errors happen
on purpose. RLIMIT_AS counts virtual address space, which grows the first time threads
and libraries warm up (each glibc malloc arena reserves 64 MiB of it), so the cap is set
relative to the virtual size *after* a warm-up step.
"""

from __future__ import annotations

import resource

import torch

from autotune.memory import load_libc
from autotune.monitor.host import virtual_bytes


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameters
_M_ARENA_MAX = -8


def single_malloc_arena() -> None:
    """Make every thread allocate from glibc's main arena. Call it before threads start
    allocating (before the first parallel torch op), or set MALLOC_ARENA_MAX=1.

    When an allocation is refused under RLIMIT_AS, glibc may fall back to reserving a new
    64 MiB heap for a thread's arena; such reservations count against the cap, and
    malloc_trim cannot release them. With one arena the failed attempt leaves nothing
    behind, so the micro-batch that fits is the same on every run.
    """
    libc = load_libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_ARENA_MAX, 1)


def fix_mmap_threshold(threshold: int = 128 * 1024) -> None:
    """Send every block over `threshold` to mmap (returned to the OS on free): call it before a
    warm-up, so the memory the warm-up frees does not stay mapped and widen a cap set after it."""
    # glibc raises its mmap threshold after big blocks are freed, after which big tensors
    # come from the heap and freed ones may stay mapped: virtual size then drifts up with
    # fragmentation and the same batch fails later in the run. A fixed threshold sends
    # every big block to mmap and back to the OS on free, so virtual size follows live memory.
    libc = load_libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)


def cap_address_space(headroom_bytes: int) -> int:
    """Set the soft RLIMIT_AS to the current virtual size plus `headroom_bytes`; return the cap.

    Only the soft limit changes, so `lift_address_space_cap()` can undo it. Also fixes
    glibc's mmap threshold so the cap measures live memory rather than heap drift.
    """
    fix_mmap_threshold()
    current = virtual_bytes()
    if current is None:
        raise RuntimeError("cannot read this process's virtual size to set RLIMIT_AS")
    cap = current + int(headroom_bytes)
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and cap > hard:
        cap = hard
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return cap


def lift_address_space_cap() -> None:
    """Raise the soft RLIMIT_AS back to the hard limit."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def cap_cuda_memory(device: torch.device, cap_bytes: int) -> float:
    """Limit the CUDA caching allocator on `device` to `cap_bytes`; return the fraction set."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cap_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction

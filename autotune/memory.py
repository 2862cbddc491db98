"""Memory figures and clean-up for the training device, small and direct.

CUDA figures come from the in-process allocator (`torch.cuda.memory_stats`, one call per
step) and `torch.cuda.mem_get_info`; CPU figures from the host (see monitor/host.py).

Owns: reading memory figures and freeing caches (gc, the allocator, glibc's heap), the step's
demand (StepDemand) and the sampler thread. Touches nothing of the model or the optimizer.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import os
import sys
import threading
import time
from typing import Any, Iterator

import torch
from loguru import logger

from autotune.monitor.host import describe_host_memory, host_sample
from autotune import onednn
from autotune.onednn import clear_jit_error, flush_kernel_cache
from autotune.oom import is_oom, maybe_not_memory, oom_message
from autotune.snapshot import AllocatorStats, DeviceSample, StepMemory
from autotune.units import format_bytes

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


class StepPeak:
    """The peak memory of one training step, for how much a step *demands*.

    CUDA: the caching allocator's peak of allocated bytes (reset every step). CPU: the
    process's peak resident size (VmHWM), reset through /proc/self/clear_refs; where that
    is not possible (not Linux, no permission) the CPU peak is not available (None).
    `status()` reads the CPU figures at once: peak and current, virtual and resident.
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
        status = self.status()
        return status.resident if status else None

    def peak(self) -> int | None:
        """The peak since `start`."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        status = self.status()
        return status.resident_peak if status else None

    def status(self) -> "HostStatus | None":
        """This process's virtual and resident sizes and their peaks (CPU, Linux), in one read."""
        if self._status is None:
            return None
        try:
            self._status.seek(0)
            text = self._status.read()
            return HostStatus(*(_kib_field(text, name) for name in (b"VmPeak:", b"VmSize:", b"VmHWM:", b"VmRSS:")))
        except (OSError, ValueError):
            return None


@dataclasses.dataclass(frozen=True)
class HostStatus:
    """/proc/self/status in bytes: the virtual size (what RLIMIT_AS binds) and the resident size,
    each with its peak (the virtual peak is over the process's life; the resident one since `start`)."""

    virtual_peak: int
    virtual: int
    resident_peak: int
    resident: int


def _kib_field(text: bytes, name: bytes) -> int:
    at = text.index(name) + len(name)
    return int(text[at:text.index(b"kB", at)]) * 1024


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
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, 1))


M_ARENA_MAX = -8  # glibc's mallopt parameter


class _VirtualPeakSampler:
    """The virtual size, read every `period` seconds on a thread while a step runs: the peak of
    a step when the process's own virtual peak (which cannot be reset) is higher from before."""

    def __init__(self, period: float = 0.0005):
        self.period = period
        self.peak = 0
        self._running = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, name="autotune-virtual-peak", daemon=True)
        # It often starts under the cap, at a run's first measured step (it only reads /proc and
        # sleeps). Measured: a Lightning bf16 run needed 24 MiB of headroom with the default stack
        # where plain Lightning needed 14.
        start_with_small_stack(self._thread)

    def _virtual(self) -> int:
        try:  # the first field of statm: the virtual size in pages
            return int(os.pread(self._statm, 64, 0).split(b" ", 1)[0]) * self._page
        except (OSError, ValueError, MemoryError):  # a read that failed (out of memory itself): none this time
            return 0

    def _run(self) -> None:
        while True:
            self._running.wait()
            self._idle.clear()
            while self._running.is_set():
                self.peak = max(self.peak, self._virtual())
                time.sleep(self.period)
            self._idle.set()

    def begin(self) -> None:
        self.peak = self._virtual()
        self._running.set()

    def end(self) -> int:
        self._running.clear()
        self._idle.wait()
        return max(self.peak, self._virtual())


_sampler: _VirtualPeakSampler | None | bool = None  # one per process; False: it could not start


def virtual_peak_sampler() -> _VirtualPeakSampler | None:
    """The process's sampler, started on first use (call it while there is room: a thread
    reserves its stack, which RLIMIT_AS counts)."""
    global _sampler
    if _sampler is None:
        try:
            _sampler = _VirtualPeakSampler()
        except (OSError, RuntimeError) as exc:
            logger.debug(f"no virtual-size sampler: {exc}")
            _sampler = False
    return _sampler or None


class StepDemand:
    """What a step needs: its peak memory above what was in use when it began, against the room
    the cap left then, in the measure the cap binds. Near 1: the step barely fits.

    - CUDA: in the caching allocator's reserved bytes, what a cap binds (`cuda_reserved_cap`: the
      per-process fraction, or what the device has free beside the context and other processes):
      the peak of live tensors plus what the allocator wasted reserving them (`cuda_need`), against
      the cap less what is allocated now.
    - CPU under RLIMIT_AS: the virtual size (what the limit counts). Its peak is the process's
      lifetime peak, so it measures a step exactly only when the step set a new one; the first
      step at a size that did not is sampled on a thread, and other steps are estimated from
      their resident peak and the last exact gap between the two (`StepMemory.exact` False).
    - CPU under a cgroup, a soft cap or the host: the resident size (its peak is reset each step).
    None where no peak can be measured.
    """

    def __init__(self, device: torch.device, cap_bytes: int | None):
        self.device, self.cap_bytes = device, cap_bytes
        self.peak = StepPeak(device)
        self.last: float | None = None  # the last step's need over its room
        self.last_memory: StepMemory | None = None
        self.allocator: AllocatorStats | None = None  # CUDA: the last step's allocator figures
        self._cap: int | None = None  # the binding cap, in its measure
        self._others = 0  # CUDA: device memory others hold (and the context)
        self._room_at: tuple[int, int] | None = None  # resident caps: (in use, room) when measured
        self._virtual = False  # the cap counts virtual size
        self._in_use: int | None = None  # at the start of this step, in the binding measure
        self._resident_start: int | None = None
        self._virtual_peak_before = 0
        self._gap: int | None = None  # virtual need above resident need, last measured exactly
        self._exact_sizes: set[int] = set()  # sizes measured exactly since the last change
        # Started now, before any cap is likely set: a thread reserves its stack, which RLIMIT_AS counts.
        self._sampler = virtual_peak_sampler() if device.type == "cpu" and self.peak.available else None
        self._sampling = False
        self._micro: int | None = None
        self._reserved_start = 0  # CUDA: the allocator's reserved bytes when the step began
        self.at_failure: tuple[int | None, int, int | None] | None = None  # see note_failure

    def measure_room(self) -> None:
        """Find the binding cap and what is in use: at the start of a fit, after an OOM, and after
        a relief changed what stays resident. Later steps are measured against it cheaply."""
        self._exact_sizes.clear()
        self._cap = self._room_at = None
        if self.device.type == "cuda":
            self._cap, self._others = cuda_reserved_cap(self.device, self.cap_bytes)
            self._in_use = torch.cuda.memory_allocated(self.device)
            return
        sample = device_sample(self.device, self.cap_bytes)
        if sample.cap_bytes is None or sample.used_bytes is None or not self.peak.available:
            self._in_use = None
            return
        status = self.peak.status()
        if status is None:
            self._in_use = None
            return
        self._virtual = sample.source == "rlimit_as"
        if self._virtual:
            self._cap = sample.cap_bytes
        else:
            self._room_at = (status.resident, sample.cap_bytes - sample.used_bytes)
        self._start_from(status)

    def _start_from(self, status: HostStatus) -> None:
        # What a step is measured against (CPU): in use, in the binding measure; resident; the virtual peak.
        self._in_use = status.virtual if self._virtual else status.resident
        self._resident_start = status.resident
        self._virtual_peak_before = status.virtual_peak

    def _rebase(self) -> None:
        # What `_measure` keeps from one measured step for the next, read now.
        if self._in_use is None:
            return  # nothing to measure against (no cap, no peak)
        if self.device.type == "cuda":
            self._in_use = torch.cuda.memory_allocated(self.device)
            return
        status = self.peak.status()
        if status is None:
            self._in_use = None
            return
        self._start_from(status)

    @property
    def measure(self) -> str:
        """What the cap binds, in which `need_bytes` and `held_now()` are counted."""
        return "cuda" if self.device.type == "cuda" else "virtual" if self._virtual else "resident"

    @property
    def held_at_start(self) -> int | None:
        """What was in use when the step began (or when the room was last measured)."""
        return self._in_use

    @property
    def binding_cap(self) -> int | None:
        """The cap in the same measure: on CUDA on this process's reserved bytes (cuda_reserved_cap)."""
        if self.device.type == "cuda" or self._virtual:
            return self._cap
        return None if self._room_at is None else self._room_at[0] + self._room_at[1]

    def note_failure(self, gradients: int) -> None:
        """In an OOM's except block, while the failed step's tensors are alive, for the breakdown:
        what is held (`held_now`), the `gradients` among it, and on CUDA what the caching allocator
        holds beside live tensors (reserved - allocated: its cache and fragments)."""
        cached = (torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
                  if self.device.type == "cuda" else None)
        self.at_failure = (self.held_now(), gradients, cached)

    def take_failure(self) -> tuple[int | None, int, int | None]:
        """What `note_failure` read (held, gradients, allocator cache), now taken; (None, 0, None) if nothing."""
        reading, self.at_failure = self.at_failure, None
        return reading or (None, 0, None)

    @property
    def others_bytes(self) -> int | None:
        """CUDA: what the device holds outside this process's allocator (the context, other processes)."""
        return self._others if self.device.type == "cuda" and self._cap is not None else None

    def held_now(self) -> int | None:
        """What is in use now, in the measure the cap binds (one read: cheap enough for an OOM's except block)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        status = self.peak.status()
        if status is None:
            return None
        return status.virtual if self._virtual else status.resident

    def start(self, micro_batch_size: int | None = None, rebase: bool = False) -> None:
        """At the start of a step (and of each retry of it). `rebase`: steps ran unmeasured since
        the last measured one, so what is in use now is read afresh."""
        if rebase:
            self._rebase()
        if self.device.type == "cuda":
            self._reserved_start = torch.cuda.memory_reserved(self.device)
        self.peak.start()
        self._micro = micro_batch_size
        self._sampling = (self._virtual and self._sampler is not None and micro_batch_size is not None
                          and micro_batch_size not in self._exact_sizes)
        if self._sampling:
            self._sampler.begin()

    def finish(self) -> float | None:
        """The need of the step since `start` (kept as `last_memory`; its share of the room as `last`)."""
        memory = self._measure()
        self.last_memory = memory
        self.last = memory.need_bytes / memory.room_bytes if memory is not None and memory.room_bytes > 0 else None
        return self.last

    def _measure(self) -> "StepMemory | None":
        if self.device.type == "cuda":
            stats = self.allocator = allocator_stats(self.device, reset_peak=False)
            in_use, self._in_use = self._in_use, stats.allocated_bytes
            if in_use is None or self._cap is None:
                return None
            return StepMemory(self._micro, cuda_need(in_use, self._reserved_start, stats), self._cap - in_use, True,
                              kept_bytes=stats.allocated_bytes - in_use)
        sampled = self._sampler.end() if self._sampling else None
        self._sampling = False
        status = self.peak.status()
        in_use, resident_start = self._in_use, self._resident_start
        if status is None or in_use is None or resident_start is None:
            return None
        resident_need = max(0, status.resident_peak - resident_start)
        self._resident_start = status.resident
        if not self._virtual:
            self._in_use = status.resident
            measured_resident, room = self._room_at
            return StepMemory(self._micro, resident_need, room - (resident_start - measured_resident), True,
                              kept_bytes=status.resident - resident_start)
        self._in_use = status.virtual
        room = self._cap - in_use
        exact = True
        if status.virtual_peak > self._virtual_peak_before:  # a new lifetime peak: this step's
            need = status.virtual_peak - in_use
        elif sampled is not None:
            need = sampled - in_use
        else:
            need, exact = resident_need + (self._gap or 0), False
        self._virtual_peak_before = status.virtual_peak
        if exact:
            self._gap = max(0, need - resident_need)
            if self._micro is not None:
                self._exact_sizes.add(self._micro)
        return StepMemory(self._micro, max(0, need), room, exact, kept_bytes=status.virtual - in_use, kept_is_heap=True)


def cuda_need(allocated_start: int, reserved_start: int, stats: AllocatorStats) -> int:
    """A CUDA step's need in the unit the cap binds, this process's reserved bytes: its peak of
    live tensors above those it began with, plus what the allocator reserved beyond that peak
    and beyond what it held already (rounding, and fragments no request could use). Blocks
    cached from earlier, larger steps are not charged: the step reused them."""
    wasted = max(0, stats.reserved_peak_bytes - max(reserved_start, stats.peak_bytes))
    return max(0, stats.peak_bytes - allocated_start) + wasted


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

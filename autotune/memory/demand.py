"""What a step demands: its peak memory above what it began with, against the room the cap left.

`StepPeak` reads a step's peak (the CUDA allocator's, or the process's resident or virtual size
on CPU); `StepDemand` turns it into the step's demand in the measure the cap binds, for the
cadence (cadence.py) on the batches it measures and for the policies near the cap.

Owns: the peak readers and the virtual-size sampler thread. Touches nothing of the model.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from typing import Any

import torch
from loguru import logger

from autotune.common.snapshot import AllocatorStats, StepMemory
from autotune.memory.figures import allocator_stats, cuda_reserved_cap, device_sample, start_with_small_stack


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
        self.on_cuda = device.type == "cuda"  # asked once: a torch.device's .type is a slow read (~0.25 us)
        # Opened once and kept: an open() per step costs more than the read itself (a ~1 ms step
        # pays for every microsecond here). Unbuffered: each read regenerates the figures.
        self._clear: Any = None
        self._status: Any = None
        self.available = device.type == "cuda" or self._open_host()
        # Closed by `close()`, or when this object goes (a Tuner never closed): never left to the GC's warning.
        self._finalizer = weakref.finalize(self, _close_files, self._clear, self._status)

    def close(self) -> None:
        """Close the /proc files (idempotent); the CPU figures are not available after."""
        self._finalizer()

    def _open_host(self) -> bool:
        try:
            self._clear = open(self._CLEAR_REFS, "wb", buffering=0)
            self._status = open(self._STATUS, "rb", buffering=0)
            return self._reset_host()
        except OSError:
            _close_files(self._clear, self._status)
            self._clear = self._status = None
            return False

    def _reset_host(self) -> bool:
        try:
            self._clear.write(b"5")  # 5: reset the peak resident size to the current one
            return True
        except (OSError, ValueError):  # ValueError: closed
            return False

    def start(self) -> None:
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.available:
            self._reset_host()

    def current(self) -> int | None:
        """Memory in use now, in the same measure as `peak`."""
        if self.on_cuda:
            return torch.cuda.memory_allocated(self.device)
        status = self.status()
        return status.resident if status else None

    def peak(self) -> int | None:
        """The peak since `start`."""
        if self.on_cuda:
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


def _close_files(*files: Any) -> None:
    for file in files:
        if file is not None:
            file.close()


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
        self.on_cuda = device.type == "cuda"  # asked once: a torch.device's .type is a slow read (~0.25 us)
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
        if self.on_cuda:
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
        if self.on_cuda:
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
        return "cuda" if self.on_cuda else "virtual" if self._virtual else "resident"

    @property
    def held_at_start(self) -> int | None:
        """What was in use when the step began (or when the room was last measured)."""
        return self._in_use

    @property
    def binding_cap(self) -> int | None:
        """The cap in the same measure: on CUDA on this process's reserved bytes (cuda_reserved_cap)."""
        if self.on_cuda or self._virtual:
            return self._cap
        return None if self._room_at is None else self._room_at[0] + self._room_at[1]

    def note_failure(self, gradients: int) -> None:
        """In an OOM's except block, while the failed step's tensors are alive, for the breakdown:
        what is held (`held_now`), the `gradients` among it, and on CUDA what the caching allocator
        holds beside live tensors (reserved - allocated: its cache and fragments)."""
        cached = (torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
                  if self.on_cuda else None)
        self.at_failure = (self.held_now(), gradients, cached)

    def take_failure(self) -> tuple[int | None, int, int | None]:
        """What `note_failure` read (held, gradients, allocator cache), now taken; (None, 0, None) if nothing."""
        reading, self.at_failure = self.at_failure, None
        return reading or (None, 0, None)

    @property
    def others_bytes(self) -> int | None:
        """CUDA: what the device holds outside this process's allocator (the context, other processes)."""
        return self._others if self.on_cuda and self._cap is not None else None

    def held_now(self) -> int | None:
        """What is in use now, in the measure the cap binds (one read: cheap enough for an OOM's except block)."""
        if self.on_cuda:
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
        if self.on_cuda:
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
        if self.on_cuda:
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

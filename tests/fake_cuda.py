"""A scripted CUDA caching allocator's figures, for what this machine cannot have: the few
torch.cuda calls memory/figures.py reads (mem_get_info, memory_reserved/allocated, memory_stats, the
peak reset, the per-process fraction), set by a test as a GPU would report them."""

from __future__ import annotations

import dataclasses

import torch

MiB = 2**20


@dataclasses.dataclass
class FakeAllocator:
    total: int = 80 * 1024 * MiB
    outside: int = 500 * MiB  # the CUDA context and other processes
    allocated: int = 0
    reserved: int = 0
    allocated_peak: int = 0
    reserved_peak: int = 0
    fraction: float = 1.0
    missing: tuple[str, ...] = ()  # keys memory_stats() leaves out (a renamed one)
    empty: bool = False  # memory_stats() before CUDA allocated anything

    def install(self, monkeypatch) -> "FakeAllocator":
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.total - self.outside - self.reserved,
                                                                       self.total))
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.allocated_peak)
        monkeypatch.setattr(cuda, "memory_stats", lambda device=None: self.stats())
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: self.reset_peak())
        monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device=None: self.fraction)
        return self

    def reset_peak(self) -> None:
        self.allocated_peak, self.reserved_peak = self.allocated, self.reserved

    def step(self, peak_live: int, reserved_peak: int) -> None:
        """A step that held `peak_live` bytes at its peak, the allocator `reserved_peak` then;
        back to what it held before, its reserve kept (the cache)."""
        self.allocated_peak = max(self.allocated_peak, peak_live)
        self.reserved_peak = max(self.reserved_peak, reserved_peak)
        self.reserved = max(self.reserved, reserved_peak)

    def stats(self) -> dict[str, int]:
        if self.empty:
            return {}
        stats = {"allocated_bytes.all.current": self.allocated, "reserved_bytes.all.current": self.reserved,
                 "allocated_bytes.all.peak": self.allocated_peak, "reserved_bytes.all.peak": self.reserved_peak,
                 "num_alloc_retries": 0, "num_ooms": 0, "inactive_split_bytes.all.current": 0}
        return {k: v for k, v in stats.items() if k not in self.missing}

"""CUDA allocation history for OOMs: `AutoTrainer(memory_snapshot=True)`.

While it is on, PyTorch's caching allocator keeps its last `max_entries` allocations and frees
with their Python stacks (Python only: C++ stacks are what made a torchtitan dump take 461 s
instead of 4). At an OOM the allocator's state is taken in the step's `except` block, while the
failed step's tensors are still alive, and written after the clean-up as
`run_dir/oom-<step>.pickle`: drop it on https://pytorch.org/memory_viz. The journal's `oom`
record, and `autotune report`, carry the largest allocation sites of that moment.

A site is the innermost frame outside torch's own files: the line of the model, the loss or
autotune's step that asked for the memory.

Owns: the allocator's history recording and `oom-<step>.pickle`. Touches the CUDA allocator's
recording switch only.
"""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class AllocationHistory:
    """The allocation history of one CUDA device, on from `start()` to `stop()`."""

    @classmethod
    def asked(cls, memory_snapshot: bool | int, device: torch.device) -> "AllocationHistory | None":
        """The history `memory_snapshot` asks for (True: the last 100,000 allocations; a number:
        that many), or None for False."""
        if not memory_snapshot:
            return None
        return cls(device, max_entries=100_000 if memory_snapshot is True else memory_snapshot)

    def __init__(self, device: torch.device, max_entries: int = 100_000):
        if device.type != "cuda":
            raise ValueError(f"memory_snapshot=True needs a CUDA device (its allocator keeps the history); "
                             f"this run trains on {device}")
        self.device, self.max_entries = device, max_entries
        self.on = False
        self.at_failure: dict[str, Any] | None = None

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=self.max_entries, device=self.device)
        self.on = True

    def stop(self) -> None:
        if self.on:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            self.on = False

    def take_at_failure(self) -> None:
        """The allocator's state now (in an OOM's `except` block)."""
        if self.on:
            self.at_failure = torch.cuda.memory._snapshot(self.device)

    def write(self, run_dir: Path, step: int) -> dict[str, Any] | None:
        """Write the state taken at the failure; its path and largest sites, or None if none was taken."""
        snapshot, self.at_failure = self.at_failure, None
        if snapshot is None:
            return None
        path = Path(run_dir) / f"oom-{step}.pickle"
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        return {"path": str(path), "largest_sites": largest_sites(snapshot), "refused": refused(snapshot)}


def largest_sites(snapshot: dict[str, Any], top: int = 5) -> list[dict[str, Any]]:
    """The `top` sites holding the most memory in live tensors, in a snapshot of the allocator."""
    held: collections.Counter[str] = collections.Counter()
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") == "active_allocated":
                held[site(block.get("frames", []))] += block.get("requested_size", block.get("size", 0))
    return [{"site": name, "bytes": size} for name, size in held.most_common(top)]


def refused(snapshot: dict[str, Any]) -> dict[str, Any] | None:
    """The allocation that failed (the history's last `oom` entry): its size and site; None if not kept."""
    for traces in snapshot.get("device_traces", []):
        for entry in reversed(traces):
            if entry.get("action") == "oom":
                return {"site": site(entry.get("frames", [])), "bytes": entry.get("size", 0)}
    return None


def site(frames: list[dict[str, Any]]) -> str:
    """Where an allocation came from: the innermost frame outside torch (the stack is innermost first)."""
    for frame in frames:
        if not frame.get("filename", "").startswith(_TORCH_DIR):
            return f"{frame['filename']}:{frame.get('line', '?')} in {frame.get('name', '?')}"
    if frames:
        return f"{frames[0]['filename']}:{frames[0].get('line', '?')} in {frames[0].get('name', '?')}"
    return "no Python stack (autograd's backward thread, or C++)"

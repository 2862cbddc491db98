"""Where the memory went at an OOM: weights, gradients, optimizer state, the step's activations and
temporaries, libraries, the rest, against the cap, each part where it is known.

Two readings make it: one when the step began (what was in use, in the measure the cap binds:
`demand.StepDemand`) and one at the failure, taken in the step's `except` block while the failed
step's tensors are still alive (`held_now`). The tensors' parts are summed from the model and the
optimizer; what the step added beyond its gradients is its activations and temporaries;
libraries are the file-backed mappings (CPU); `other` is what was in use at the step's start
beyond those (the Python heap, allocator caches, compiled kernels, the data).

Owns: the breakdown's figures. Touches nothing (it reads the model, the optimizer and the allocator).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def tensor_bytes(tensors: Any, device: torch.device) -> int:
    """Bytes of the distinct storages among `tensors` that live on `device`."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != device.type:
            continue
        if hasattr(tensor, "to_local"):  # a DTensor (FSDP2's parameters): this rank's shard is what it holds
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def gradient_bytes(model: nn.Module, device: torch.device) -> int:
    """Bytes of the gradients `model`'s parameters hold on `device`."""
    return tensor_bytes([p.grad for p in model.parameters() if p.grad is not None], device)


def model_bytes(model: nn.Module, device: torch.device) -> tuple[int, int]:
    """(weights and buffers, gradients) of `model` on `device`."""
    return tensor_bytes([*model.parameters(), *model.buffers()], device), gradient_bytes(model, device)


def optimizer_bytes(optimizer: torch.optim.Optimizer | None, device: torch.device) -> int:
    """Bytes of the optimizer's state tensors (Adam's moments, momentum buffers) on `device`."""
    if optimizer is None:
        return 0
    return tensor_bytes([value for state in optimizer.state.values() for value in state.values()], device)


def library_bytes(virtual: bool) -> int | None:
    """What the process maps from files (shared libraries, the interpreter): virtual size, or the
    resident part (`Rss - Anonymous` of smaps_rollup). None off Linux."""
    try:
        if virtual:
            total = 0
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/"):
                        start, end = fields[0].split("-")
                        total += int(end, 16) - int(start, 16)
            return total
        figures = {}
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                name, _, rest = line.partition(":")
                if name in ("Rss", "Anonymous"):
                    figures[name] = int(rest.split()[0]) * 1024
        return figures["Rss"] - figures["Anonymous"]
    except (OSError, KeyError, ValueError):
        return None


def oom_breakdown(model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device, *,
                  held_at_start: int | None, held_at_failure: int | None, gradients_at_failure: int,
                  cap: int | None, measure: str, allocator_cache: int | None = None,
                  outside_torch: int | None = None) -> dict[str, Any] | None:
    """The parts of what the process held when a step ran out of memory, in bytes (None where a
    reading is missing). `measure`: what the cap binds ("virtual", "resident", "cuda"). On CUDA,
    beside the parts of `held` (live tensors): `allocator_cache`, what the caching allocator kept
    beyond them at the failure, and `outside_torch`, what the device held outside this process's
    allocator (the CUDA context, other processes); the cap is already net of the latter."""
    if held_at_start is None or held_at_failure is None:
        return None
    weights, _ = model_bytes(model, device)
    state = optimizer_bytes(optimizer, device)
    # Gradients are freed after every optimizer step (zero_grad sets them to None), so those held at
    # the failure are this step's: the rest of its growth is activations and temporaries.
    step = max(0, held_at_failure - held_at_start - gradients_at_failure)
    libraries = library_bytes(measure == "virtual") if device.type == "cpu" else None
    other = held_at_start - weights - state - (libraries or 0)
    parts = {"weights": weights, "gradients": gradients_at_failure, "optimizer_state": state,
             "activations_and_temporaries": step, "libraries": libraries, "other": other}
    cuda = {"allocator_cache": allocator_cache, "outside_torch": outside_torch} if measure == "cuda" else {}
    return {"measure": measure, **parts, "held": held_at_failure, "cap": cap, **cuda}

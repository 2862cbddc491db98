"""Rank agreement under torchrun, so an OOM on one rank never strands the others.

The rule that keeps every rank out of a deadlock: no collective runs while a rank may still
fail. Each rank runs all micro-batches of its batch with DDP's gradient sync off
(`no_sync`); then every rank joins one small all-reduce that says whether anyone ran out
of memory. Only if nobody did are gradients averaged and the optimizer stepped, on every
rank; otherwise every rank drops its gradients and retries the same batch with the same
new micro-batch size. A rank that failed in backward therefore never owes the others a
gradient all-reduce.

The micro-batch size is rank 0's: it travels in the same all-reduce, so a policy that acts
on rank 0's monitor reaches every rank at the next agreement.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from typing import Any, Iterable

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place in a torchrun job."""

    rank: int
    world: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_environment() -> Ranks | None:
    """The torchrun job this process is part of, or None when it runs alone (WORLD_SIZE <= 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    return Ranks(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def init_process_group(device: torch.device) -> None:
    """Join the process group torchrun describes, unless the caller already did: NCCL on CUDA, gloo on CPU.
    A group joined here is also left here, at exit."""
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        # Left before interpreter teardown, as torch asks of every process. (The abort seen at
        # exit in two-rank gloo runs was the DDP wrapper's: the trainer drops it at exit, and
        # its handler, registered later, runs before this one.)
        atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree(failed_size: int | None, micro_batch_size: int, flags: list[int], ranks: Ranks,
          device: torch.device) -> tuple[int | None, int, list[int]]:
    """One small all-reduce per attempt. Every rank learns: the largest micro-batch size that
    failed on any rank (or None), rank 0's micro-batch size, and the element-wise maximum of
    `flags` (a stop signal, a checkpoint due, the relief rank 0 offers: other ranks send 0), so
    all ranks stop, save and change their models at the same step."""
    mine = torch.tensor([failed_size or 0, micro_batch_size if ranks.is_main else 0, *flags],
                        dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    values = [int(v) for v in mine.tolist()]
    return (values[0] or None), values[1], values[2:]


def from_rank0(values: list[int], ranks: Ranks, device: torch.device) -> list[int]:
    """Rank 0's `values` on every rank (one small broadcast: every rank must call it)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(mine, src=0)
    return [int(v) for v in mine.tolist()]


class GradientBucket:
    """All gradients as views of one flat buffer, so averaging them is one in-place all-reduce
    with no copies. Gradients are zeroed in place (never set to None) to keep the views."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        self.params = [p for p in parameters if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        first = self.params[0] if self.params else None
        self.flat = torch.zeros(total, dtype=first.dtype if first is not None else torch.float32,
                                device=first.device if first is not None else "cpu")
        self.bind()

    def bind(self) -> None:
        """Point every parameter's .grad at its slice of the buffer (again, if something reset it)."""
        offset = 0
        for p in self.params:
            view = self.flat[offset:offset + p.numel()].view_as(p)
            if p.grad is not view:
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
            offset += p.numel()

    def average(self, world: int) -> None:
        self.bind()
        dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)
        self.flat /= world

    def zero(self) -> None:
        self.flat.zero_()
        self.bind()


def gather(obj: Any, ranks: Ranks) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (used for per-rank RNG states)."""
    gathered: list[Any] = [None] * ranks.world
    dist.all_gather_object(gathered, obj)
    return gathered

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
    """Join the process group torchrun describes, unless the caller already did: NCCL on CUDA, gloo on CPU."""
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def agree(failed_size: int | None, micro_batch_size: int, ranks: Ranks, device: torch.device) -> tuple[int | None, int]:
    """Every rank learns (the largest micro-batch size that failed on any rank or None, rank 0's micro-batch size)."""
    mine = torch.tensor([failed_size or 0, micro_batch_size if ranks.is_main else 0], dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    failed, rank0_micro = (int(v) for v in mine.tolist())
    return (failed or None), rank0_micro


def agree_flags(flags: list[int], device: torch.device) -> list[int]:
    """Element-wise maximum of small integer flags over all ranks (a stop signal, a checkpoint due)."""
    mine = torch.tensor(flags, dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return [int(v) for v in mine.tolist()]


def average_gradients(parameters: Iterable[torch.nn.Parameter], world: int) -> None:
    """Average gradients over ranks in one flat all-reduce. A parameter with no gradient on
    this rank counts as zeros, so every rank sends the same layout."""
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(p).clone() if p.grad is None else p.grad.copy_(
            flat[offset:offset + g.numel()].view_as(p))
        offset += g.numel()


def gather(obj: Any, ranks: Ranks) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (used for per-rank RNG states)."""
    gathered: list[Any] = [None] * ranks.world
    dist.all_gather_object(gathered, obj)
    return gathered

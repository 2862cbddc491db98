"""Where this process stands in a job: `Solo` alone, `Ranks` under torchrun (process.py's `Process`).

The loop talks to one of the two and never asks which: `Solo` is the null object (every
agreement is the process's own proposal, every gather its own object), `Ranks` makes the same
calls collective. How the model is spread over the processes (how many forwards every rank
must run, where gradients are summed, what a checkpoint holds) is the job's strategy, `ranks.job`
(job.py's Protocol): whole_model.py's `Single` alone, its `Replicated` (DDP) or sharded.py's
`Sharded` (FSDP2) under torchrun, chosen here (`Ranks.wrap`).
This module owns the DDP wrapper and every collective the trainer makes; it touches the model
only to wrap it.

The rule that keeps every rank out of a deadlock: no collective runs while a rank may still
fail. Each rank runs all micro-batches of its batch with DDP's gradient sync off
(for good, from `wrap`); then every rank joins one small all-reduce, the `Agreement`, that says whether
anyone ran out of memory. Only if nobody did are gradients averaged and the optimizer
stepped, on every rank; otherwise every rank drops its gradients and retries the same batch
with the same new micro-batch size. A rank that failed in backward therefore never owes the
others a gradient all-reduce. In a steady run the agreement rides in that all-reduce instead
(`Ranks.agree`): every rank joins it, failed or not, with one number more saying
whether it has anything to tell; only where one has do they agree in full, and a failure
throws the reduced gradients away. One collective a steady step, not two.

What the ranks agree on is rank 0's: its micro-batch size and the relief its policies asked
for travel in the same all-reduce, so every rank changes at the same step. A rank whose
optimizer step ran out of memory (it cannot go on) says so in the next agreement, or in the
next checkpoint's gather, and every rank stops with the same error.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import os
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn
from torch.utils.data import Subset

from autotune.common.actions import Relief, relief_to_ints
from autotune.ranks.agreement import Agreement, rank0s
from autotune.ranks.gradient_bucket import GradientBucket
from autotune.ranks.job import Job
from autotune.ranks.process import Process
from autotune.ranks.sharded import Sharded, is_sharded
from autotune.ranks.sharded import shard as shard_blocks
from autotune.ranks.whole_model import Replicated, Single, any_rank

T = TypeVar("T")


class Solo:
    """A process training alone: every agreement is its own proposal; no collective, no wrapper.
    Its strategy is whole_model.py's `Single`."""

    rank, world, local_rank, is_main = 0, 1, 0, True

    def __init__(self) -> None:
        self.job: Job = Single()

    def device_for(self, device: str | torch.device | None, keep_effective_batch: bool) -> str | torch.device | None:
        return device

    def join(self, device: torch.device) -> None:
        pass

    def wrap(self, model: nn.Module, device: torch.device, shard: bool = False) -> None:
        pass

    def module(self, model: nn.Module) -> nn.Module:
        """The module to call in forward (alone: the model itself)."""
        return model

    def buffers_from_rank0(self) -> None:
        """After a batch every rank completed: rank 0's buffers on every rank. Alone: one set already."""

    def agree(self, mine: Agreement, attempt: Any = None) -> tuple[Agreement, bool]:
        """What every process agrees after an attempt, given this one's proposal, and whether the
        `attempt`'s gradients (given where nothing else is added to them) are reduced already.
        Alone: the proposal, and nothing to reduce."""
        return mine, False

    def follow_rank0(self, micro_batch_size: int, relief: Relief | None, device: torch.device) -> tuple[int, Relief | None]:
        """After an OOM: the size to retry at and the relief to try first (alone: this process's own)."""
        return micro_batch_size, relief

    def offer_relief(self, knobs: Any) -> Relief | None:
        """The pending relief that goes into the next agreement (alone: none; it is carried out where asked)."""
        return None

    def relief_now(self, knobs: Any) -> Relief | None:
        """The relief to carry out at this safe point (knobs.py holds it): alone, what a policy asked for."""
        return knobs.take_relief()

    def known_to_all(self, news: T | None) -> T | None:
        """This process's news where every process knows it now: alone, the news itself."""
        return news

    def save_alone(self, save: Callable[[], Path | None]) -> tuple[Path | None, str | None]:
        """A checkpoint this process decides on by itself: alone, it writes it."""
        return save(), None

    def may_stop_waiting(self, stalled: bool) -> bool:
        """Alone, a stop signal unwinds any wait for a batch."""
        return True

    def label(self) -> str:
        return ""

    def share(self, dataset: Any) -> Any:
        return dataset  # alone, all of it

    def average_gradients(self) -> None:
        self.job.average_gradients(1)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.job.zero_grad(optimizer)

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def any(self, flag: bool, device: torch.device) -> bool:
        return flag

    def broadcast_object(self, obj: Any) -> Any:
        return obj


class Ranks:
    """This process's place in a torchrun job, and the collectives that keep the ranks one model."""

    def __init__(self, rank: int, world: int, local_rank: int):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.is_main = rank == 0
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        self.device = torch.device("cpu")  # this rank's device, once it joined the job
        # What depends on how the model is spread over the ranks (job.py): replicated until
        # wrap() finds it sharded with FSDP2.
        self.job: Job = Replicated(self.device)
        self._buffers: list[torch.Tensor] = []  # the model's, once wrapped (`wrap`); none where a host wraps it
        # The last agreement's quiet form: what a batch no rank has news for agrees (`agree`).
        self._quiet: Agreement | None = None

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, world={self.world}, local_rank={self.local_rank})"

    def device_for(self, device: str | torch.device | None, keep_effective_batch: bool) -> str | torch.device | None:
        """One GPU per rank: "cuda" (or no device on a CUDA machine) means cuda:LOCAL_RANK."""
        if not keep_effective_batch:
            raise ValueError("keep_effective_batch=False is not supported under torchrun yet")
        if (device is None and torch.cuda.is_available()) or str(device) == "cuda":
            return f"cuda:{self.local_rank}"
        return device

    def join(self, device: torch.device) -> None:
        """Join the process group torchrun describes, unless the caller already did: NCCL on CUDA, gloo on CPU.
        A group joined here is also left here, at exit."""
        self.device = device  # where this rank's collectives' tensors go
        self.job = Replicated(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
            # Left before interpreter teardown, as torch asks of every process. (The abort seen at
            # exit in two-rank gloo runs was the DDP wrapper's: it is dropped at exit, and that
            # handler, registered later, runs before this one.)
            atexit.register(_leave_process_group)
        atexit.register(_drop_wrapper, weakref.ref(self))

    def wrap(self, model: nn.Module, device: torch.device, shard: bool = False) -> None:
        """Wrap the model in DDP and bind its gradients to one flat buffer; again after pruning
        replaced its parameters (every rank prunes alike, at the same step). A model sharded
        with FSDP2 (by its user, or here with `shard=True`) is not wrapped: its exchanges are
        checked instead (sharded.py)."""
        synced = next((name for name, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)), None)
        if synced is not None:  # its forward all-reduces: a rank out of memory would leave the others in it
            raise ValueError(f"{synced or 'the model'} is a SyncBatchNorm, whose forward is a collective: under "
                             "torchrun autotune needs forwards a rank can fail alone. Use BatchNorm (its running "
                             "statistics are combined over each batch's micro-batches, per rank)")
        if shard and not is_sharded(model):
            blocks = shard_blocks(model)
            logger.info(f"sharded with FSDP2: {len(blocks)} blocks ({', '.join(blocks[:3])}"
                        f"{', ...' if len(blocks) > 3 else ''}) and the root")
        self._buffers = list(model.buffers())  # made rank 0's after each batch (`buffers_from_rank0`)
        if is_sharded(model):
            self.job = Sharded(model)
            return
        # DDP broadcasts rank 0's weights and buffers now; its own gradient sync is never
        # used (switched off below): gradients are averaged after the ranks agree.
        # Buffers are synced once at init, never in forward (a forward-time broadcast is a
        # collective a failing rank could miss). torch >= 2.14 spells it forward_sync_buffers.
        ddp = nn.parallel.DistributedDataParallel
        no_forward_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(ddp).parameters
                           else {"broadcast_buffers": False})
        self.ddp = ddp(model, **no_forward_sync, device_ids=[device.index] if device.type == "cuda" else None)
        # DDP must never all-reduce inside backward (a rank may still fail): its sync off for good,
        # as its own no_sync() sets it for a while, so no step enters a context to say so.
        self.ddp.require_backward_grad_sync = False
        self.bucket_gradients(model.parameters())

    def bucket_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Bind these parameters' gradients to flat buffers that `average_gradients` all-reduces:
        for a model another framework wrapped in DDP (HF, Lightning), whose own gradient sync
        autotune never reaches (its micro-batches run on the module inside the wrapper)."""
        self.job = Replicated(self.device, GradientBucket(parameters))

    def module(self, model: nn.Module) -> nn.Module:
        """The module to call in forward: the DDP wrapper (held only here, so it can be dropped at exit)."""
        return self.ddp if self.ddp is not None else model

    def agree(self, mine: Agreement, attempt: Any = None) -> tuple[Agreement, bool]:
        """One small all-reduce (element-wise maximum) per attempt; every rank must call it. The
        quiet shortcut (the module docstring): given the `attempt` and a replicated model, the
        gradients are reduced first with this rank's news, and where nobody has any, the last
        agreement's quiet form is this one. Returns the agreement and whether the gradients are
        reduced already."""
        reduced = False
        if attempt is not None and self._quiet is not None:
            # The attempt's gradients made the batch's (averaged, or divided by every rank's items)
            # with this rank's news (an OOM, a signal, a due checkpoint...) summed in the same
            # all-reduce, where the job's gradients have one (replicated). Where any rank has news,
            # every rank agrees in full next, and a failure drops these gradients. A steady step
            # makes one collective, not two.
            news = not mine.is_quiet(self._quiet, self.is_main)
            told = self.job.reduce_with_news(news, attempt.ref, attempt.items, self.world)
            if told is False:
                return self._quiet, True  # nobody had anything to say: the gradients are the batch's now
            reduced = told is not None
        values = torch.tensor(mine.to_wire(self.is_main), dtype=torch.int64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        agreed = mine.from_wire(values.tolist(), self.is_main, self.gather)
        self._quiet = agreed.quiet()
        return agreed, reduced

    def follow_rank0(self, micro_batch_size: int, relief: Relief | None, device: torch.device) -> tuple[int, Relief | None]:
        values = torch.tensor([micro_batch_size, *relief_to_ints(relief)], dtype=torch.int64, device=device)
        dist.broadcast(values, src=0)
        micro, code, ratio = (int(v) for v in values.tolist())
        return micro, relief if self.is_main else rank0s(code, ratio)

    def offer_relief(self, knobs: Any) -> Relief | None:
        # Rank 0's goes to every rank through the agreement; another rank's is not its to decide.
        return knobs.relief if self.is_main else None

    def relief_now(self, knobs: Any) -> Relief | None:
        # What every rank agreed to, so all change their models at the same step.
        return knobs.take_agreed_relief()

    def known_to_all(self, news: T | None) -> T | None:
        # The other ranks learn of it at the next agreement or checkpoint gather; until then this
        # rank makes the same collectives as they do (a failed one trains no more).
        return None

    def save_alone(self, save: Callable[[], Path | None]) -> tuple[Path | None, str | None]:
        # A checkpoint gathers from every rank, and the others are not here.
        return None, "under torchrun a checkpoint needs every rank"

    def may_stop_waiting(self, stalled: bool) -> bool:
        # A wait that is not a stall ends in the step's collectives, whose agreement carries the stop.
        return stalled

    def label(self) -> str:
        return f"rank {self.rank}: "

    def share(self, dataset: Any) -> Any:
        # Each rank its share, in order: the ranks' figures meet in one sum (`sum`).
        return Subset(dataset, range(self.rank, len(dataset), self.world))

    def average_gradients(self) -> None:
        self.job.average_gradients(self.world)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.job.zero_grad(optimizer)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over ranks (evaluation's figures), on every rank."""
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether any rank's `flag` is set (a callback asked to stop), on every rank."""
        return any_rank(flag, device)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (per-rank RNG states, failure messages)."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, obj)
        return gathered

    def buffers_from_rank0(self) -> None:
        """After a batch every rank completed (a point they all reach together): the wrapped model's
        buffers made rank 0's on every rank (BatchNorm's running statistics: one set, the one a
        checkpoint keeps). DDP's own broadcast before each forward is off (wrap: a collective a
        failing rank could miss) and FSDP2 never makes one; nothing for a model without buffers.
        One broadcast per dtype and device."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buffer in self._buffers:
            groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        for group in groups.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.broadcast(flat, 0)
            torch._foreach_copy_(group, [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in group]), group)])

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def from_environment() -> Process:
    """The torchrun job this process is part of, or `Solo` when it runs alone (WORLD_SIZE <= 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Solo()
    return Ranks(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _drop_wrapper(ranks_ref: weakref.ref) -> None:
    # At exit, while the interpreter is whole: a DDP wrapper destroyed during interpreter
    # teardown can abort the process in C++ ("terminate called without an active exception";
    # about one two-rank gloo run in twelve) after training has finished and everything is saved.
    ranks = ranks_ref()
    if ranks is not None and ranks.ddp is not None:
        ranks.ddp = None
        gc.collect()

"""Where this process stands in a job: `Solo` alone, `Ranks` under torchrun.

The loop talks to one of the two and never asks which: `Solo` is the null object (every
agreement is the process's own proposal, gradients are its own), `Ranks` makes the same
calls collective. Under torchrun the model is replicated (DDP) or sharded (FSDP2), and what
differs between the two (how many forwards every rank must run, where gradients are summed,
what a checkpoint holds) is answered by the job's strategy, `ranks.job` (job.py's Protocol):
`Replicated` here or sharded.py's `Sharded`, answering what `Solo`, its own job, answers alone.
This module owns the DDP wrapper, the flat gradient buffer and every collective the trainer
makes; it touches the model only to wrap it.

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
from typing import Any, Iterable

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from autotune.common.actions import Relief, relief_to_ints
from autotune.ranks.agreement import Agreement, rank0s
from autotune.ranks.gradient_bucket import GradientBucket
from autotune.ranks.job import Job
from autotune.ranks.sharded import Sharded, is_sharded
from autotune.ranks.sharded import shard as shard_blocks


class Solo:
    """A process training alone: every agreement is its own proposal; no collective, no wrapper."""

    rank, world, local_rank, is_main = 0, 1, 0, True

    def __init__(self) -> None:
        self.job: Job = self  # alone, this process is its own strategy (job.py)

    def device_for(self, device: str | torch.device | None, keep_effective_batch: bool) -> str | torch.device | None:
        return device

    def join(self, device: torch.device) -> None:
        pass

    def wrap(self, model: nn.Module, device: torch.device, shard: bool = False) -> None:
        pass

    def module(self, model: nn.Module) -> nn.Module:
        """The module to call in forward (alone: the model itself)."""
        return model

    # The job's strategy alone (job.py says what each answer means): the null answers.
    forwards_are_collective = writes_shards = sums_in_backward = news_rides_gradients = False
    why_not_prunable: str | None = None
    bucket = None  # gradients are never all-reduced

    def same_size(self, micro_batch_size: int, n: int, step: int) -> int:
        return micro_batch_size  # this process's own

    def micro_batch(self, last: bool) -> None:
        pass

    def check(self, flag: bool) -> bool:
        return flag

    def finite_everywhere(self, finite: bool, device: torch.device) -> bool:
        return finite

    def end_attempt(self, failed: bool, peer_failed: bool) -> bool:
        return False  # no other rank

    def reset_after_failure(self) -> None:
        pass

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

    def known_to_all(self, failure: str | None) -> str | None:
        """A failure every process of the job knows of now: alone, this one's own."""
        return failure

    def average_gradients(self) -> None:
        pass

    def divide_by_items(self, grads: list[torch.Tensor], ref: Any, items: Any) -> None:
        total = items.clamp_min(1) if isinstance(items, torch.Tensor) else max(items, 1)
        torch._foreach_mul_(grads, ref / total)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
        return _whole(model, optimizer)  # the whole of both

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any],
                         optimizer_state: Any) -> None:
        _load_whole(model, optimizer, weights, optimizer_state)

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
        self.job: Replicated | Sharded = Replicated(self.device)
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
        self.job.bucket = GradientBucket(parameters)

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
        if attempt is not None and self._quiet is not None and self.job.news_rides_gradients:
            reduced = True
            # The attempt's gradients made the batch's (averaged, or divided by every rank's items)
            # with this rank's news (an OOM, a signal, a due checkpoint...) summed in the same
            # all-reduce. Where any rank has news, every rank agrees in full next, and a failure
            # drops these gradients. A steady step makes one collective, not two.
            news = not mine.is_quiet(self._quiet, self.is_main)
            if not self.job.reduce_with_news(news, attempt.ref, attempt.items, self.world):
                return self._quiet, True  # nobody had anything to say: the gradients are the batch's now
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

    def known_to_all(self, failure: str | None) -> str | None:
        # The other ranks learn of it at the next agreement or checkpoint gather; until then this
        # rank makes the same collectives as they do, and trains no more.
        return None

    def average_gradients(self) -> None:
        if self.job.bucket is not None:
            self.job.bucket.average(self.world)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.job.bucket is not None:
            self.job.bucket.zero()  # in place: the gradients stay views of the all-reduce buffer
        else:
            optimizer.zero_grad(set_to_none=True)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over ranks (evaluation's figures), on every rank."""
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether any rank's `flag` is set (a callback asked to stop), on every rank."""
        return _any_rank(flag, device)

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


class Replicated:
    """A replicated (DDP) model's strategy under torchrun: every rank holds the whole model, runs
    its own micro-batches, and the gradients are averaged once the ranks agree (the module
    docstring). The answers `Solo` gives alone, made over the ranks where they must be."""

    forwards_are_collective = False  # a rank may run more or fewer forwards than another
    writes_shards = False  # rank 0 writes the whole model (the same on every rank)
    sums_in_backward = False  # averaged after the agreement, never inside backward
    why_not_prunable = None  # every rank prunes alike, at the same step
    bucket: GradientBucket | None = None  # the gradients' all-reduce buffers, once bound

    def __init__(self, device: torch.device):
        self.device = device  # where the checks' tensors go
        self.bucket = None

    def same_size(self, micro_batch_size: int, n: int, step: int) -> int:
        # A rank may differ until the agreement after the attempt, which every rank then follows.
        return micro_batch_size

    def micro_batch(self, last: bool) -> None:
        pass  # DDP's own sync is off for good (wrap): nothing to switch

    def check(self, flag: bool) -> bool:
        return _any_rank(flag, self.device)

    def finite_everywhere(self, finite: bool, device: torch.device) -> bool:
        return finite  # every rank holds the same averaged gradients

    def end_attempt(self, failed: bool, peer_failed: bool) -> bool:
        return False  # no rank waits on another inside an attempt: the agreement tells

    def reset_after_failure(self) -> None:
        pass  # nothing of DDP's ran: the gradients are dropped as alone

    def divide_by_items(self, grads: list[torch.Tensor], ref: Any, items: Any) -> None:
        # Each rank's gradient back to its raw sum over items, summed over ranks with the items
        # themselves in the same all-reduce, then divided by every rank's items together.
        self.bucket.sum_over_items(ref, items)

    # A model whose gradients autotune all-reduces itself carries the ranks' news in that all-reduce.
    news_rides_gradients = property(lambda self: self.bucket is not None)

    def reduce_with_news(self, news: bool, ref: Any, items: Any, world: int) -> bool:
        if items is None:
            return self.bucket.average(world, news)
        return self.bucket.sum_over_items(ref, items, news)

    model_state = staticmethod(lambda model, optimizer: _whole(model, optimizer))
    load_model_state = staticmethod(lambda model, optimizer, weights, state: _load_whole(model, optimizer, weights, state))


def _any_rank(flag: bool, device: torch.device) -> bool:
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def from_environment() -> Solo | Ranks:
    """The torchrun job this process is part of, or `Solo` when it runs alone (WORLD_SIZE <= 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Solo()
    return Ranks(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def _whole(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
    return model.state_dict(), optimizer.state_dict() if optimizer is not None else None


def _load_whole(model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any],
                optimizer_state: Any) -> None:
    model.load_state_dict(weights)
    if optimizer is None or optimizer_state is None:
        return
    if any(isinstance(key, str) for key in optimizer_state.get("state", {})):
        # Keyed by parameter name: a sharded job's checkpoint, its shards read whole (sharded.py's
        # `sharded_state`), on one process now.
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, optimizer_state)
        return
    optimizer.load_state_dict(optimizer_state)


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

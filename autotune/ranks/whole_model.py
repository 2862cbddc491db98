"""The strategies where every process holds the whole model: `Single` (one process, alone) and
`Replicated` (DDP under torchrun: every rank runs its own micro-batches, and the gradients are
averaged once the ranks agree: distributed.py's module docstring). Both answer job.py's Protocol,
as sharded.py's `Sharded` does for FSDP2.

Owns the two strategies (the flat buffers a replicated job all-reduces are gradient_bucket.py's).
Touches: the parameters' gradients (zeroed, averaged, divided by items, held ones
added), and the model's and the optimizer's state when asked to load it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from autotune.ranks.gradient_bucket import GradientBucket
from autotune.ranks.job import CheckpointWriter, Held, T


class Single:
    """One process holding the whole model: every answer is this process's own (nothing to agree
    with another rank, nothing to reduce)."""

    def same_size(self, micro_batch_size: int, n: int, step: int) -> int:
        return micro_batch_size  # this process's own

    def items_reference(self, estimate: Any) -> Any:
        return estimate

    def micro_batch(self, last: bool) -> None:
        pass

    def check(self, flag: bool) -> bool:
        return flag

    def end_attempt(self, failed: bool, peer_failed: bool) -> bool:
        return False  # no other rank

    def reset_after_failure(self) -> None:
        pass

    def gradients_untouched(self) -> bool:
        return False  # not told without looking at every gradient: the caller's are held back

    def held_into_buffers(self, held: Held) -> Held:
        return held  # nothing is reduced: added after, as before

    def average_gradients(self, world: int) -> None:
        pass

    def divide_by_items(self, grads: list[torch.Tensor], ref: Any, items: Any) -> None:
        total = items.clamp_min(1) if isinstance(items, torch.Tensor) else max(items, 1)
        torch._foreach_mul_(grads, ref / total)

    def reduce_with_news(self, news: bool, ref: Any, items: Any, world: int) -> bool | None:
        return None  # no collective for the news to ride in

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def finite_everywhere(self, finite: bool, device: torch.device) -> bool:
        return finite

    def check_finite_late(self, try_late: Callable[[], bool]) -> bool:
        return try_late()  # no agreement reads the host this step: a check left on the device spares a wait

    def evaluate(self, batches: Iterable[Any], each: Callable[[Any], int],
                 in_rounds: Callable[[Iterable[Any]], int]) -> int:
        return sum(each(batch) for batch in batches)

    def require_free_forwards(self, what: str, instead: str) -> None:
        pass

    def check_prunable(self) -> None:
        pass

    def model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
        return _whole(model, optimizer)  # the whole of both

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any],
                         optimizer_state: Any) -> None:
        _load_whole(model, optimizer, weights, optimizer_state)

    def reads_shards(self, template: T | None) -> T | None:
        return template  # every rank's shards read into whole tensors (a sharded job that lost its nodes: issue 33)

    def prepare_checkpoint(self, writer: CheckpointWriter, step: int, is_main: bool) -> None:
        pass

    def write_checkpoint(self, writer: CheckpointWriter, state: dict[str, Any], step: int, is_main: bool) -> Any:
        return writer.write_whole(state, step)


class Replicated:
    """A replicated (DDP) model's strategy under torchrun: every rank holds the whole model, runs
    its own micro-batches, and the gradients are averaged once the ranks agree, through the flat
    buffers of `bucket` (bound by distributed.Ranks: `wrap`, `bucket_gradients`). The answers
    `Single` gives alone, made over the ranks where they must be."""

    def __init__(self, device: torch.device, bucket: GradientBucket | None = None):
        self.device = device  # where the checks' tensors go
        self.bucket = bucket  # the gradients' all-reduce buffers; None: not bound (nothing to all-reduce)

    def same_size(self, micro_batch_size: int, n: int, step: int) -> int:
        # A rank may differ until the agreement after the attempt, which every rank then follows.
        return micro_batch_size

    def items_reference(self, estimate: Any) -> Any:
        return estimate  # summed over ranks after the agreement, with every rank's items (`divide_by_items`)

    def micro_batch(self, last: bool) -> None:
        pass  # DDP's own sync is off for good (distributed.Ranks.wrap): nothing to switch

    def check(self, flag: bool) -> bool:
        return any_rank(flag, self.device)

    def end_attempt(self, failed: bool, peer_failed: bool) -> bool:
        return False  # no rank waits on another inside an attempt: the agreement tells

    def reset_after_failure(self) -> None:
        pass  # nothing of DDP's ran: the gradients are dropped as alone

    def gradients_untouched(self) -> bool:
        return self.bucket is not None and self.bucket.untouched()

    def held_into_buffers(self, held: Held) -> Held:
        if self.bucket is None:
            return held
        # The held gradients are views of the buffers the reduction all-reduces (the attempt's
        # were written beside them): added in first, as tuning/batch.py's add_gradients does; being
        # alike on every rank, averaging leaves them as they are.
        for p, grad in held:
            if p.grad is not None:
                grad.add_(p.grad)
            p.grad = grad
        return []

    def average_gradients(self, world: int) -> None:
        if self.bucket is not None:
            self.bucket.average(world)

    def divide_by_items(self, grads: list[torch.Tensor], ref: Any, items: Any) -> None:
        # Each rank's gradient back to its raw sum over items, summed over ranks with the items
        # themselves in the same all-reduce, then divided by every rank's items together.
        self.bucket.sum_over_items(ref, items)

    def reduce_with_news(self, news: bool, ref: Any, items: Any, world: int) -> bool | None:
        # A model whose gradients autotune all-reduces itself carries the ranks' news in that all-reduce.
        if self.bucket is None:
            return None
        if items is None:
            return self.bucket.average(world, news)
        return self.bucket.sum_over_items(ref, items, news)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.bucket is not None:
            self.bucket.zero()  # in place: the gradients stay views of the all-reduce buffer
        else:
            optimizer.zero_grad(set_to_none=True)

    def finite_everywhere(self, finite: bool, device: torch.device) -> bool:
        return finite  # every rank holds the same averaged gradients

    def check_finite_late(self, try_late: Callable[[], bool]) -> bool:
        return False  # the agreement reads the host every step anyway: nothing to spare

    def evaluate(self, batches: Iterable[Any], each: Callable[[Any], int],
                 in_rounds: Callable[[Iterable[Any]], int]) -> int:
        return sum(each(batch) for batch in batches)  # a rank may run more or fewer forwards than another

    def require_free_forwards(self, what: str, instead: str) -> None:
        pass

    def check_prunable(self) -> None:
        pass  # every rank prunes alike, at the same step

    def model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
        return _whole(model, optimizer)

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any],
                         optimizer_state: Any) -> None:
        _load_whole(model, optimizer, weights, optimizer_state)

    def reads_shards(self, template: T | None) -> T | None:
        return None  # a sharded checkpoint resumes sharded, or alone (checkpoint_files.NOT_SHARDED)

    def prepare_checkpoint(self, writer: CheckpointWriter, step: int, is_main: bool) -> None:
        pass

    def write_checkpoint(self, writer: CheckpointWriter, state: dict[str, Any], step: int, is_main: bool) -> Any:
        # Rank 0 writes the whole model (the same on every rank); every rank's random state came
        # in the gather.
        return writer.write_whole(state, step) if is_main else None


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` is set on any rank (one all-reduce every rank makes)."""
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


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

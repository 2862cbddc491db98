"""The job's strategy: what the loop asks of how the model is spread over the processes, stated once.

Three answer it: distributed.py's `Solo` (one process: the null answers), `Replicated` (DDP
under torchrun: every rank holds the whole model) and sharded.py's `Sharded` (FSDP2: every rank
holds shards, and the ranks exchange inside forward and backward). The loop reaches the one in
use as `ranks.job` and never asks which it is; tests/ranks/test_job.py holds the three to this
Protocol. The collectives every job makes alike (the agreement, gathers, rank 0's relief) are
`Solo`'s and `Ranks`'s own, not the strategy's.

Owns the Protocol. Touches nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from autotune.ranks.gradient_bucket import GradientBucket


class Job(Protocol):
    """What differs between one process, a replicated model and a sharded one."""

    forwards_are_collective: bool  # every rank must run as many forwards (sharded: they all-gather)
    writes_shards: bool  # a checkpoint is a folder every rank writes its shards to (else one file)
    sums_in_backward: bool  # gradients are summed over ranks inside backward (sharded: reduce-scatter)
    why_not_prunable: str | None  # why pruning cannot apply to this job's model (None: it can)
    bucket: GradientBucket | None  # the flat gradient buffers autotune all-reduces (replicated), else None
    news_rides_gradients: bool  # the ranks' news can ride in the gradients' all-reduce (distributed.Ranks.agree)

    def same_size(self, micro_batch_size: int, n: int, step: int) -> int:
        """The micro-batch to attempt a batch of `n` at (sharded: the same on every rank)."""

    def micro_batch(self, last: bool) -> None:
        """Before each micro-batch's backward (`last`: the batch's last one)."""

    def check(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank, at a point every rank reaches together."""

    def finite_everywhere(self, finite: bool, device: torch.device) -> bool:
        """Whether the gradients are finite on every rank, given this rank's `finite`."""

    def end_attempt(self, failed: bool, peer_failed: bool) -> bool:
        """After an attempt: whether another rank failed after this one's was done."""

    def reset_after_failure(self) -> None:
        """After a failed attempt, before its gradients are dropped."""

    def divide_by_items(self, grads: list[torch.Tensor], ref: Any, items: Any) -> None:
        """Weighted by items: the micro-batches were weighted n_items/ref; make it n_items/total
        (over every rank's items)."""

    def model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
        """The weights and the optimizer's state for a checkpoint (sharded: this rank's shards)."""

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any],
                         optimizer_state: Any) -> None:
        """Put what `model_state` returned back into the model and the optimizer."""


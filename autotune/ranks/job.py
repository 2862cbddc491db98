"""The job's strategy: what the loop asks of how the model is spread over the processes, stated once.

Three answer it: whole_model.py's `Single` (one process holds the whole model) and `Replicated`
(DDP under torchrun: every rank holds the whole model), and sharded.py's `Sharded` (FSDP2: every
rank holds shards, and the ranks exchange inside forward and backward). The loop reaches the one
in use as `ranks.job` and never asks which it is: every answer is a method that does the thing
(runs the evaluation's forwards, writes the checkpoint, refuses pruning), never a flag for the
caller to branch on (tests/test_faces.py holds the package to that, tests/ranks/test_job.py the
three strategies to this Protocol). The collectives every job makes alike (the agreement,
gathers, rank 0's relief) are the process's (process.py: `Solo` alone, `Ranks` under torchrun),
not the strategy's.

Owns the Protocols (`Job`, and `CheckpointWriter`: what a job asks of the run folder to write its
checkpoint). Touches nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, TypeVar

import torch
from torch import nn

T = TypeVar("T")
Held = list[tuple[nn.Parameter, torch.Tensor]]  # gradients set aside before an attempt, with their parameters


class CheckpointWriter(Protocol):
    """The run folder's two ways of writing a checkpoint (run_folder/checkpoint.py gives them):
    a job calls the one its model's layout needs."""

    def clear_unfinished(self, step: int) -> None:
        """Rank 0, before any rank writes a sharded checkpoint of `step`: what a killed write left."""

    def write_whole(self, state: dict[str, Any], step: int) -> Any:
        """Rank 0 alone: `state` whole, in one file."""

    def write_shards(self, state: dict[str, Any], step: int, is_main: bool) -> Any:
        """Every rank at once: its shards of `state`, into one folder."""


class Job(Protocol):
    """What differs between one process, a replicated model and a sharded one."""

    # ------------------------------------------------------------------ an attempt at a batch
    def same_size(self, micro_batch_size: int, n: int, step: int) -> int:
        """The micro-batch to attempt a batch of `n` at (sharded: the same on every rank)."""

    def items_reference(self, estimate: Any) -> Any:
        """What a micro-batch's items are weighted against (`loss * items / ref`), given this rank's
        `estimate` of its batch's items: the estimate, or 1 where the ranks' gradients are summed
        inside backward (sharded), before any rank knows the others' items (`divide_by_items`)."""

    def micro_batch(self, last: bool) -> None:
        """Before each micro-batch's backward (`last`: the batch's last one)."""

    def check(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank, at a point every rank reaches together."""

    def end_attempt(self, failed: bool, peer_failed: bool) -> bool:
        """After an attempt: whether another rank failed after this one's was done."""

    def reset_after_failure(self) -> None:
        """After a failed attempt, before its gradients are dropped."""

    # ------------------------------------------------------------------ gradients
    def gradients_untouched(self) -> bool:
        """Whether the gradients are still the zeros the last `zero_grad` left, so a step has none of
        the caller's to hold back (False where that cannot be told cheaply)."""

    def held_into_buffers(self, held: Held) -> Held:
        """Gradients held back over the attempt (alike on every rank) added now, before the attempt's
        are reduced, where they are views of the buffers the reduction reuses (replicated); returns
        what is left to add after the reduction."""

    def average_gradients(self, world: int) -> None:
        """Each rank's gradients made the mean over the `world` ranks (weighted by samples)."""

    def divide_by_items(self, grads: list[torch.Tensor], ref: Any, items: Any) -> None:
        """Weighted by items: the micro-batches were weighted n_items/ref; make it n_items/total
        (over every rank's items)."""

    def reduce_with_news(self, news: bool, ref: Any, items: Any, world: int) -> bool | None:
        """The attempt's gradients reduced (`average_gradients`, or `divide_by_items` against `ref`
        where `items` is not None) with this rank's `news` in the same collective: whether any rank
        had news. None where the news cannot ride in the gradients' reduction (nothing was reduced)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's gradients cleared after its step."""

    def finite_everywhere(self, finite: bool, device: torch.device) -> bool:
        """Whether the gradients are finite on every rank, given this rank's `finite`."""

    def check_finite_late(self, try_late: Callable[[], bool]) -> bool:
        """Where nothing else reads the host this step (alone), leave the finiteness check on the
        device: `try_late()` tries it and says whether it did. Returns whether the check was left."""

    # ------------------------------------------------------------------ forwards outside training
    def evaluate(self, batches: Iterable[Any], each: Callable[[Any], int],
                 in_rounds: Callable[[Iterable[Any]], int]) -> int:
        """An evaluation's forwards over `batches`: `each(batch)` for every batch where a rank may run
        as many forwards as it likes, else `in_rounds(batches)`, which runs them in rounds every rank
        joins (sharded: every forward all-gathers). Returns the samples they evaluated."""

    def require_free_forwards(self, what: str, instead: str) -> None:
        """Before forwards a rank runs on its own (`what`): NotImplementedError, saying `instead`,
        where every forward is a collective (sharded)."""

    # ------------------------------------------------------------------ reliefs
    def check_prunable(self) -> None:
        """Before pruning: `UnsafePruning` where it cannot apply to this job's model."""

    # ------------------------------------------------------------------ state
    def model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
        """The weights and the optimizer's state for a checkpoint (sharded: this rank's shards)."""

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any],
                         optimizer_state: Any) -> None:
        """Put what `model_state` returned back into the model and the optimizer."""

    def reads_shards(self, template: T | None) -> T | None:
        """What a sharded checkpoint is read into: `template` (the state now) where this job can
        read one (sharded alike, or alone: whole), None where it cannot (replicated)."""

    def prepare_checkpoint(self, writer: CheckpointWriter, step: int, is_main: bool) -> None:
        """Before the ranks gather a checkpoint's state, when no rank writes it yet."""

    def write_checkpoint(self, writer: CheckpointWriter, state: dict[str, Any], step: int, is_main: bool) -> Any:
        """This rank's part of writing `state`: what `writer` returned, or None where this rank
        writes nothing (rank 0 writes a whole model; every rank writes its shards)."""

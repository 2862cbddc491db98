"""Where this process stands in a job, as the loop sees it: the one name callers write for
distributed.py's `Solo` (a process alone) and `Ranks` (one rank of a torchrun job).

Both make the same calls: `Solo` answers alone (every agreement is its own proposal, every gather
its own object), `Ranks` makes them collective. What differs with how the model is spread over
the processes is the process's strategy, `job` (job.py). Nothing outside this folder asks which
process it has: each question is a call here (`known_to_all`, `save_alone`, `may_stop_waiting`,
`share`, ...), never a comparison of `world` with 1 (tests/test_faces.py checks the package).

Owns the Protocol. Touches nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import torch
from torch import nn

from autotune.common.actions import Relief
from autotune.ranks.agreement import Agreement
from autotune.ranks.job import Job

T = TypeVar("T")


class Process(Protocol):
    """This process's place in the job, and the collectives every strategy makes alike."""

    rank: int  # this process's rank (0 alone)
    world: int  # the job's number of processes: a count to multiply by, never a kind to ask
    local_rank: int
    is_main: bool  # rank 0: the one that writes the run folder's shared files
    job: Job  # how the model is spread over the processes (job.py)

    # ------------------------------------------------------------------ joining
    def device_for(self, device: str | torch.device | None, keep_effective_batch: bool) -> str | torch.device | None:
        """This process's device, given the one asked for."""

    def join(self, device: torch.device) -> None:
        """Join the job's processes (under torchrun: its process group) on `device`."""

    def wrap(self, model: nn.Module, device: torch.device, shard: bool = False) -> None:
        """Ready the model for the job (DDP, or FSDP2's checks): again after a relief replaced its parameters."""

    def module(self, model: nn.Module) -> nn.Module:
        """The module to call in forward."""

    # ------------------------------------------------------------------ the agreement
    def agree(self, mine: Agreement, attempt: Any = None) -> tuple[Agreement, bool]:
        """What every process agrees after an attempt, given this one's proposal, and whether the
        `attempt`'s gradients (given where nothing else is added to them) are reduced already."""

    def follow_rank0(self, micro_batch_size: int, relief: Relief | None,
                     device: torch.device) -> tuple[int, Relief | None]:
        """After an OOM: the size to retry at and the relief to try first (rank 0's)."""

    def offer_relief(self, knobs: Any) -> Relief | None:
        """The pending relief that goes into the next agreement."""

    def relief_now(self, knobs: Any) -> Relief | None:
        """The relief to carry out at this safe point (knobs.py holds it)."""

    def known_to_all(self, news: T | None) -> T | None:
        """This process's `news` (a failure, a stop signal) where every process of the job knows it
        now: alone, the news; under torchrun None, until the next agreement or gather tells the others."""

    # ------------------------------------------------------------------ what a process does alone
    def save_alone(self, save: Callable[[], Path | None]) -> tuple[Path | None, str | None]:
        """A checkpoint this process decides on by itself (a stop, an error between agreements):
        `save()`'s path, or (None, why not) where it needs the other processes, which are not here."""

    def may_stop_waiting(self, stalled: bool) -> bool:
        """Whether a stop signal may unwind this process's wait for a batch: alone, always; under
        torchrun only a `stalled` wait (else the step's agreement carries the stop to every rank)."""

    def label(self) -> str:
        """How a message said on every process names this one ("rank 1: "; alone nothing)."""

    def share(self, dataset: Any) -> Any:
        """This process's share of a dataset every process holds whole (every world-th sample from its rank)."""

    # ------------------------------------------------------------------ collectives
    def average_gradients(self) -> None:
        """Each rank's gradients made the mean over the ranks (the job's: `Job.average_gradients`)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients cleared after the optimizer's step (the job's: `Job.zero_grad`)."""

    def buffers_from_rank0(self) -> None:
        """After a batch every rank completed: rank 0's buffers on every rank."""

    def gather(self, obj: Any) -> list[Any]:
        """Every process's `obj`, in rank order, on every process."""

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the processes, on every process."""

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether any process's `flag` is set, on every process."""

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every process."""

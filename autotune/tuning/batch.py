"""One batch until every sample of it is in a completed optimizer step: the attempts, the ranks'
agreement after each, OOM recovery between them, and the gradients a caller held back.

    while the batch is not done:       (events.py has the whole picture)
      measured: the step's peak from here
      attempt (step/core.py): forward and backward, micro-batch by micro-batch
      agree (distributed.py), failed or not
      nobody failed: the attempt committed; reduce, add the held, step; done
      failure: the attempt rolled back; recovery.py (clean up, record, decide),
               then the same batch again, smaller

There is one path. Alone, the agreement is this process's own proposal. Under torchrun with a
replicated model, an attempt whose proposal is quiet on every rank (no OOM, signal, due
checkpoint or relief; rank 0's size as agreed last) needs no agreement of its own: the gradients'
all-reduce carries each rank's "I have news" and, where nobody has, it was the agreement
(distributed.Ranks.agree, given the attempt). Where anybody has, the full agreement follows.

Owns: whether the last batch was measured, the last good micro-batch, whether earlier gradients
are held. Touches: the step core (attempts, each committed or rolled back once the ranks agreed:
what an attempt changes besides gradients is the attempt's own, step/core.py; the optimizer step),
the knobs (rank 0's size), the demand (measured), the cadence, the job's agreement, the recovery.
Used by `Tuner.train_batch`, the one way every host trains a batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn

from autotune.memory.cadence import MeasureCadence
from autotune.memory.demand import StepDemand
from autotune.ranks.agreement import Agreement
from autotune.step.core import Attempt, StepCore
from autotune.step.losses import Losses, join_outputs
from autotune.step.optimizer_step import OptimizerStep
from autotune.tuning.recovery import OOMRecovery
from autotune.tuning.run import Run


@dataclasses.dataclass(slots=True)
class BatchOutcome:
    """What training one batch did."""

    retries: int  # OOMs survived on it
    losses: Losses  # its kept micro-batches' losses, combined when read
    device: torch.device
    agreed: Agreement | None = None  # its last attempt's agreement (a stop signal, a checkpoint due)

    @property
    def weight(self) -> Any:
        """What `loss_sum` is summed over: samples, or the step's items."""
        return self.losses.weight

    @property
    def loss_sum(self) -> torch.Tensor:
        """The summed (not mean) loss over `weight`."""
        return self.losses.total(self.device)

    def mean_loss(self) -> torch.Tensor:
        """The batch's mean loss (0-d, on the device; no op when the batch ran in one piece)."""
        return self.losses.mean(self.device)

    @property
    def outputs(self) -> Any:
        """What the step function handed back (`StepResult.outputs`) for the whole batch, in sample
        order; None where it handed back none."""
        return join_outputs(self.losses.outputs)


class BatchRunner:
    """Runs batches on one Tuner's step core (see the module docstring)."""

    def __init__(self, run: Run, core: StepCore, stepper: OptimizerStep, cadence: MeasureCadence, demand: StepDemand,
                 recovery: OOMRecovery):
        self.knobs, self.ranks, self.keep_effective_batch = run.knobs, run.ranks, run.keep_effective_batch
        self.core, self.stepper, self.cadence, self.demand, self.recovery = core, stepper, cadence, demand, recovery
        self.measured = False  # whether the last batch was measured (its demand read, BATCH_MEASURED fired)
        self.last_good_micro: int | None = None  # the micro-batch of the last batch that completed
        self.holding = False  # gradients of earlier batches set aside during this one
        self.last: BatchOutcome | None = None  # the last batch trained (its outputs: `Tuner.outputs`)
        core.journal_to(run.journal, run.run_dir)  # where an attempt's numerics notice goes

    def run(self, batch: Any, n: int, *, optimizer_step: bool, proposal: Callable[[], dict[str, Any]] | None,
            held: list[tuple[nn.Parameter, torch.Tensor]] | None) -> BatchOutcome:
        """Train on one batch until every sample of it is in a completed optimizer step (or, with
        `optimizer_step=False`, in the accumulated gradients); see `Tuner.train_batch`. While
        `held` gradients are set aside, a failed attempt's gradients are dropped from the
        parameters directly."""
        self.holding = held is not None
        additive = not optimizer_step
        measured = self.measured = self.cadence.due(self.knobs.micro_batch_size)
        rebase = not self.cadence.last_measured
        done = 0  # samples whose optimizer step has completed (keep_effective_batch=False)
        steps_before = self.stepper.steps_tried
        tried: list[int] = []
        losses: Losses | None = None
        while True:
            if measured:
                self.demand.start(self.knobs.micro_batch_size, rebase=rebase)  # a retry is measured afresh
                rebase = False
            self.knobs.follow(self.ranks.job.same_size(self.knobs.micro_batch_size, n, self.stepper.counters.step))
            attempt = self.core.attempt(batch, n, done, self.knobs.micro_batch_size, additive=additive)
            # Sharded, a rank that cannot go on (its optimizer step failed) ran no exchange: it says
            # "failed" at the others' first check, and the agreement then stops every rank.
            if self.ranks.job.end_attempt(attempt.failed_micro_batch is not None or self.stepper.failure is not None,
                                          attempt.peer_failed):
                attempt.discard()  # sharded: another rank failed, during this attempt or after it
            done = attempt.done
            # Every rank joins here, failed or not: nobody waits in a gradient all-reduce for a
            # rank that ran out of memory. Before the step: a checkpoint is due by the step it ends at.
            mine = Agreement(attempt.failed_micro_batch, self.knobs.micro_batch_size,
                             relief=self.ranks.offer_relief(self.knobs), fatal=self.stepper.failure,
                             **(proposal() if proposal is not None else _NOTHING_PROPOSED))
            # Where nothing else is added to them, the gradients may carry the agreement (see above).
            agreed, reduced = self.ranks.agree(mine, attempt if optimizer_step and not held else None)
            if agreed.failed_micro_batch is not None:
                attempt.roll_back()  # this rank or another ran out of memory: the retry starts as this attempt did
            if losses is None:
                losses = attempt.losses
            else:  # with keep_effective_batch=False, a failed attempt's stepped chunks count too
                losses.parts += attempt.losses.parts
                losses.outputs += attempt.losses.outputs
            self.knobs.follow(agreed.micro_batch_size)  # rank 0's
            if agreed.relief is not None or self.knobs.relief is not None:  # most attempts: none asked, none agreed
                self.recovery.settle_relief(agreed.relief)
            if agreed.fatal:
                self.recovery.give_up_on_the_step(agreed.fatal)
            if agreed.failed_micro_batch is None:
                attempt.commit()  # it fit on every rank: BatchNorm's statistics the whole batch's
                self._complete(attempt, n, optimizer_step, held, reduced)
                self.ranks.buffers_from_rank0()
                return self._outcome(losses, len(tried), agreed, measured, self.stepper.steps_tried - steps_before)
            # Out of the `except` block now, so the exception and its frames are gone and
            # the tensors they pinned (activations, partial gradients) can be freed.
            tried.append(agreed.failed_micro_batch)
            self.recovery.recover(agreed.failed_micro_batch, tried, attempt, holding=self.holding,
                                  last_good_micro_batch=self.last_good_micro)
            measured = self.measured = True  # the retry is measured, whatever the cadence said

    def _complete(self, attempt: Attempt, n: int, optimizer_step: bool,
                  held: list[tuple[nn.Parameter, torch.Tensor]] | None, reduced: bool) -> None:
        # The attempt every rank agreed fit: its gradients reduced (`reduced`: already, with the
        # news), the held ones added, the step.
        if reduced:
            self.stepper.step(n)
        elif optimizer_step and self.keep_effective_batch:
            if held:
                # Where the held gradients are views of the ranks' gradient buffers (replicated), the
                # job adds them in first (rank-alike already, so averaging leaves them as they are).
                held = self.ranks.job.held_into_buffers(held)
            self.stepper.reduce_gradients(attempt.ref, attempt.items)
            if held:
                add_gradients(held)
            self.stepper.step(n)
        # The optimizer step ran out of memory, here or (known to every rank now) on another rank.
        failure = self.stepper.failure
        if failure is not None and self.ranks.known_to_all(failure):
            self.recovery.give_up_on_the_step(failure)

    def _outcome(self, losses: Losses, retries: int, agreed: Agreement, measured: bool,
                 steps_tried: int) -> BatchOutcome:
        if self.stepper.skipped:
            self.recovery.report_skipped(losses, self.keep_effective_batch)
        if self.stepper.streak_reached(steps_tried):  # a run that trains nothing: stopped (every rank alike)
            self.recovery.give_up_on_nonfinite(losses, self.keep_effective_batch)
        self.last_good_micro = self.knobs.micro_batch_size
        self.cadence.done(measured, self.demand.finish() if measured else None)
        self.last = BatchOutcome(retries, losses, self.core.device, agreed)
        return self.last


_NOTHING_PROPOSED: dict[str, Any] = {}


def set_aside_gradients(params: Iterable[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Take the gradients the parameters hold (their `.grad` is None after), to add back later."""
    held = [(p, p.grad) for p in params if p.grad is not None]
    for p, _ in held:
        p.grad = None
    return held


def add_gradients(held: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Add gradients `set_aside_gradients` took onto what the parameters hold now (or put them back)."""
    for p, grad in held:
        if p.grad is not None:
            grad.add_(p.grad)  # into the held tensor: views of it elsewhere (a bucket) stay bound
        p.grad = grad

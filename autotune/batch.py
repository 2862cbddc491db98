"""One batch until every sample of it is in a completed optimizer step: the attempts, the ranks'
agreement after each, OOM recovery between them, and the gradients a caller held back.

    steady (alone, not measured): the attempt; it fit: add the held, step; done
    while the batch is not done:       (events.py has the whole picture)
      measured: the step's peak from here           attempt (step.py), unless the steady one failed
      agree (distributed.py), failed or not         no failure: reduce, add the held, step; done
      failure: recovery.py (clean up, record, decide), then the same batch again, smaller

Under torchrun with a replicated model, a batch whose proposal is quiet on every rank (no OOM,
signal, due checkpoint or relief; rank 0's size as agreed last) needs no agreement of its own:
the gradients' all-reduce carries each rank's "I have news" and, where nobody has, it was the
agreement (distributed.Ranks.reduce_with_news). Where anybody has, the full agreement follows.

The steady path is the loop's first pass with nothing in it that cannot change the outcome:
alone there is nobody to agree with, and a batch the cadence does not measure has no peak to
read. An OOM in its attempt goes on in the loop exactly as an attempt there would.

Owns: whether the last batch was measured, the last good micro-batch, whether earlier gradients
are held. Touches: the step core (attempts, the optimizer step), the knobs (rank 0's size), the
demand (measured), the cadence, the job's agreement, the recovery. Used by `Tuner.train_batch`,
the one way every host trains a batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn

from autotune.actions import Relief
from autotune.cadence import MeasureCadence
from autotune.distributed import Agreement, Ranks, Solo
from autotune.knobs import Knobs
from autotune.losses import Losses
from autotune.memory import StepDemand
from autotune.recovery import OOMRecovery
from autotune.step import Attempt, StepCore


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


class BatchRunner:
    """Runs batches on one Tuner's step core (see the module docstring)."""

    def __init__(self, core: StepCore, knobs: Knobs, ranks: Solo | Ranks, cadence: MeasureCadence,
                 demand: StepDemand, recovery: OOMRecovery, keep_effective_batch: bool):
        self.core, self.knobs, self.ranks, self.cadence = core, knobs, ranks, cadence
        self.demand, self.recovery, self.keep_effective_batch = demand, recovery, keep_effective_batch
        self.measured = False  # whether the last batch was measured (its demand read, BATCH_MEASURED fired)
        self.last_good_micro: int | None = None  # the micro-batch of the last batch that completed
        self.holding = False  # gradients of earlier batches set aside during this one
        self._agreement: Agreement | None = None  # the steady path's, alone (see `_agreed_alone`)
        self._proposed: dict[str, Any] = {}  # what it was agreed from
        # Under torchrun, the last agreement's quiet form: what a batch no rank has news for agrees
        # (a replicated model's news rides in its gradients' all-reduce: distributed.py).
        self._quiet: Agreement | None = None
        self.steady_path = True  # False: every batch through the full loop (what the tests compare it with)

    def run(self, batch: Any, n: int, *, optimizer_step: bool, proposal: Callable[[], dict[str, Any]] | None,
            held: list[tuple[nn.Parameter, torch.Tensor]] | None, fire: Callable[..., None],
            carry_out: Callable[[Relief], bool], checkpoint: Callable[..., Any]) -> BatchOutcome:
        """Train on one batch until every sample of it is in a completed optimizer step (or, with
        `optimizer_step=False`, in the accumulated gradients); see `Tuner.train_batch`. While
        `held` gradients are set aside, a failed attempt's gradients are dropped from the
        parameters directly. `fire`, `carry_out` and `checkpoint` are the Tuner's, lent for the
        OOM recovery of this batch (recovery.py)."""
        self.holding = held is not None
        additive = not optimizer_step
        cadence, knobs = self.cadence, self.knobs
        measured = self.measured = cadence.due(knobs.micro_batch_size)
        attempt: Attempt | None = None
        if not measured and self.steady_path and self.ranks.alone and self.core.failure is None:
            # The steady path: nothing to measure and nobody to agree with, so the attempt and
            # the step are all there is to do. An OOM goes on below, as any attempt's would.
            if n <= knobs.micro_batch_size and self._whole_batches and not additive:
                whole = self._whole(batch, n, held, proposal, checkpoint)
                if type(whole) is BatchOutcome:  # the common case: a plain loss, no failure
                    return whole
                attempt = whole
            else:
                attempt = self.core.attempt(batch, n, 0, knobs.micro_batch_size, additive=additive)
            if attempt.failed_micro_batch is None:
                agreed = self._agreed_alone(proposal)  # before the step: a checkpoint is due by the step it ends at
                self._complete(attempt, n, optimizer_step, held, checkpoint)
                return self._outcome(attempt.losses, 0, agreed, False, additive)
        done = 0  # samples whose optimizer step has completed
        tried: list[int] = []
        losses: Losses | None = None
        rebase = not cadence.last_measured
        while done < n:
            if attempt is None:
                if measured:
                    self.demand.start(knobs.micro_batch_size, rebase=rebase)  # a retry is measured afresh
                    rebase = False
                knobs.follow(self.ranks.same_size(knobs.micro_batch_size, n, self.core.counters.step))
                attempt = self.core.attempt(batch, n, done, knobs.micro_batch_size, additive=additive)
            # Sharded, a rank that cannot go on (its optimizer step failed) ran no exchange: it says
            # "failed" at the others' first check, and the agreement then stops every rank.
            if self.ranks.end_attempt(attempt.failed_micro_batch is not None or self.core.failure is not None,
                                      attempt.peer_failed):
                attempt.discard()  # sharded: another rank failed, during this attempt or after it
            done = attempt.done
            # Every rank joins here, failed or not: nobody waits in a gradient all-reduce for a
            # rank that ran out of memory.
            mine = Agreement(failed_micro_batch=attempt.failed_micro_batch, micro_batch_size=knobs.micro_batch_size,
                             relief=self.ranks.offer_relief(knobs), fatal=self.core.failure,
                             **(proposal() if proposal is not None else {}))
            reduced = (optimizer_step and not held and self.steady_path and self._quiet is not None
                       and self.ranks.news_rides_gradients)
            if reduced and not self.core.reduce_gradients_with_news(attempt, not mine.is_quiet(self._quiet,
                                                                                                self.ranks.is_main)):
                agreed = self._quiet  # nobody had anything to say: the gradients are the batch's now
            else:
                agreed = self.ranks.agree(mine, self.core.device)
                self._quiet = agreed.quiet()
            if agreed.failed_micro_batch is not None and (self.keep_effective_batch or additive):
                # Another rank ran out of memory: this rank's whole attempt is retried with
                # it, so its losses go too (kept, they were counted twice).
                attempt.discard()
            if losses is None:
                losses = attempt.losses
            else:  # with keep_effective_batch=False, a failed attempt's stepped chunks count too
                losses.parts += attempt.losses.parts
            knobs.follow(agreed.micro_batch_size)  # rank 0's
            self.recovery.settle_relief(agreed.relief)
            if agreed.fatal:
                self.recovery.give_up_on_the_step(agreed.fatal, checkpoint)
            if agreed.failed_micro_batch is None:
                self._complete(attempt, n, optimizer_step, held, checkpoint, reduced)
                break
            # Out of the `except` block now, so the exception and its frames are gone and
            # the tensors they pinned (activations, partial gradients) can be freed.
            tried.append(agreed.failed_micro_batch)
            self.recovery.recover(agreed.failed_micro_batch, tried, attempt, holding=self.holding, fire=fire,
                                  carry_out=carry_out, checkpoint=checkpoint,
                                  last_good_micro_batch=self.last_good_micro)
            attempt = None
            measured = self.measured = True  # the retry is measured, whatever the cadence said
            rebase = False  # the room was measured after the clean-up
        return self._outcome(losses, len(tried), agreed, measured, additive)

    def _whole(self, batch: Any, n: int, held: list[tuple[nn.Parameter, torch.Tensor]] | None,
               proposal: Callable[[], dict[str, Any]] | None, checkpoint: Callable[..., Any]) -> BatchOutcome | Attempt:
        # The steady path's common batch: whole, in one piece, a plain loss (step.py's
        # `whole_batch`), then the step, with as few moves as the loop's own bookkeeping allows
        # (a ~1 ms step pays for each). Anything else comes back as an `Attempt` to go on with.
        core = self.core
        loss = core.whole_batch(batch, n)
        if type(loss) is Attempt:
            return loss
        agreed = self._agreed_alone(proposal)  # before the step, as the loop's agreement is
        if held:
            add_gradients(held)
        core.optimizer_step(n)  # alone, weighted by samples: nothing to reduce
        self._complete_failure(checkpoint)
        return self._outcome(Losses([(loss, n)]), 0, agreed, False, False)

    @property
    def _whole_batches(self) -> bool:
        # Whether the steady path may use the step core's whole-batch attempt (step.py): the
        # effective batch kept, no split_fn, no injected faults.
        core = self.core
        return self.keep_effective_batch and core.split_fn is None and not core.inject_oom

    def _agreed_alone(self, proposal: Callable[[], dict[str, Any]] | None) -> Agreement:
        # Alone, what this process proposes is agreed. Most batches propose what the last one did
        # (no signal, no checkpoint due): one record for them, not one a batch.
        size = self.knobs.micro_batch_size
        proposed = proposal() if proposal is not None else _NOTHING_PROPOSED
        if self._agreement is None or self._agreement.micro_batch_size != size or proposed != self._proposed:
            self._agreement, self._proposed = Agreement(None, size, **proposed), proposed
        return self._agreement

    def _complete(self, attempt: Attempt, n: int, optimizer_step: bool,
                  held: list[tuple[nn.Parameter, torch.Tensor]] | None, checkpoint: Callable[..., Any],
                  reduced: bool = False) -> None:
        # The attempt every rank agreed fit: its gradients reduced (`reduced`: already, with the
        # news), the held ones added, the step.
        if reduced:
            self.core.optimizer_step(n)
        elif optimizer_step and self.keep_effective_batch:
            if held and self.ranks.bucket is not None:
                # The held gradients are views of the ranks' gradient buffers: added into them first
                # (rank-alike already, so averaging leaves them as they are).
                add_gradients(held)
                held = None
            self.core.reduce_gradients(attempt)
            if held:
                add_gradients(held)
            self.core.optimizer_step(n)
        self._complete_failure(checkpoint)

    def _complete_failure(self, checkpoint: Callable[..., Any]) -> None:
        # The optimizer step ran out of memory, here or (known to every rank now) on another rank.
        failure = self.ranks.known_to_all(self.core.failure)
        if failure:
            self.recovery.give_up_on_the_step(failure, checkpoint)

    def _outcome(self, losses: Losses | None, retries: int, agreed: Agreement, measured: bool,
                 additive: bool) -> BatchOutcome:
        if self.core.skipped:
            self.recovery.report_skipped(losses, self.keep_effective_batch)
        self.last_good_micro = self.knobs.micro_batch_size
        self.cadence.done(measured, self.demand.finish() if measured else None)
        return BatchOutcome(retries, losses if losses is not None else Losses(additive=additive),
                            self.core.device, agreed)


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
